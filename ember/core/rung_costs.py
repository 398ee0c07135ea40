"""What each rung of the ladder costs: idle memory and start latency, as parameters or measured.

bench/cold_start.py measures them on a machine; `RungCosts.from_benchmark` reads its JSON. The keep-alive
policies (`ember.keepalive.policies`) and the simulator weigh plans with them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ember.errors import InvalidInput

_ZYGOTE, _COLD = 3, 4   # the zygote's and nothing kept's places in `RungCosts.by_level`


# A start from a model's process image (the restore rung, `ember serve --snapshots on`): MiniLM restored on a real
# node, start plus first response, p50 (bench/restore.py, docs/operations.md); the image is on disk: no idle memory.
RESTORE_START_S = 0.17

# The largest figure a rung's cost, or a costs document, may give (MB, seconds, milliseconds or a ratio): a larger
# one is no measurement, and the memory and latency sums over a long trace overflow to infinity from ~1e300.
MAX_FIGURE = 1e9


@dataclass(frozen=True)
class RungCost:
    idle_mb: float   # memory held while idle on this rung
    start_s: float   # start latency added to a request that finds its capacity on this rung

    def __post_init__(self) -> None:
        if not (0 <= self.idle_mb <= MAX_FIGURE and 0 <= self.start_s <= MAX_FIGURE):
            raise InvalidInput(f"rung costs must lie in [0, {MAX_FIGURE:g}], got idle_mb={self.idle_mb} "
                               f"start_s={self.start_s}")


@dataclass(frozen=True)
class RungCosts:
    """Idle memory and start latency per rung (parameters; bench/cold_start.py measures them).

    Defaults: MiniLM reference figures. Hot adds ~0.3 ms before the ~21 ms of compute; a
    paused instance ~0.5 ms more; forking the template ~85 ms; forking the zygote ~300 ms;
    a cold start from nothing ~12.5 s. A hot or paused instance holds the full model RSS
    (~250 MB, torch included); the template ~250 MB (each replica forked from it ~15% of
    that more); the zygote ~150 MB shared by every model of its runtime.

    `memory_copy_mb`: a store-backed model's chunks in the weight store's memory tier (RAM). The node keeps them on
    every rung but FETCH (`ReleaseWeights`, `ember.core.lifecycle.KEEPS`), so they are charged on each of those
    rungs, on top of the figures above: those are one reference model's (or `bench/cold_start.py`'s), not this
    model's, so they cannot be taken to hold its copy already. 0 for a model with no such copy (weights in its
    package, or a store with no memory tier).
    """

    hot: RungCost = RungCost(250.0, 0.0003)
    paused: RungCost = RungCost(250.0, 0.0008)
    template: RungCost = RungCost(250.0, 0.085)
    zygote: RungCost = RungCost(150.0, 0.300)
    cold: RungCost = RungCost(0.0, 12.5)
    template_replica_fraction: float = 0.15
    memory_copy_mb: float = 0.0

    def __post_init__(self) -> None:
        if not self.memory_copy_mb >= 0:
            raise InvalidInput(f"rung costs: memory_copy_mb must be >= 0, got {self.memory_copy_mb}")

    def with_restore(self, start_s: float = RESTORE_START_S) -> RungCosts:
        """These costs where nothing kept in memory is a restore from the model's process image, not a start from
        nothing: the bottom level holds no memory and starts in `start_s`."""
        return replace(self, cold=RungCost(0.0, start_s))

    def by_level(self) -> tuple[RungCost, ...]:
        return (self.hot, self.paused, self.template, self.zygote, self.cold)

    def idle_mb(self) -> np.ndarray:
        return np.array([c.idle_mb for c in self.by_level()])

    def own_mb(self) -> np.ndarray:
        """Idle MB per level that is the model's own, the runtime's shared zygote left out (it is charged once per
        runtime, for the union of its holds): on every level but FETCH, its copy in the memory tier too."""
        mb = self.idle_mb()
        mb[_ZYGOTE] = 0.0
        mb[:_COLD] += self.memory_copy_mb
        return mb

    def start_s(self) -> np.ndarray:
        return np.array([c.start_s for c in self.by_level()])

    @classmethod
    def from_benchmark(cls, data: dict[str, Any]) -> RungCosts:
        """Costs from bench/cold_start.py's JSON (or a hand-written {"rungs": {name: {...}}}).

        Per rung: start_s, start_ms or p50_ms is the start cost itself; `p50` (seconds) is a
        time to first response, from which the in-process call (`in_process.p50`, the compute)
        is subtracted. `naive.p50` is the cold start from nothing. Memory: idle_mb, rss_mb or
        memory_mb per rung; or `memory.template_pss_mb` for the template, and for a hot or
        paused instance the template plus one replica forked from it (`replica_uss_vs_template`),
        since a forked replica needs its template kept. Rungs not mentioned keep their defaults;
        `cold` may be called `fetch`. A top-level `memory_copy_mb` is the model's memory-tier copy (above).
        """
        if not isinstance(data, dict):
            raise InvalidInput("rung costs: expected a mapping of rung name to figures")
        rungs = data["rungs"] if "rungs" in data else {k: v for k, v in data.items() if k not in _BENCH_KEYS}
        if not isinstance(rungs, dict):
            raise InvalidInput("rung costs: rungs: expected a mapping of rung name to figures")
        in_process = data.get("in_process", {})
        if not isinstance(in_process, dict):
            raise InvalidInput(f"rung costs: in_process: expected a mapping, got {type(in_process).__name__}")
        compute = _number("in_process.p50", in_process.get("p50", 0.0))
        if isinstance(data.get("naive"), dict) and "p50" in data["naive"]:
            rungs = {**rungs, "cold": data["naive"]}
        names = {"hot": "hot", "paused": "paused", "template": "template", "zygote": "zygote",
                 "cold": "cold", "fetch": "cold"}
        out = cls()
        for name, figures in rungs.items():
            if name not in names:
                raise InvalidInput(f"rung costs: unknown rung {name!r} (known: {', '.join(names)})")
            if not isinstance(figures, dict):
                raise InvalidInput(f"rung costs: {name}: expected a mapping, got {type(figures).__name__}")
            old: RungCost = getattr(out, names[name])
            new = RungCost(_read_mb(name, figures, old.idle_mb), _read_s(name, figures, old.start_s, compute))
            out = replace(out, **{names[name]: new})  # type: ignore[arg-type]
        if "memory_copy_mb" in data:
            out = replace(out, memory_copy_mb=_number("memory_copy_mb", data["memory_copy_mb"]))
        return _with_measured_memory(out, data.get("memory"))


# Top-level keys of bench/cold_start.py's JSON that are not rungs.
_BENCH_KEYS = frozenset({"memory_copy_mb", "n", "machine", "in_process", "naive", "memory", "ray", "ratios",
                         "hot_after_idle", "hot_raw_client"})


def _with_measured_memory(costs: RungCosts, memory: Any) -> RungCosts:
    if not isinstance(memory, dict) or "template_pss_mb" not in memory:
        return costs
    template = _number("memory.template_pss_mb", memory["template_pss_mb"])
    ratios = memory.get("replica_uss_vs_template") or [costs.template_replica_fraction]
    if not isinstance(ratios, list):
        raise InvalidInput("rung costs: memory.replica_uss_vs_template must be a list of numbers")
    replica = float(np.mean([_number("memory.replica_uss_vs_template", r) for r in ratios]))
    instance = template * (1.0 + replica)
    return replace(costs, hot=RungCost(instance, costs.hot.start_s), paused=RungCost(instance, costs.paused.start_s),
                   template=RungCost(template, costs.template.start_s), template_replica_fraction=replica)


def _read_s(rung: str, figures: dict[str, Any], default: float, compute: float) -> float:
    for key, scale in (("start_s", 1.0), ("start_ms", 1e-3), ("p50_ms", 1e-3)):
        if key in figures:
            return _number(f"{rung}.{key}", figures[key]) * scale
    if "p50" in figures:
        # A time to first response: the start is what it adds to the model's own compute.
        return max(0.0, _number(f"{rung}.p50", figures["p50"]) - compute)
    return default


def _read_mb(rung: str, figures: dict[str, Any], default: float) -> float:
    for key in ("idle_mb", "rss_mb", "memory_mb"):
        if key in figures:
            return _number(f"{rung}.{key}", figures[key])
    return default


def _number(where: str, value: Any) -> float:
    # (Compared as given: an integer too large for a float compares exactly, and NaN is not in the range.)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_FIGURE:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise InvalidInput(f"rung costs: {where} must be a number from 0 to {MAX_FIGURE:g}, got {shown}")
    return float(value)
