"""`ember serve` with the bundled examples, driven by the real tritonclient and openai clients."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.slow

SENTENCES = ["The cold start is the enemy.", "ember keeps models warm.", "Ein Satz auf Deutsch."]


def triton_client(server: Any) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(url=server.url.removeprefix("http://"))


def embed_v2(server: Any, sentences: list[str], binary: bool) -> np.ndarray:
    client = triton_client(server)
    text = triton.InferInput("text", [len(sentences)], "BYTES")
    text.set_data_from_numpy(np.array([s.encode() for s in sentences], dtype=object), binary_data=binary)
    out = triton.InferRequestedOutput("embedding", binary_data=binary)
    result = client.infer("minilm", [text], outputs=[out])
    array: np.ndarray = result.as_numpy("embedding")
    return array


def test_server_and_model_metadata(examples_server: Any) -> None:
    client = triton_client(examples_server)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("minilm") and client.is_model_ready("iris")
    meta = client.get_model_metadata("minilm")
    assert meta["inputs"][0]["name"] == "text" and meta["inputs"][0]["datatype"] == "BYTES"
    index = {m["name"]: m["state"] for m in client.get_model_repository_index()}
    assert index == {"minilm": "READY", "iris": "READY", "smollm2": "READY"}


@pytest.mark.parametrize("binary", [True, False])
def test_v2_embeddings_are_unit_vectors_and_deterministic(examples_server: Any, binary: bool) -> None:
    vectors = embed_v2(examples_server, SENTENCES, binary)
    assert vectors.shape == (3, 384) and vectors.dtype == np.float32
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)
    assert np.allclose(embed_v2(examples_server, SENTENCES[:1], binary)[0], vectors[0], atol=1e-5)


def test_openai_client_float_and_base64_agree_with_v2(examples_server: Any) -> None:
    client = openai.OpenAI(base_url=examples_server.url + "/v1", api_key="unused")
    assert "minilm" in [m.id for m in client.models.list()]
    floats = client.embeddings.create(model="minilm", input=SENTENCES)
    assert [d.index for d in floats.data] == [0, 1, 2] and floats.usage.prompt_tokens > 0
    raw = httpx.post(examples_server.url + "/v1/embeddings",
                     json={"model": "minilm", "input": SENTENCES[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    v2 = embed_v2(examples_server, SENTENCES, binary=True)
    assert np.allclose(np.array(floats.data[0].embedding), v2[0], atol=1e-5)
    assert np.allclose(decoded, v2[0], atol=1e-5)


def test_python_runtime_example_classifies_iris(examples_server: Any) -> None:
    client = triton_client(examples_server)
    features = triton.InferInput("features", [2, 4], "FP32")
    features.set_data_from_numpy(np.array([[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]], np.float32))
    result = client.infer("iris", [features])
    assert [s.decode() if isinstance(s, bytes) else s for s in result.as_numpy("species")] == ["setosa", "virginica"]


def test_bad_input_is_a_clear_error_and_disturbs_nothing(examples_server: Any) -> None:
    url = examples_server.url
    client = triton_client(examples_server)
    with pytest.raises(InferenceServerException, match="nope"):
        client.infer("nope", [triton.InferInput("text", [1], "BYTES")])
    wrong = triton.InferInput("text", [1], "FP32")
    wrong.set_data_from_numpy(np.zeros(1, np.float32))
    with pytest.raises(InferenceServerException, match="input 'text'"):
        client.infer("minilm", [wrong])
    r = httpx.post(url + "/v2/models/minilm/infer", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]
    r = httpx.post(url + "/v2/models/iris/infer", json={"inputs": [
        {"name": "features", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]})
    assert r.status_code == 400 and "features" in r.json()["error"]
    r = httpx.post(url + "/v1/embeddings", content=b"x" * (65 * 2**20), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "error" in r.json()
    r = httpx.post(url + "/v1/embeddings", json={"model": "minilm"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    assert embed_v2(examples_server, SENTENCES[:1], True).shape == (1, 384)


def test_metrics_have_a_histogram_per_ladder_rung(examples_server: Any) -> None:
    embed_v2(examples_server, SENTENCES[:1], True)
    text = httpx.get(examples_server.url + "/metrics").text
    assert "ember_ladder_time_to_first_response_seconds_bucket" in text
    assert 'ember_requests_total{' in text


def test_ember_status_shows_instances_with_memory(examples_server: Any) -> None:
    embed_v2(examples_server, SENTENCES[:1], True)
    out = subprocess.run([sys.executable, "-m", "ember", "status", "--json", "--url", examples_server.url],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    models = {m["name"]: m for m in json.loads(out)["models"]}
    minilm = models["minilm"]
    assert minilm["template"]["pss_bytes"] > 50 * 2**20
    inst = minilm["instances"][0]
    assert inst["pid"] > 0 and inst["rung"] in ("template", "zygote") and inst["pss_bytes"] > 0
    node = json.loads(out)["node"]
    assert {"sentence-transformers", "python"} <= {z["runtime"] for z in node["zygotes"]}
    table = subprocess.run([sys.executable, "-m", "ember", "status", "--url", examples_server.url],
                           capture_output=True, text=True, timeout=60, check=True).stdout
    assert "minilm" in table and "zygotes" in table and "job queue" in table


def test_status_of_a_server_that_is_not_there_is_a_clear_error() -> None:
    proc = subprocess.run([sys.executable, "-m", "ember", "status", "--url", "http://127.0.0.1:9"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "cannot reach ember" in proc.stderr


def test_the_bundled_llm_answers_chat_plain_and_streamed_with_the_real_openai_client(examples_server: Any) -> None:
    client = openai.OpenAI(base_url=examples_server.url + "/v1", api_key="-", max_retries=0, timeout=120)
    # (Not "What is the capital of France?": a 0.1-logit near-tie in llama.cpp's Q4_1 logits, docs/llm.md.)
    question = [{"role": "user", "content": "Answer in one word: what is the capital of France?"}]
    out = client.chat.completions.create(model="smollm2", messages=question, temperature=0, max_tokens=16)
    assert "Paris" in (out.choices[0].message.content or "")
    assert out.usage is not None and 0 < out.usage.completion_tokens <= 16
    chunks = list(client.chat.completions.create(model="smollm2", messages=question, temperature=0, max_tokens=16,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == out.choices[0].message.content   # greedy: the same answer streamed
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == out.usage.completion_tokens
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model="smollm2", messages=question, max_tokens=100_000)


# --- the clients of evaluation and retrieval: lm-eval's log-likelihoods, token-id embeddings ------------------


def openai_client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0, timeout=120)


def test_lm_evals_parse_logprobs_reads_an_echoed_prompts_log_likelihood(examples_server: Any) -> None:
    """lm-eval's log-likelihood request (its LocalCompletionsAPI payload: echo, logprobs 1, max_tokens 1; and the
    max_tokens 0 form) through the openai SDK, read by lm-eval's own parse_logprobs: the continuation's
    log-likelihood, and whether it is the greedy one."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    client = openai_client(examples_server)
    api = LocalCompletionsAPI(model="smollm2", base_url=examples_server.url + "/v1/completions",
                              tokenizer_backend=None, tokenized_requests=False)
    context = "The capital of France is"
    greedy = client.completions.create(model="smollm2", prompt=context, max_tokens=1, temperature=0).choices[0].text

    def ask(prompt: str, max_tokens: int) -> dict[str, Any]:
        payload = {**api._create_payload(prompt, generate=False), "max_tokens": max_tokens}
        body: dict[str, Any] = client.completions.create(**payload).model_dump()
        return body

    ctxlen = ask(context, 0)["usage"]["prompt_tokens"]
    for continuation, is_greedy in ((greedy, True), (" a zebra", False)):
        body = ask(context + continuation, 1)
        logprobs = body["choices"][0]["logprobs"]
        assert logprobs["top_logprobs"][0] is None and all(len(t) == 1 for t in logprobs["top_logprobs"][1:])
        [(total, greedy_found)] = LocalCompletionsAPI.parse_logprobs(body, ctxlens=[ctxlen])
        assert total == pytest.approx(sum(logprobs["token_logprobs"][ctxlen:-1])) and total < 0
        assert greedy_found is is_greedy
        prompt_only = ask(context + continuation, 0)   # the form: the prompt's entries alone
        assert len(prompt_only["choices"][0]["logprobs"]["tokens"]) == prompt_only["usage"]["prompt_tokens"]
        assert len(LocalCompletionsAPI.parse_logprobs(prompt_only, ctxlens=[ctxlen])) == 1


