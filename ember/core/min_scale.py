"""A model's min scale across the cluster: how many of its instances each node serving it keeps.

A contract's `min_scale` is the model's floor in the whole cluster, as Knative's is a revision's, not a floor
per node: three nodes given a model with min scale 1 keep one warm instance between them, not three. The
controller spreads it over the nodes serving the model, so a lost node takes at most its share with it:

    nodes serving the model, those holding the most of its warm instances first (then by id: a function of
    the view alone, and shares stay where instances already are), get floor(m / n) each, and the first
    m mod n of them one more.

A node applies its share as its local min scale for the model (`Controller.set_min_scale`); until its first
complete view it keeps the contract's.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["spread"]


def spread(wanted: Mapping[str, int], serving: Mapping[str, frozenset[str]],
           warm: Mapping[str, Mapping[str, int]]) -> dict[str, dict[str, int]]:
    """node -> model -> its share of the model's min scale, for every model of `wanted` (model -> the contract's
    min scale, > 0) on every node serving it (`serving`: node -> models deployed there); `warm`: node -> model ->
    its warm instances there."""
    out: dict[str, dict[str, int]] = {}
    for model, m in sorted(wanted.items()):
        if m <= 0:
            continue
        nodes = sorted((n for n, models in serving.items() if model in models),
                       key=lambda n: (-warm.get(n, {}).get(model, 0), n))
        for i, node in enumerate(nodes):
            out.setdefault(node, {})[model] = m // len(nodes) + (1 if i < m % len(nodes) else 0)
    return out
