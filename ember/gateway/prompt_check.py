"""Refusing a request an instance would refuse at once, before any rung is claimed and before a job is accepted
(a 202 must not be followed by a failure the gateway could have answered with a 400).

`llm` models: the runtime's own checks (`ember.runtimes.llm.PromptCheck`: the request's fields, the chat template
rendered, the prompt tokenized with the GGUF's vocabulary, its length and budget against the served context,
`logit_bias` ids within the vocabulary, a `response_format` schema or the tools as a grammar), run off the event
loop, one checker per model kept. `sentence-transformers` models: each text is UTF-8 (a V2 binary BYTES input
may hold any bytes), token ids are within the model's vocabulary and its max_seq_length (`embedding_limits`).

A model whose weights are not a local GGUF (a `store:` model, a file not there) has no checker here: its
instance refuses such a request itself, after tokenizing and before it takes any KV.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence

import anyio
import numpy as np

from ember.errors import EmberError
from ember.runtimes.embedding import TokenLimits, decode_items, token_limits
from ember.wire.contract import ModelContract
from ember.wire.tensors import Tensors

log = logging.getLogger("ember.gateway")

_checks: dict[tuple[str, str | None, str], Callable[[bytes], None] | None] = {}
_limits: dict[tuple[str, str | None, str], TokenLimits | None] = {}


def _deployed(contract: ModelContract) -> tuple[str, str | None, str]:
    return contract.key, contract.weights, json.dumps(contract.options, sort_keys=True, default=str)


def checker(contract: ModelContract) -> Callable[[bytes], None] | None:
    """The model's checker, made once per contract as deployed (a redeploy with other options gets a new one)."""
    key = _deployed(contract)
    if key not in _checks:
        _checks[key] = _build(contract)
    return _checks[key]


def embedding_limits(contract: ModelContract) -> TokenLimits | None:
    """A `sentence-transformers` model's token-id limits, read once per contract as deployed (None: not readable
    here; its instance checks)."""
    key = _deployed(contract)
    if key not in _limits:
        _limits[key] = token_limits(contract)
    return _limits[key]


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
    """InvalidInput (a 400) for the first of the requests (for an `llm` model: of the distinct generation
    requests) that an instance would refuse at once. Inputs the contract's names and shapes do not allow are the
    caller's to refuse first (`validate_inputs`)."""
    if contract.runtime == "sentence-transformers":
        limits = embedding_limits(contract)
        for tensors in inputs:
            decoded = decode_items(tensors["text"]) if "text" in tensors else []
            for i, item in enumerate(decoded):
                if limits is not None and not isinstance(item, str):
                    limits.check(item, f"input 'text'[{i}]")
        return
    check = checker(contract)
    if check is None:
        return
    seen: set[bytes] = set()
    for tensors in inputs:
        items = tensors["request"].reshape(-1) if "request" in tensors else np.empty(0, dtype=object)
        if len(items) != 1 or not isinstance(items[0], bytes | np.bytes_):
            continue   # the instance names what is wrong
        raw = bytes(items[0])
        if raw not in seen:
            seen.add(raw)
            await anyio.to_thread.run_sync(check, raw)