def test_v2_infer_on_the_llm_answers_its_declared_one_row(examples_server: Any) -> None:
    client = triton_client(examples_server)
    request = triton.InferInput("request", [1], "BYTES")
    request.set_data_from_numpy(np.array([json.dumps({"prompt": "Once upon a time", "max_tokens": 4,
                                                      "temperature": 0}).encode()], dtype=object))
    result = client.infer("smollm2", [request])
    text = result.as_numpy("text")
    assert text.shape == (1,) and result.as_numpy("completion_tokens").tolist() == [4]
    assert result.as_numpy("finish_reason").tolist() == [b"length"]
    same = openai_client(examples_server).completions.create(model="smollm2", prompt="Once upon a time",
                                                              max_tokens=4, temperature=0)
    assert text[0].decode() == same.choices[0].text


def test_completion_tokens_do_not_count_the_end_of_sequence_token(examples_server: Any) -> None:
    """A chat that ends on its end-of-sequence token counts the tokens before it (as llama.cpp's server and vLLM
    do): one per streamed content chunk, in the plain answer's usage and the stream's."""
    client = openai_client(examples_server)
    question = [{"role": "user", "content": "What is 2+2? Answer with a number only."}]
    out = client.chat.completions.create(model="smollm2", messages=question, temperature=0, max_tokens=60)
    assert out.choices[0].finish_reason == "stop" and out.usage is not None
    chunks = list(client.chat.completions.create(model="smollm2", messages=question, temperature=0, max_tokens=60,
                                                 stream=True, stream_options={"include_usage": True}))
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(content)
    assert out.usage.completion_tokens == len(content)


