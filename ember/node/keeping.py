"""What a retiring instance hands its node to keep: the node writes it into the weight store, which a sandboxed
instance sees read-only (`ember.node.sandbox`).

An instance's `drained` frame may carry `keep` (`ember.node.instance`): today an LLM's hottest learned prefixes
(`ember.runtimes.llm_snapshot.Learned`), which later loads of the model restore. The node trusts none of it:
the kind must be the model's runtime's, every field is checked, the model id must be the one the node finds for
the instance's own model (`own_model_id`: the digest of the GGUF the runtime opens; another model's id would put
state into that model's loads), and it writes only into a store root the node itself gave its instances (its weight
store's, or the default one in the instances' environment), never a path the instance names alone. What cannot be
kept is logged and dropped: a drain never fails for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ember.errors import EmberError, InvalidInput
from ember.wire.contract import ModelContract

if TYPE_CHECKING:
    from ember.store.store import WeightStore

log = logging.getLogger("ember.node")


def keep(keep: Mapping[str, Any], tensors: Mapping[str, np.ndarray], *, runtime: str, roots: set[Path],
         model_id: str | None) -> int:
    """Write what an instance of a `runtime` model handed over into one of `roots`; how many objects were written.
    `model_id`: the instance's model's (`own_model_id`; None: not found). InvalidInput when it is not something that
    runtime keeps, names another model or another root."""
    from ember.runtimes import llm_snapshot

    if runtime != "llm" or keep.get("kind") != llm_snapshot.KIND:
        raise InvalidInput(f"keep.kind: {str(keep.get('kind'))[:40]!r} is not kept for a {runtime!r} model")
    learned = llm_snapshot.Learned.from_frame(keep, tensors)
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
                    model_id=own_model_id(contract, store))
    except Exception as err:
        log.warning("model %s: what its instance handed over on retiring was not kept: %s", model_key, err)
        return 0
    log.info("model %s: kept %d learned prefix snapshot(s) its instance handed over", model_key, kept)
    return kept


def own_model_id(contract: ModelContract, store: WeightStore | None) -> str | None:
    """The id the llm runtime gives `contract`'s model (`llm_snapshot.model_id` of the GGUF it opens: the
    contract's file, or the first in its stored model's directory, materialized on this node when it loaded);
    None when there is none to find."""
    from ember.runtimes.llm import LLMRuntime
    from ember.runtimes.llm_snapshot import model_id

    try:
        return model_id(LLMRuntime.gguf(contract, store))
    except (EmberError, OSError) as err:
        log.info("model %s: its GGUF's id not found: %s", contract.key, err)
        return None


def _resolved(path: Path) -> Path:
    return path.expanduser().absolute()
