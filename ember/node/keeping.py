"""What a retiring instance hands its node to keep: the node writes it into the weight store, which a sandboxed
instance sees read-only (`ember.node.sandbox`).

An instance's `drained` frame may carry `keep` (`ember.node.instance`): today an LLM's hottest learned prefixes
(`ember.runtimes.llm_snapshot.Learned`), which later loads of the model restore. The node trusts none of it:
the kind must be the model's runtime's, every field is checked, and it writes only into a store root the node
itself gave its instances (its weight store's, or the default one in the instances' environment), never a
path the instance names alone. What cannot be kept is logged and dropped: a drain never fails for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ember.errors import InvalidInput

log = logging.getLogger("ember.node")


def keep(keep: Mapping[str, Any], tensors: Mapping[str, np.ndarray], *, runtime: str,
         roots: set[Path]) -> int:
    """Write what an instance of a `runtime` model handed over into one of `roots`; how many objects were written.
    InvalidInput when it is not something that runtime keeps, or names another root."""
    from ember.runtimes import llm_snapshot

    if runtime != "llm" or keep.get("kind") != llm_snapshot.KIND:
        raise InvalidInput(f"keep.kind: {str(keep.get('kind'))[:40]!r} is not kept for a {runtime!r} model")
    learned = llm_snapshot.Learned.from_frame(keep, tensors)
    if _resolved(learned.root) not in {_resolved(r) for r in roots}:
        raise InvalidInput(f"keep.root: {str(learned.root)[:200]!r} is not a weight store this node gave its "
                           "instances")
    return llm_snapshot.keep(learned)


def keep_logged(model_key: str, keep_fields: Mapping[str, Any], tensors: Callable[[], Mapping[str, np.ndarray]],
                *, runtime: str, roots: set[Path]) -> int:
    """`keep`, its failure logged (what is kept only saves work later); 0 then. `tensors`: decodes the frame's
    tensors (a malformed frame fails here too)."""
    try:
        kept = keep(keep_fields, tensors(), runtime=runtime, roots=roots)
    except Exception as err:
        log.warning("model %s: what its instance handed over on retiring was not kept: %s", model_key, err)
        return 0
    log.info("model %s: kept %d learned prefix snapshot(s) its instance handed over", model_key, kept)
    return kept


def _resolved(path: Path) -> Path:
    return path.expanduser().absolute()
