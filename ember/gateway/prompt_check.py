"""Refusing a request an instance would refuse at once, before any rung is claimed and before a job is accepted
(a 202 must not be followed by a failure the gateway could have answered with a 400).

`llm` models: the runtime's own checks (`ember.runtimes.llm.PromptCheck`: the request's fields, the chat template
rendered, the prompt tokenized with the GGUF's vocabulary, its length and budget against the served context,
`logit_bias` ids within the vocabulary, a `response_format` schema or the tools as a grammar), run off the event
loop, one checker per model kept. `sentence-transformers` models: each text is UTF-8 (a V2 binary BYTES input
may hold any bytes), token ids are within the model's vocabulary and its max_seq_length (`embedding_limits`).
An `llm` or `vllm` model without such a checker still has each request's own rules checked
(`ember.wire.generation.parse_request`), so a request that will wait as a job is refused now, not failed later.

A `store:` model's vocabulary is read from its GGUF's head in the node's weight store (`read_store_with`; the
first chunks only: ember.runtimes.gguf_head), so a request its instance would refuse starts no instance either. A
model whose GGUF cannot be read here (a file not there, no store, the store failing) has no checker: its instance
refuses such a request itself, after tokenizing and before it takes any KV.
"""

from __future__ import annotations

import json
import logging
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import numpy as np

from ember.errors import EmberError
from ember.runtimes.embedding import TokenLimits, decode_items, token_limits
from ember.wire.contract import ModelContract
from ember.wire.generation import RUNTIMES, parse_request
from ember.wire.tensors import Tensors

if TYPE_CHECKING:
    from ember.store import WeightStore

log = logging.getLogger("ember.gateway")

_checks: dict[tuple[str, str | None, str], Callable[[bytes], None] | None] = {}
_limits: dict[tuple[str, str | None, str], TokenLimits | None] = {}
_store: Callable[[], WeightStore] | None = None   # the node's weight store, for `store:` models' vocabularies
_building: dict[str, threading.Lock] = {}          # model key -> held while its checker is made


def read_store_with(open_store: Callable[[], WeightStore] | None) -> None:
    """Where a `store:` llm model's vocabulary is read from: the node's weight store (`ember serve` gives it its
    own; None: nowhere, such a model has no checker here)."""
    global _store
    _store = open_store


def _deployed(contract: ModelContract) -> tuple[str, str | None, str]:
    return contract.key, contract.weights, json.dumps(contract.options, sort_keys=True, default=str)


def checker(contract: ModelContract) -> Callable[[bytes], None] | None:
    """The model's checker, made once per contract as deployed (a redeploy with other options gets a new one, and
    the old one goes): concurrent first requests wait for one build."""
    key = _deployed(contract)
    with _building.setdefault(contract.key, threading.Lock()):
        if key not in _checks:
            for old in [k for k in _checks if k[0] == contract.key]:
                del _checks[old]
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
    if contract.runtime != "llm" or (contract.store_ref is not None and _store is None):
        return None
    try:
        from ember.runtimes.llm import PromptCheck

        if contract.store_ref is None:
            return PromptCheck(contract)
        return _stored_check(contract, contract.store_ref)
    except (EmberError, OSError, ImportError) as err:   # the instance checks anyway; say why the gateway cannot
        log.info("model %s: no prompt check in the gateway: %s", contract.key, err)
        return None


def _stored_check(contract: ModelContract, ref: str) -> Callable[[bytes], None]:
    """The check of a `store:` model, on the vocabulary of its GGUF's head (read from the store's first chunks)."""
    from ember.runtimes.gguf_head import store_vocabulary
    from ember.runtimes.llm import PromptCheck

    assert _store is not None
    head = store_vocabulary(_store(), ref, f"model '{contract.key}': weights {contract.weights!r}")
    with tempfile.TemporaryDirectory(prefix="ember-vocab-") as tmp:   # read whole by the load: then not needed
        path = Path(tmp) / "vocabulary.gguf"
        path.write_bytes(head)
        return PromptCheck(contract, path)


def _request_rules(contract: ModelContract) -> Callable[[bytes], None]:
    def check(raw: bytes) -> None:
        parse_request(raw, contract.limits.max_tokens)
    return check


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
    if _deployed(contract) in _checks:
        check = _checks[_deployed(contract)]
    else:   # made off the event loop: a vocabulary's read (a store's chunks, maybe fetched) takes a while
        check = await anyio.to_thread.run_sync(checker, contract)
    if check is None and contract.runtime in RUNTIMES:
        check = _request_rules(contract)
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
