"""A real uvicorn server over FakeService, driven by the real tritonclient.http and openai clients."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from ember.errors import WorkerCrashed
from ember.gateway.app import create_app
from ember.jobs.store import JobStore
from ember.metrics import Metrics
from ember.testing.asgi import ThreadedServer
from ember.testing.service import FakeService, fake_embedding


@dataclass
class Served:
    service: FakeService
    port: int

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    service = FakeService(jobs=JobStore(tmp_path / "jobs.sqlite3", max_queued=10, result_ttl_s=60))
    app = create_app(service, Metrics(), max_body_bytes=1024 * 1024)
    try:
        with ThreadedServer(app) as server:
            yield Served(service, server.port)
    finally:
        assert service.jobs is not None
        service.jobs.close()


@pytest.fixture
def tc(served: Served) -> Iterator[triton.InferenceServerClient]:
    client = triton.InferenceServerClient(served.url)
    yield client
    client.close()


def affine_request(x: np.ndarray, binary_in: bool) -> triton.InferInput:
    inp = triton.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary_in)
    return inp


@pytest.mark.parametrize("binary_in", [True, False])
@pytest.mark.parametrize("binary_out", [True, False])
def test_tritonclient_infer(tc: triton.InferenceServerClient, binary_in: bool, binary_out: bool) -> None:
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    outputs = [triton.InferRequestedOutput("y", binary_data=binary_out),
               triton.InferRequestedOutput("norm", binary_data=binary_out)]
    result = tc.infer("affine", [affine_request(x, binary_in)], outputs=outputs, request_id="r-1")
    assert np.array_equal(result.as_numpy("y"), x * 2 + 1)
    assert np.allclose(result.as_numpy("norm"), np.linalg.norm((x * 2 + 1).astype(np.float64), axis=1))
    assert result.get_response()["id"] == "r-1"


@pytest.mark.parametrize("compression", ["gzip", "deflate"])
def test_tritonclient_compressed_requests(tc: triton.InferenceServerClient, compression: str) -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    result = tc.infer("affine", [affine_request(x, True)], request_compression_algorithm=compression,
                      response_compression_algorithm=compression)
    assert np.array_equal(result.as_numpy("y"), x * 2 + 1)


def test_tritonclient_default_outputs_and_bytes(tc: triton.InferenceServerClient) -> None:
    texts = np.array(["sm\u00f8rrebr\u00f8d".encode(), b"two words"], dtype=object)
    for binary in (True, False):
        inp = triton.InferInput("text", [2], "BYTES")
        inp.set_data_from_numpy(texts, binary_data=binary)
        echo = tc.infer("echo", [inp])  # no outputs named: tritonclient asks for all of them in binary
        assert list(echo.as_numpy("upper")) == [t.upper() for t in texts]
        emb = tc.infer("embedder", [inp], model_version="1")
        assert np.allclose(emb.as_numpy("embedding")[0], fake_embedding(texts[0]))
        assert list(emb.as_numpy("token_count")) == [3, 4]


def test_tritonclient_health_metadata_and_repository(served: Served, tc: triton.InferenceServerClient) -> None:
    assert tc.is_server_live() and tc.is_server_ready()
    assert tc.get_server_metadata()["name"] == "ember"
    meta = tc.get_model_metadata("affine")
    assert meta["platform"] == "python" and meta["inputs"][0] == {"name": "x", "datatype": "FP32", "shape": [-1, 3]}
    tc.unload_model("echo")
    assert not tc.is_model_ready("echo") and not tc.is_server_ready()
    index = {m["name"]: m["state"] for m in tc.get_model_repository_index()}
    assert index == {"embedder": "READY", "affine": "READY", "chatter": "READY", "echo": "UNAVAILABLE"}
    tc.load_model("echo")
    assert tc.is_model_ready("echo") and tc.is_server_ready()
    served.service.ready = False
    assert not tc.is_server_ready()


def test_tritonclient_errors_carry_our_message(served: Served, tc: triton.InferenceServerClient) -> None:
    x = np.zeros((1, 3), dtype=np.float32)
    with pytest.raises(InferenceServerException, match="model 'nope' is not deployed") as err:
        tc.infer("nope", [affine_request(x, True)])
    assert err.value.status() == "404"
    wrong = triton.InferInput("x", [1, 3], "INT32")
    wrong.set_data_from_numpy(np.zeros((1, 3), dtype=np.int32))
    with pytest.raises(InferenceServerException, match="input 'x': datatype INT32 does not match") as err:
        tc.infer("affine", [wrong])
    assert err.value.status() == "400"
    with pytest.raises(InferenceServerException, match="model 'nope'"):
        tc.load_model("nope")
    served.service.failure = WorkerCrashed("model 'affine:1': instance died")
    with pytest.raises(InferenceServerException, match="instance died") as err:
        tc.infer("affine", [affine_request(x, False)])
    assert err.value.status() == "502"


def test_tritonclient_sees_202_as_an_error_with_the_job(served: Served, tc: triton.InferenceServerClient) -> None:
    # tritonclient treats anything but 200 as an error; the job is still queued and can be polled.
    served.service.no_capacity = True
    with pytest.raises(InferenceServerException) as err:
        tc.infer("affine", [affine_request(np.ones((1, 3), np.float32), True)])
    assert err.value.status() == "202"
    assert served.service.jobs is not None and served.service.jobs.queued_count("affine") == 1


def test_openai_client_float_and_base64(served: Served) -> None:
    client = openai.OpenAI(base_url=f"http://{served.url}/v1", api_key="x", max_retries=0)
    try:
        assert [m.id for m in client.models.list()] == ["affine", "chatter", "echo", "embedder"]
        out = client.embeddings.create(model="embedder", input=["hello world", "x"], encoding_format="float")
        assert out.model == "embedder" and out.usage.prompt_tokens == 7
        assert np.allclose(out.data[0].embedding, fake_embedding(b"hello world"))
        raw = client.embeddings.with_raw_response.create(model="embedder", input="hello", encoding_format="base64")
        vec = np.frombuffer(base64.b64decode(raw.http_response.json()["data"][0]["embedding"]), dtype="<f4")
        assert np.array_equal(vec, fake_embedding(b"hello"))
        asked = client.embeddings.create(model="embedder", input="hello", encoding_format="base64")
        assert asked.data[0].embedding == raw.http_response.json()["data"][0]["embedding"]  # handed over as is
        # Unasked, the client requests base64 itself and decodes it: our bytes must be what it expects.
        default = client.embeddings.create(model="embedder", input="hello")
        assert np.allclose(default.data[0].embedding, fake_embedding(b"hello"))
    finally:
        client.close()


def test_openai_client_errors(served: Served) -> None:
    client = openai.OpenAI(base_url=f"http://{served.url}/v1", api_key="x", max_retries=0)
    try:
        with pytest.raises(openai.NotFoundError, match="model 'gpt-9' is not deployed") as nf:
            client.embeddings.create(model="gpt-9", input="a")
        assert nf.value.code == "model_not_found" and nf.value.param == "model"
        with pytest.raises(openai.BadRequestError, match=r"input\[0\]\[1\]: token id -2 is not one") as bad:
            client.embeddings.create(model="embedder", input=[[1, -2, 3]])
        assert bad.value.param == "input"
        with pytest.raises(openai.BadRequestError, match="not an embedding model"):
            client.embeddings.create(model="affine", input="a")
        with pytest.raises(openai.BadRequestError, match="dimensions=3 is not supported"):
            client.embeddings.create(model="embedder", input="a", dimensions=3)
    finally:
        client.close()


def test_openai_client_chat_plain_and_streamed(served: Served) -> None:
    client = openai.OpenAI(base_url=f"http://{served.url}/v1", api_key="-", max_retries=0)
    messages: Any = [{"role": "user", "content": "one two three"}]
    out = client.chat.completions.create(model="chatter", messages=messages, max_tokens=2)
    assert out.choices[0].message.content == "one two " and out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 2
    chunks = list(client.chat.completions.create(model="chatter", messages=messages, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "one two three "
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    text = "".join(c.choices[0].text for c in client.completions.create(model="chatter", prompt="a b", stream=True))
    assert text == "a b "


def test_openai_client_sees_a_mid_stream_failure_as_an_error(served: Served) -> None:
    served.service.fail_stream_after = 1
    client = openai.OpenAI(base_url=f"http://{served.url}/v1", api_key="-", max_retries=0)
    with pytest.raises(openai.APIError, match="the model failed on this request"):
        list(client.chat.completions.create(model="chatter", messages=[{"role": "user", "content": "a b c"}],
                                            stream=True))
