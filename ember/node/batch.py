"""Tensors of several requests as one batch, and a batch's outputs back per request.

The batch dimension is every tensor's first axis. Requests concatenate only when their other axes and
datatypes agree (`group_of`), which the batcher uses to keep incompatible requests apart.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import numpy as np

from ember.wire.tensors import Tensors


def rows_of(inputs: Mapping[str, np.ndarray]) -> int | None:
    """The batch rows a request carries: the shared first axis of its inputs (None: not batchable)."""
    sizes = {a.shape[0] if a.ndim else -1 for a in inputs.values()}
    if len(sizes) != 1:
        return None
    rows = sizes.pop()
    return rows if rows > 0 else None


def group_of(inputs: Mapping[str, np.ndarray]) -> Hashable:
    """Requests with the same group concatenate along axis 0 (same names, datatypes and trailing axes)."""
    return tuple(sorted((name, a.dtype.str, a.shape[1:]) for name, a in inputs.items()))


def concat(requests: Sequence[Mapping[str, np.ndarray]]) -> Tensors:
    if len(requests) == 1:
        return dict(requests[0])
    return {name: np.concatenate([r[name] for r in requests]) for name in requests[0]}


def split(outputs: Mapping[str, np.ndarray], rows: Sequence[int]) -> list[Tensors] | None:
    """Each request's rows of every output; None when an output does not have one row per input row."""
    total = sum(rows)
    if any(a.ndim == 0 or a.shape[0] != total for a in outputs.values()):
        return None
    bounds = np.cumsum([0, *rows])
    return [{name: a[bounds[i]:bounds[i + 1]] for name, a in outputs.items()} for i in range(len(rows))]
