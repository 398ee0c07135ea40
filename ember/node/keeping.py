"""What a retiring instance hands its node to keep: the node writes it into the weight store, which a sandboxed
instance sees read-only (`ember.node.sandbox`).

An instance's `drained` frame may carry `keep` (`ember.node.instance`): today an LLM's hottest learned prefixes
(`ember.runtimes.llm_snapshot.Learned`), which later loads of the model restore. The node trusts none of it:
the kind must be the model's runtime's, every field is checked, the model id must be the one the node finds for
the instance's own model (`own_model_id`: the digest of the GGUF the runtime opens, scoped by the model's tenant,
name and version; another model's id would put state into that model's loads, another tenant's included), the
list's limit at most the contract's `options.learned_snapshots`, and it writes only into a store root the node
itself gave its instances (its weight store's, or the default one in the instances' environment), never a path the
instance names alone. What cannot be kept is logged and dropped: a drain never fails for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ember.errors import EmberError, InvalidInput
from ember.runtimes import parse_options
from ember.wire.contract import ModelContract

if TYPE_CHECKING:
    from ember.store.store import WeightStore

log = logging.getLogger("ember.node")


def keep(keep: Mapping[str, Any], tensors: Mapping[str, np.ndarray], *, runtime: str, roots: set[Path],
         model_id: str | None, limit: int) -> int:
    """Write what an instance of a `runtime` model handed over into one of `roots`; how many objects were written.
    `model_id`: the instance's model's (`own_model_id`; None: not found); `limit`: the most learned prefixes its
    contract keeps (`options.learned_snapshots`). InvalidInput when it is not something that runtime keeps, names
    another model or another root, or asks to keep more."""
    from ember.runtimes import llm_snapshot

    if runtime != "llm" or keep.get("kind") != llm_snapshot.KIND:
        raise InvalidInput(f"keep.kind: {str(keep.get('kind'))[:40]!r} is not kept for a {runtime!r} model")
    learned = llm_snapshot.Learned.from_frame(keep, tensors)
    if learned.limit > limit:
        raise InvalidInput(f"keep.limit: {learned.limit} is more than the model's options.learned_snapshots "
                           f"({limit})")
    if model_id is None or learned.model_id != model_id:
        raise InvalidInput(f"keep.model_id: {learned.model_id[:100]!r} is not the instance's model's "
                           f"({model_id or 'not found on this node'})")
    if _resolved(learned.root) not in {_resolved(r) for r in roots}:
        raise InvalidInput(f"keep.root: {str(learned.root)[:200]!r} is not a weight store this node gave its "
                           "instances")
    return llm_snapshot.keep(learned)


def keep_logged(contract: ModelContract, keep_fields: Mapping[str, Any],
                tensors: Callable[[], Mapping[str, np.ndarray]], *, roots: set[Path],
                store: WeightStore | None) -> int:
    """`keep` for an instance of `contract` (its model's weights in `store` if store-backed), its failure logged
    (what is kept only saves work later); 0 then. `tensors`: decodes the frame's tensors (a malformed frame fails
    here too)."""
    model_key = contract.key
    try:
        kept = keep(keep_fields, tensors(), runtime=contract.runtime, roots=roots,
                    model_id=own_model_id(contract, store), limit=learned_limit(contract))
    except Exception as err:
        log.warning("model %s: what its instance handed over on retiring was not kept: %s", model_key, err)
        return 0
    log.info("model %s: kept %d learned prefix snapshot(s) its instance handed over", model_key, kept)
    return kept


def own_model_id(contract: ModelContract, store: WeightStore | None) -> str | None:
    """The id the llm runtime keeps `contract`'s learned prefixes under (`llm_snapshot.learned_id`: the
    `model_id` of the GGUF it opens, the contract's file or the first in its stored model's directory, materialized
    on this node when it loaded, scoped by the contract's tenant, name and version); None when there is none."""
    from ember.runtimes.llm import LLMRuntime
    from ember.runtimes.llm_snapshot import learned_id, model_id

    try:
        return learned_id(model_id(LLMRuntime.gguf(contract, store)), contract)
    except (EmberError, OSError) as err:
        log.info("model %s: its GGUF's id not found: %s", contract.key, err)
        return None


def learned_limit(contract: ModelContract) -> int:
    """The most learned prefixes `contract`'s model keeps (`options.learned_snapshots`); 0 for a contract whose
    options do not parse (its instances never started) or whose runtime keeps none."""
    from ember.runtimes.llm import LLMOptions

    if contract.runtime != "llm":
        return 0
    try:
        return parse_options(contract, LLMOptions).learned_snapshots
    except EmberError:
        return 0


def _resolved(path: Path) -> Path:
    return path.expanduser().absolute()
