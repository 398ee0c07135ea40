"""KV-prefix snapshots in the weight store: a restored float32 snapshot changes no token; INT8 is measured
(greedy agreement and the largest logit difference over a fixed prompt set) and is the default only if it
agrees on at least 99% of tokens."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ember.runtimes import llm_snapshot as snap
from ember.runtimes.llm import LLMModel, LLMOptions, LLMRuntime
from ember.runtimes.llm_batch import KVSlots, prefill
from ember.runtimes.llm_request import Request

pytestmark = pytest.mark.slow

SYSTEMS = ["You are a careful assistant who answers in full sentences and checks every fact twice. " * 6,
           "You are a pirate captain. Answer every question in the voice of a pirate, with nautical words. " * 5]
QUESTIONS = ["What is the capital of France?", "Name three colours.", "Why is the sky blue?", "What is 2+2?"]
NEW_TOKENS = 16


def inputs(**fields: Any) -> dict[str, np.ndarray]:
    arr = np.empty(1, dtype=object)
    arr[0] = json.dumps(fields).encode()
    return {"request": arr}


def prompt(model: LLMModel, system: str, question: str | None = None) -> list[int]:
    messages = [{"role": "system", "content": system}]
    if question is not None:
        messages.append({"role": "user", "content": question})
    return model.prompt_ids(Request(messages=tuple((m["role"], m["content"]) for m in messages)))


def fresh(model: LLMModel, **options: Any) -> LLMModel:
    return LLMModel(model.contract, model.root, LLMOptions(**{**model.options.model_dump(), **options}))


def with_prefixes(model: LLMModel, store: Path, encoding: snap.Encoding) -> tuple[LLMModel, list[int]]:
    """A model whose prefix cache holds only the system prompts, restored from snapshots; their file sizes."""
    restored, sizes = fresh(model), []
    with snap_store(store) as s:
        for system in SYSTEMS:
            ids = prompt(model, system)
            kv = KVSlots(model.decoder.w, 1)
            prefill(model.decoder.w, kv, 0, ids)
            name = snap.snapshot_name(model.model_id, ids, encoding)
            sizes.append(snap.save(s, name, ids, kv.export(0, len(ids)), encoding))
            found = snap.restore(s, name, model.decoder.w.dtype)
            assert found is not None and found[0] == ids
            restored.decoder.cache.insert(*found)
    return restored, sizes


def snap_store(root: Path) -> Any:
    from ember.runtimes.llm import _store

    return _store(root)


def greedy(model: LLMModel, system: str, question: str) -> tuple[list[int], int]:
    ids = prompt(model, system, question)
    before = model.decoder.cache.hit_tokens
    tokens = model.tokens(ids, Request(prompt="", temperature=0.0), NEW_TOKENS)
    return tokens, model.decoder.cache.hit_tokens - before


def first_logits(model: LLMModel, system: str, question: str) -> np.ndarray:
    ids = prompt(model, system, question)
    w, kv = model.decoder.w, KVSlots(model.decoder.w, 1)
    n, cached = model.decoder.cache.lookup(ids)
    if cached is not None:
        kv.restore(0, cached)
    return prefill(w, kv, 0, ids[n:]).numpy()


def test_a_restored_float32_snapshot_gives_the_tokens_of_recomputing(smollm2: LLMModel, tmp_path: Path) -> None:
    recompute = fresh(smollm2, prefix_cache_mb=0)
    restored, _ = with_prefixes(smollm2, tmp_path, "float32")
    for system in SYSTEMS:
        for question in QUESTIONS[:2]:
            tokens, hit = greedy(restored, system, question)
            assert hit > 0.8 * len(prompt(smollm2, system))
            assert tokens == greedy(recompute, system, question)[0]


def test_int8_snapshots_are_measured_and_on_by_default_only_if_they_agree(smollm2: LLMModel, tmp_path: Path) -> None:
    recompute = fresh(smollm2, prefix_cache_mb=0)
    fp32, fp32_sizes = with_prefixes(smollm2, tmp_path / "fp32", "float32")
    int8, int8_sizes = with_prefixes(smollm2, tmp_path / "int8", "int8")
    agree = total = 0
    worst = 0.0
    for system in SYSTEMS:
        for question in QUESTIONS:
            expected, _ = greedy(recompute, system, question)
            got, hit = greedy(int8, system, question)
            assert hit > 0
            same = next((i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b), len(expected))
            agree, total = agree + same, total + len(expected)
            worst = max(worst, float(np.abs(first_logits(int8, system, question)
                                            - first_logits(fp32, system, question)).max()))
    ratio = sum(int8_sizes) / sum(fp32_sizes)
    print(f"\nINT8 KV snapshots: greedy agreement {agree}/{total} tokens ({agree / total:.1%}) before the first "
          f"divergence, largest first-token logit difference {worst:.3f}, bytes {ratio:.1%} of float32")
    assert ratio <= 0.30
    default = LLMOptions().snapshot_encoding
    assert default == ("int8" if agree / total >= 0.99 else "float32"), (agree / total, default)


def test_a_template_load_restores_declared_prefixes_and_an_instance_keeps_what_it_learned(
        smollm2: LLMModel, tmp_path: Path) -> None:
    os.symlink(smollm2.root.parent, tmp_path / "converted")   # the conversion, without converting again
    runtime = LLMRuntime(cache_root=tmp_path)
    first = runtime.load(smollm2.contract)                      # computes the warmup prompt, saves its snapshot
    second = runtime.load(smollm2.contract)                     # restores it
    assert len(second.decoder.cache) == 1 and second.decoder.cache.covers(second.declared_prefixes()[0])
    system = SYSTEMS[0]
    for question in QUESTIONS[:3]:
        second.infer(inputs(messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
                            temperature=0, max_tokens=1))
    assert second.retire() == 1
    third = runtime.load(smollm2.contract)                      # restores the declared and the learned prefix
    assert len(third.decoder.cache) == 2
    _, hit = greedy(third, system, QUESTIONS[3])
    assert hit > 0.8 * len(prompt(smollm2, system))
    del first
