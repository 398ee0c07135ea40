"""The OpenAI features the llm runtime carries out itself, on SmolLM2 and llama.cpp: structured output by grammar,
log-probabilities, logit_bias, echo, stop strings (docs/llm-convention.md)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from ember.errors import InvalidInput
from ember.runtimes.llm import LLMModel
from ember.wire.generation import parse_request

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2(smollm2: LLMModel) -> LLMModel:
    """SmolLM2 without a prefix cache: each prompt computed the same way every time, so two requests that should
    agree token for token do (a cache hit computes fewer rows: see test_llm_snapshots)."""
    return LLMModel(smollm2.contract, smollm2.engine, smollm2.options.model_copy(update={"prefix_cache_mb": 0}),
                    smollm2.model_id)

Reply = dict[str, np.ndarray]
COLOURS = {"type": "object", "additionalProperties": False, "required": ["colour", "bright"],
           "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]},
                          "bright": {"type": "boolean"}}}


def request(**fields: Any) -> dict[str, np.ndarray]:
    arr = np.empty(1, dtype=object)
    arr[0] = json.dumps(fields).encode()
    return {"request": arr}


def chat(question: str, **fields: Any) -> dict[str, np.ndarray]:
    return request(messages=[{"role": "user", "content": question}], **fields)


def text(replies: list[Reply]) -> str:
    return "".join(bytes(r["text"][0]).decode() for r in replies)


def entries(replies: list[Reply]) -> list[dict[str, Any]]:
    return [e for r in replies for e in json.loads(bytes(r["logprobs"][0]) or b"[]")]


def first_token(model: LLMModel, **fields: Any) -> int:
    req = parse_request(json.dumps({"temperature": 0, **fields}).encode())
    return model.tokens(model.prompt_ids(req), req, 1)[0]


def test_a_json_schema_bounds_the_output_to_json_that_matches_it(smollm2: LLMModel) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "colour", "schema": COLOURS, "strict": True}}
    for seed in (None, 1, 2):
        sampling = {"temperature": 0} if seed is None else {"temperature": 1.0, "seed": seed}
        replies = list(smollm2.stream(chat("What colour is the sky? Answer in JSON.", response_format=fmt,
                                           max_tokens=40, **sampling)))
        assert bytes(replies[-1]["finish_reason"][0]) == b"stop", text(replies)
        answer = json.loads(text(replies))
        assert set(answer) == {"colour", "bright"}
        assert answer["colour"] in ("red", "green", "blue") and isinstance(answer["bright"], bool)


def test_logprobs_under_a_grammar_are_strict_json(smollm2: LLMModel) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "colour", "schema": COLOURS}}
    replies = list(smollm2.stream(chat("What colour is the sky?", response_format=fmt, temperature=0, max_tokens=40,
                                       logprobs=True, top_logprobs=5)))

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in the logprobs: not JSON")

    found = [e for r in replies for e in json.loads(bytes(r["logprobs"][0]) or b"[]", parse_constant=refuse)]
    assert found and all(1 <= len(e["top_logprobs"]) <= 5 for e in found)
    assert any(len(e["top_logprobs"]) < 5 for e in found)   # where the grammar allows fewer tokens than that


def test_json_object_gives_an_object(smollm2: LLMModel) -> None:
    replies = list(smollm2.stream(chat("Give a JSON object with your name.", response_format={"type": "json_object"},
                                       temperature=0, max_tokens=48)))
    out = text(replies).lstrip()
    assert out.startswith("{")
    if bytes(replies[-1]["finish_reason"][0]) == b"stop":   # else the budget ended it mid-object
        assert isinstance(json.loads(out), dict)


def test_a_schema_llama_cpp_cannot_take_is_refused_before_any_reply(smollm2: LLMModel) -> None:
    with pytest.raises(InvalidInput, match=r"^response_format.json_schema.schema: cannot be turned into a grammar"):
        next(smollm2.stream(chat("Hi", response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "string", "pattern": "[a-z]+"}}})))


def test_logprobs_come_with_each_token_and_their_top_alternatives(smollm2: LLMModel) -> None:
    replies = list(smollm2.stream(chat("Name a fruit.", temperature=0, max_tokens=10, logprobs=True,
                                       top_logprobs=3)))
    found = entries(replies)
    finished = bytes(replies[-1]["finish_reason"][0])
    assert len(found) == len(replies) - (finished == b"stop")   # the end-of-text token has no entry
    for entry in found:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"} and entry["logprob"] <= 0
        top = entry["top_logprobs"]
        assert len(top) == 3 and [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert top[0]["bytes"] == entry["bytes"] and top[0]["logprob"] == pytest.approx(entry["logprob"])  # greedy
        assert sum(np.exp(t["logprob"]) for t in top) <= 1 + 1e-6
    assert b"".join(bytes(e["bytes"]) for e in found).decode() == text(replies)
    plain = list(smollm2.stream(chat("Name a fruit.", temperature=0, max_tokens=10)))
    assert all(bytes(r["logprobs"][0]) == b"" for r in plain) and text(plain) == text(replies)
    whole = smollm2.infer(chat("Name a fruit.", temperature=0, max_tokens=10, logprobs=True))
    assert [e["token"] for e in json.loads(bytes(whole["logprobs"][0]))] == [e["token"] for e in found]
    assert all(e["top_logprobs"] == [] for e in json.loads(bytes(whole["logprobs"][0])))


def test_logit_bias_moves_the_greedy_token(smollm2: LLMModel) -> None:
    fields = {"prompt": "The capital of France is", "max_tokens": 1}
    greedy = first_token(smollm2, **fields)
    banned = first_token(smollm2, **fields, logit_bias={str(greedy): -100})
    assert banned != greedy
    assert first_token(smollm2, **fields, logit_bias={"1000": 100}) == 1000
    out = smollm2.infer(request(**fields, temperature=0, logit_bias={str(greedy): -100}))
    assert bytes(out["text"][0]) == smollm2.engine.piece(banned)


def test_echo_leads_with_the_prompt_and_its_logprobs(smollm2: LLMModel) -> None:
    prompt = "The sky is blue because"
    replies = list(smollm2.stream(request(prompt=prompt, echo=True, logprobs=True, temperature=0, max_tokens=4)))
    first = bytes(replies[0]["text"][0]).decode()
    assert first.startswith(prompt) and len(first) > len(prompt)
    plain = list(smollm2.stream(request(prompt=prompt, temperature=0, max_tokens=4)))
    assert text(replies) == prompt + text(plain)
    prompt_tokens = int(replies[0]["prompt_tokens"][0])
    head = json.loads(bytes(replies[0]["logprobs"][0]))
    assert len(head) == prompt_tokens + 1   # every prompt token, then the first generated one
    assert head[0]["logprob"] is None and all(e["logprob"] <= 0 for e in head[1:])
    assert b"".join(bytes(e["bytes"]) for e in head[:prompt_tokens]).decode() == prompt
    echoed = list(smollm2.stream(request(prompt=prompt, echo=True, temperature=0, max_tokens=4)))
    assert text(echoed) == text(replies) and all(bytes(r["logprobs"][0]) == b"" for r in echoed)


def test_echoed_prompt_tokens_carry_their_top_alternatives(smollm2: LLMModel) -> None:
    """Each prompt token after the first carries the top_logprobs most likely tokens in its place (lm-eval's
    log-likelihood requests read them to tell a greedy continuation): a prompt that ends with the token the model
    would choose has it as its own top alternative."""
    context = "The capital of France is"
    greedy = smollm2.engine.piece(first_token(smollm2, prompt=context)).decode()
    for prompt, chosen in ((context + greedy, True), (context + " zebra", False)):
        replies = list(smollm2.stream(request(prompt=prompt, echo=True, logprobs=True, top_logprobs=2,
                                              temperature=0, max_tokens=1)))
        head = entries(replies)[: int(replies[0]["prompt_tokens"][0])]
        assert head[0]["logprob"] is None and head[0]["top_logprobs"] == []
        for entry in head[1:]:
            top = entry["top_logprobs"]
            assert len(top) == 2 and top[0]["logprob"] >= top[1]["logprob"] and entry["logprob"] <= top[0]["logprob"]
        assert (head[-1]["logprob"] == head[-1]["top_logprobs"][0]["logprob"]) is chosen
        assert (head[-1]["top_logprobs"][0]["token"] == head[-1]["token"]) is chosen


def test_the_end_of_sequence_token_is_not_counted(smollm2: LLMModel) -> None:
    """As llama.cpp's server and vLLM count: a completion that ends on its end-of-sequence token counts the tokens
    before it, in its last reply and in infer's one reply."""
    fields = {"messages": [{"role": "user", "content": "What is 2+2? Answer with a number only."}],
              "temperature": 0, "max_tokens": 60}
    replies = list(smollm2.stream(request(**fields)))
    assert bytes(replies[-1]["finish_reason"][0]) == b"stop"
    req = parse_request(json.dumps(fields).encode())
    generated = smollm2.tokens(smollm2.prompt_ids(req), req, 60)
    assert generated[-1] in smollm2.eos and len(replies) == len(generated)
    assert [int(r["completion_tokens"][0]) for r in replies] == [*range(1, len(generated)), len(generated) - 1]
    assert int(smollm2.infer(request(**fields))["completion_tokens"][0]) == len(generated) - 1


def test_a_stop_string_ends_the_text_before_it(smollm2: LLMModel) -> None:
    question = "Write a poem about the sea."
    whole = text(list(smollm2.stream(chat(question, temperature=0, max_tokens=24))))
    stop = whole[10:14]   # four characters in the middle, wherever the tokens' boundaries fall
    replies = list(smollm2.stream(chat(question, temperature=0, max_tokens=24, stop=[stop, "zzzz"])))
    assert text(replies) == whole[: whole.find(stop)] and bytes(replies[-1]["finish_reason"][0]) == b"stop"