def minilm_ids(texts: list[str]) -> list[list[int]]:
    """MiniLM's own tokenizer's ids ([CLS] and [SEP] included), as the runtime makes them from the text."""
    from tokenizers import Tokenizer

    from ember.wire.contract import example_contracts_dir, load_contract

    weights = load_contract(example_contracts_dir() / "minilm.yaml").weights_path()
    assert weights is not None
    tokenizer = Tokenizer.from_file(str(weights / "tokenizer.json"))
    tokenizer.no_padding()   # its file pads to 128
    return [e.ids for e in tokenizer.encode_batch(texts)]


def test_embeddings_of_token_ids_in_the_models_vocabulary(examples_server: Any) -> None:
    client = openai_client(examples_server)
    texts = client.embeddings.create(model="minilm", input=SENTENCES)
    ids = minilm_ids(SENTENCES)
    nested = client.embeddings.create(model="minilm", input=ids)
    for by_ids, by_text in zip(nested.data, texts.data, strict=True):
        assert np.allclose(by_ids.embedding, by_text.embedding, atol=1e-5)
    assert nested.usage.prompt_tokens == sum(len(row) for row in ids) == texts.usage.prompt_tokens
    flat = client.embeddings.create(model="minilm", input=ids[0])
    assert len(flat.data) == 1 and np.allclose(flat.data[0].embedding, texts.data[0].embedding, atol=1e-5)
    with pytest.raises(openai.BadRequestError, match=r"input\[1\]\[2\]: token id 30522 is not in the model's "
                                                     r"vocabulary \(0 to 30521\)"):
        client.embeddings.create(model="minilm", input=[ids[0], [101, 7592, 30522, 102]])


def test_langchain_openai_embeddings_send_token_ids_and_chunks(examples_server: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """LangChain's OpenAIEmbeddings with check_embedding_ctx_length (its default): with tiktoken (the default,
    cl100k_base read from litellm's bundled copy: these tests run offline) it sends token ids, which MiniLM takes
    as its own (as vLLM does), or refuses naming the one outside its vocabulary; with MiniLM's own tokenizer
    (tiktoken_enabled=False) it sends each chunk of embedding_ctx_length tokens as text."""
    import importlib.util

    import tiktoken
    from langchain_openai import OpenAIEmbeddings

    from ember.wire.contract import example_contracts_dir, load_contract

    litellm = importlib.util.find_spec("litellm")   # its bundled tiktoken files, without importing it
    assert litellm is not None and litellm.origin is not None
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(Path(litellm.origin).parent / "litellm_core_utils" / "tokenizers"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    client = openai_client(examples_server)
    base = {"model": "minilm", "base_url": examples_server.url + "/v1", "api_key": "-", "max_retries": 0}
    default = OpenAIEmbeddings(**base, check_embedding_ctx_length=True)
    sent = tiktoken.get_encoding("cl100k_base").encode_ordinary("hello world")
    assert max(sent) < 30522   # ids MiniLM has
    [vector] = default.embed_documents(["hello world"])
    assert np.allclose(vector, client.embeddings.create(model="minilm", input=[sent]).data[0].embedding, atol=1e-5)
    with pytest.raises(openai.BadRequestError, match=r"input\[0\]\[\d+\]: token id \d+ is not in the model's vocab"):
        default.embed_documents([SENTENCES[2]])   # cl100k ids past MiniLM's 30522
    weights = load_contract(example_contracts_dir() / "minilm.yaml").weights_path()
    own = OpenAIEmbeddings(**base, check_embedding_ctx_length=True, tiktoken_enabled=False,
                           tiktoken_model_name=str(weights), embedding_ctx_length=8)
    long_text = " ".join(SENTENCES)   # more than 8 tokens: chunks, averaged by LangChain
    [short, long_] = own.embed_documents([SENTENCES[0], long_text])
    direct = client.embeddings.create(model="minilm", input=SENTENCES[0]).data[0].embedding
    assert float(np.dot(short, direct)) > 0.999 and np.linalg.norm(long_) == pytest.approx(1.0, abs=1e-4)
