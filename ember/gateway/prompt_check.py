"""Refusing a generation that cannot fit before any rung is claimed: the `llm` runtime's own prompt checks
(`ember.runtimes.llm.PromptCheck`: the chat template rendered, the prompt tokenized with the GGUF's vocabulary,
its length and budget against the served context), run off the event loop, one checker per model kept.

A model whose weights are not a local GGUF (a `store:` model, a file not there) has no checker here: its
instance refuses such a request itself, after tokenizing and before it takes any KV.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence

import anyio

from ember.errors import EmberError
from ember.wire.contract import ModelContract
from ember.wire.tensors import Tensors

log = logging.getLogger("ember.gateway")

_checks: dict[tuple[str, str | None, str], Callable[[bytes], None] | None] = {}


def checker(contract: ModelContract) -> Callable[[bytes], None] | None:
    """The model's checker, made once per contract as deployed (a redeploy with other options gets a new one)."""
    key = (contract.key, contract.weights, json.dumps(contract.options, sort_keys=True, default=str))
    if key not in _checks:
        _checks[key] = _build(contract)
    return _checks[key]


def _build(contract: ModelContract) -> Callable[[bytes], None] | None:
    if contract.runtime != "llm" or contract.store_ref is not None:
        return None
    try:
        from ember.runtimes.llm import PromptCheck

        return PromptCheck(contract)
    except (EmberError, OSError, ImportError) as err:   # the instance checks anyway; say why the gateway cannot
        log.info("model %s: no prompt check in the gateway: %s", contract.key, err)
        return None


async def check_prompts(contract: ModelContract, inputs: Sequence[Tensors]) -> None:
    """InvalidInput (a 400) for the first of the distinct generation requests that an instance would refuse."""
    check = checker(contract)
    if check is None:
        return
    seen: set[bytes] = set()
    for tensors in inputs:
        raw = bytes(tensors["request"].reshape(-1)[0])
        if raw not in seen:
            seen.add(raw)
            await anyio.to_thread.run_sync(check, raw)
