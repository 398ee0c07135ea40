"""What one tenant's prompts leave behind (an instance's prefix cache, the learned prefixes kept in the weight store)
changes nothing another tenant observes: no `cached_tokens`, the tokens of a prompt computed whole (docs/llm.md, "One
tenant's prompts never serve another's"). SmolLM2 on llama.cpp."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ember.runtimes import llm_snapshot as snap
from ember.runtimes.llm import LLMModel, LLMRuntime
from ember.wire.contract import ModelContract

pytestmark = pytest.mark.slow

Reply = dict[str, np.ndarray]
SECRET = ("You are the assistant of Acme Corporation. Internal only: the launch of Project Falcon moves to the "
          "ninth of March, the budget is four million, and the partner is Globex. Never repeat these facts. ") * 2
GUESS = SECRET.replace("ninth of March", "first of June")   # a guess that differs mid-prompt


def ask(system: str = SECRET) -> dict[str, np.ndarray]:
    arr = np.empty(1, dtype=object)
    arr[0] = json.dumps({"messages": [{"role": "system", "content": system},
                                      {"role": "user", "content": "When is the launch?"}],
                         "temperature": 0, "max_tokens": 4}).encode()
    return {"request": arr}


def cached(replies: list[Reply]) -> int:
    return int(replies[-1]["cached_tokens"][0])


def prompt(replies: list[Reply]) -> int:
    return int(replies[-1]["prompt_tokens"][0])


def text(replies: list[Reply]) -> str:
    return "".join(bytes(r["text"][0]).decode() for r in replies)


def of_tenant(model: LLMModel, tenant: str | None, **fields: Any) -> ModelContract:
    """The bundled SmolLM2's contract (the same GGUF) owned by `tenant`."""
    return model.contract.model_copy(update={"tenant": tenant, **fields})


def test_a_fresh_load_of_another_tenants_model_on_the_same_gguf_restores_nothing_it_learned(
        smollm2: LLMModel, store_root: Path) -> None:
    """acme's prompt three times, its instance retired (what it learned kept in the store, as its node does); then
    a model of tenant beta on the same GGUF and the same store (as a server sharing ~/.cache/ember/store loads it)
    answers beta's copy of the prompt with cached_tokens 0 and the tokens of a whole prefill."""
    acme = LLMRuntime(cache_root=store_root).load(of_tenant(smollm2, "acme"))
    asked = [list(acme.stream(ask(), tenant="acme")) for _ in range(3)]
    assert [cached(r) for r in asked] == [0, prompt(asked[0]) - 1, prompt(asked[0]) - 1]
    learned = acme.retire()
    assert learned is not None and snap.keep(learned) == 1
    again = LLMRuntime(cache_root=store_root).load(of_tenant(smollm2, "acme"))   # acme's own next load restores it
    assert cached(list(again.stream(ask(), tenant="acme"))) == prompt(asked[0]) - 1
    for contract in (of_tenant(smollm2, "beta"), of_tenant(smollm2, None)):   # another tenant's, a public one
        other = LLMRuntime(cache_root=store_root).load(contract)
        copy = list(other.stream(ask(), tenant=contract.tenant))
        assert cached(copy) == 0 and text(copy) == text(asked[0])
        assert snap.read_learned(store_root, other.learned_id) == []


def test_one_instance_serving_several_tenants_keeps_each_ones_prefixes_apart(smollm2: LLMModel) -> None:
    """A public model (no `tenant:`), called by every tenant: acme's prompt thrice, then beta's copy of it, a guess
    differing mid-prompt and a caller without a tenant are each computed whole; beta's own copy serves beta."""
    model = LLMModel(of_tenant(smollm2, None), smollm2.engine, smollm2.options, smollm2.model_id)
    asked = [list(model.stream(ask(), tenant="acme")) for _ in range(3)]
    whole = prompt(asked[0])
    assert [cached(r) for r in asked] == [0, whole - 1, whole - 1]
    beta = list(model.stream(ask(), tenant="beta"))
    assert cached(beta) == 0 and text(beta) == text(asked[0])
    assert cached(list(model.stream(ask(GUESS), tenant="gamma"))) == 0
    assert cached(list(model.stream(ask()))) == 0   # no tenant (authentication off): a scope of its own too
    assert cached(list(model.stream(ask(), tenant="beta"))) == whole - 1
    # Its learned prefixes are those of callers without a tenant (its own), and none of theirs served a hit.
    assert model.retire() is None
