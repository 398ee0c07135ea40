"""The prefix cache and its snapshots in the weight store, on SmolLM2 and llama.cpp.

A cache hit restores the engine's own state bytes and computes only the rest of the prompt: two models that
restore the same bytes and compute the same rest give the same tokens exactly (a snapshot restored in a fresh
load, and the model that computed it). Against a prompt computed whole they agree up to near-ties: a prompt of
64 tokens or more runs other kernels than its last few tokens do (see test_llm_batching's docstring).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ember.runtimes import llm_snapshot as snap
from ember.runtimes.llm import LLMModel, LLMRuntime
from ember.wire.contract import ModelContract, parse_contract

pytestmark = pytest.mark.slow

Reply = dict[str, np.ndarray]
SYSTEM = "You are a careful assistant who answers in full sentences and checks every fact twice. " * 4
QUESTIONS = ["What is the capital of France?", "Name three colours.", "Why is the sky blue?", "What is 2+2?"]
NEAR_TIE = 0.5


def request(**fields: Any) -> dict[str, np.ndarray]:
    arr = np.empty(1, dtype=object)
    arr[0] = json.dumps(fields).encode()
    return {"request": arr}


def ask(question: str, system: str = SYSTEM, max_tokens: int = 12) -> dict[str, np.ndarray]:
    return request(messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
                   temperature=0, max_tokens=max_tokens, logprobs=True, top_logprobs=2)


def text(replies: list[Reply]) -> str:
    return "".join(bytes(r["text"][0]).decode() for r in replies)


def cached(replies: list[Reply]) -> int:
    return int(replies[-1]["cached_tokens"][0])


def agree_up_to_a_near_tie(alone: list[Reply], other: list[Reply]) -> int:
    """As in test_llm_batching: token for token, or parted at a near-tie onto the runner-up."""
    a = [e for r in alone for e in json.loads(bytes(r["logprobs"][0]) or b"[]")]
    b = [e for r in other for e in json.loads(bytes(r["logprobs"][0]) or b"[]")]
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x["bytes"] != y["bytes"]:
            top = x["top_logprobs"]
            assert y["bytes"] == top[1]["bytes"] and top[0]["logprob"] - top[1]["logprob"] < NEAR_TIE, (i, top, y)
            return i
    assert text(alone) == text(other)
    return len(a)


def fresh(model: LLMModel, contract: ModelContract | None = None, **options: Any) -> LLMModel:
    return LLMModel(contract or model.contract, model.engine, model.options.model_copy(update=options),
                    model.model_id)


def with_declared_prefix(model: LLMModel) -> ModelContract:
    """SmolLM2's contract whose warmup request declares SYSTEM as a prefix to keep warm."""
    warmup = json.dumps({"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}],
                         "max_tokens": 1, "temperature": 0})
    data = model.contract.model_dump(mode="json", exclude={"source"})
    data["warmup"] = {"requests": 1, "inputs": {"request": [warmup]}}
    return parse_contract(data)


def test_a_repeated_prompt_is_served_from_the_cache_and_changes_no_token(smollm2: LLMModel) -> None:
    model, uncached = fresh(smollm2), fresh(smollm2, prefix_cache_mb=0)
    first = list(model.stream(ask(QUESTIONS[0])))
    prompt = int(first[-1]["prompt_tokens"][0])
    assert cached(first) == 0 and len(model.decoder.cache) == 1
    again = list(model.stream(ask(QUESTIONS[0])))
    assert cached(again) == prompt - 1   # all but the last token, whose logits are needed
    assert again[-1]["cached_tokens"][0] == again[0]["cached_tokens"][0]   # every reply reports it
    assert agree_up_to_a_near_tie(first, again) > 0
    other = list(model.stream(ask(QUESTIONS[1])))   # the system prompt is shared
    assert prompt * 0.8 < cached(other) < int(other[-1]["prompt_tokens"][0])
    assert agree_up_to_a_near_tie(list(uncached.stream(ask(QUESTIONS[1]))), other) > 0
    assert cached(list(uncached.stream(ask(QUESTIONS[0])))) == 0 and len(uncached.decoder.cache) == 0
    assert model.decoder.cache.hits == 2


def test_declared_prefixes_are_saved_and_a_fresh_load_restores_them(smollm2: LLMModel, store_root: Path) -> None:
    contract = with_declared_prefix(smollm2)
    runtime = LLMRuntime(cache_root=store_root)
    computed = runtime.load(contract)   # computes the declared prefix and pushes its snapshot
    (declared,) = computed.declared_prefixes()
    name = snap.snapshot_name(computed.model_id, declared, "f16")
    assert computed.decoder.cache.covers(declared)
    assert (store_root / "manifests" / name.removesuffix(":1") / "1.json").is_file()   # in the store, by name
    assert snap.read_learned(store_root, computed.learned_id) == []
    restored = runtime.load(contract)   # restores it: nothing computed
    assert len(restored.decoder.cache) == 1 and restored.decoder.cache.covers(declared)
    assert fresh(smollm2, contract).prepare_prefixes(store_root) == {"restored": 1, "computed": 0}
    with_snapshot = list(restored.stream(ask(QUESTIONS[2])))
    assert cached(with_snapshot) > 0.8 * len(declared)   # up to where "Hi" and the question part
    assert text(with_snapshot) == text(list(computed.stream(ask(QUESTIONS[2]))))   # exact: the same bytes
    agree_up_to_a_near_tie(list(fresh(smollm2, prefix_cache_mb=0).stream(ask(QUESTIONS[2]))), with_snapshot)
    # Without snapshots (or without a cache) a load neither restores nor computes.
    plain = LLMRuntime(cache_root=store_root).load(contract.model_copy(update={"options": {
        **contract.options, "snapshots": False}}))
    assert len(plain.decoder.cache) == 0


def test_retire_saves_the_learned_prefixes_and_the_next_load_restores_them(smollm2: LLMModel,
                                                                            store_root: Path) -> None:
    runtime = LLMRuntime(cache_root=store_root)
    first = runtime.load(smollm2.contract)   # its declared prefix: the warmup's "Hi"
    assert first.retire() is None            # nothing learned yet (the declared one is saved already)
    system = "You are a pirate captain. Answer every question in the voice of a pirate, with nautical words. " * 3
    for question in QUESTIONS[:3]:           # the first leaves an entry, the next two hit it
        first.infer(ask(question, system, max_tokens=1))
    learned_now = first.retire()             # what its node keeps (as ember.node.keeping does)
    assert learned_now is not None and learned_now.root == store_root
    header, tensors = learned_now.frame()    # through the drained frame's fields, checked on the node's side
    assert snap.keep(snap.Learned.from_frame(header, tensors)) == 1
    assert first.retire() is None            # handed over once
    (learned,) = snap.read_learned(store_root, first.learned_id)
    assert (store_root / "manifests" / learned.removesuffix(":1") / "1.json").is_file()
    second = runtime.load(smollm2.contract)  # restores the declared and the learned prefix
    assert len(second.decoder.cache) == 2
    replies = list(second.stream(ask(QUESTIONS[3], system)))
    assert cached(replies) > 0.8 * int(replies[-1]["prompt_tokens"][0])
    assert text(replies) == text(list(first.stream(ask(QUESTIONS[3], system))))   # the same bytes restored
    none = smollm2.contract.model_copy(update={"options": {**smollm2.contract.options, "learned_snapshots": 0}})
    assert len(runtime.load(none).decoder.cache) == 1   # learned_snapshots 0: the declared prefix only
