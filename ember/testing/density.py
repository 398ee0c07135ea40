"""The density benchmark's pure parts (bench/density.py drives a real node with them).

- The trace mapped onto models: a window of one day of the Azure Functions 2019 trace (invocations per function
  per minute), `n` functions picked at evenly spaced ranks of their invocations in the window (the busiest, the
  idlest and the ranks between: the trace's long tail as it is, idle functions included), each one model; a
  model's kind (which bundled model it is a copy of) dealt in proportion to the mix, interleaved along the ranks
  so that every kind gets busy and idle functions. A minute's invocations are capped at `cap` (the VM's two cores
  cannot serve the busiest functions' thousands a minute; a capped minute is still a busy one, so the idle gaps
  between busy minutes are the trace's), placed at uniform random times within the minute (a Poisson process
  given the count, `ember.sim.traces.poisson_minutes`), and the window is replayed `speedup` times faster.
- The fixed keep-alive baseline on the same arrivals (Ollama's default `keep_alive` of 5 minutes): a model's
  process stays loaded until `keep_s` after its last reply, then exits; the next request pays a full cold start
  (a process that starts, imports, loads and answers), requests during a load wait for it, the others take the
  hot latency.
- Memory of plain processes: `count` processes of a kind cost `count` times one's private memory (USS) plus the
  pages they share (the libraries' and the weights' file pages) once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ember.sim.traces import poisson_minutes


@dataclass(frozen=True)
class ModelLoad:
    """One model of the bench: the trace function driving it, its kind, and its arrivals (wall seconds)."""

    name: str
    kind: str
    function: str
    window_invocations: int   # the function's invocations in the window, before the cap
    arrivals: np.ndarray


def kind_sequence(mix: Mapping[str, int]) -> list[str]:
    """The kinds of `mix` (kind -> how many models) interleaved in proportion: the j-th of a kind of count c
    sits at (j + 0.5) / c along the sequence, ties in the mix's order."""
    slots = [((j + 0.5) / c, i, kind) for i, (kind, c) in enumerate(mix.items()) for j in range(c)]
    return [kind for _, _, kind in sorted(slots)]


def pick_functions(window: np.ndarray, n: int) -> np.ndarray:
    """Row indices of `n` functions of `window` (functions x minutes), at evenly spaced ranks of their
    invocations in it, busiest first (ties by row). ValueError when the window has fewer than `n` functions."""
    rows = window.shape[0]
    if n < 1 or n > rows:
        raise ValueError(f"models: from 1 to {rows} (the trace's functions), got {n}")
    order = np.argsort(-window.sum(axis=1), kind="stable")
    return order[np.round(np.linspace(0, rows - 1, n)).astype(np.int64)]


def minute_arrivals(counts: np.ndarray, cap: int, speedup: float, rng: np.random.Generator) -> np.ndarray:
    """Sorted arrival times (wall seconds from the window's start) of one function's minute counts, each minute's
    capped at `cap`, at uniform random times within their minute, `speedup` times faster than the trace."""
    if cap < 1 or speedup <= 0:
        raise ValueError(f"cap must be at least 1 and speedup above 0, got {cap}, {speedup}")
    capped = np.minimum(counts.astype(np.int64), cap)
    minutes = np.flatnonzero(capped)
    return poisson_minutes(rng, minutes, capped[minutes]) / speedup


def map_trace(counts: np.ndarray, functions: Sequence[str], first_minute: int, minutes: int,
              mix: Mapping[str, int], cap: int, speedup: float, seed: int = 0) -> list[ModelLoad]:
    """The models of `mix` (named KIND-NN) driven by the window [first_minute, first_minute + minutes) of
    `counts` (functions x minutes of a day), see the module docstring."""
    if not 0 <= first_minute < first_minute + minutes <= counts.shape[1]:
        raise ValueError(f"window: minutes {first_minute} to {first_minute + minutes} not within the day's "
                         f"{counts.shape[1]}")
    window = counts[:, first_minute:first_minute + minutes]
    kinds = kind_sequence(mix)
    picked = pick_functions(window, len(kinds))
    rng = np.random.default_rng(seed)
    seen: dict[str, int] = {}
    out = []
    for row, kind in zip(picked, kinds, strict=True):
        seen[kind] = seen.get(kind, 0) + 1
        out.append(ModelLoad(f"{kind}-{seen[kind]:02d}", kind, functions[row], int(window[row].sum()),
                             minute_arrivals(window[row], cap, speedup, rng)))
    return out


@dataclass(frozen=True)
class FixedOutcome:
    """A model under a fixed keep-alive: each arrival's first-response time and whether it began a full cold
    start, and the intervals its process was up (from a cold start's beginning to its expiry)."""

    latency_s: np.ndarray
    cold: np.ndarray
    loaded: list[tuple[float, float]]


def fixed_keepalive(arrivals: np.ndarray, keep_s: float, cold_s: float, hot_s: float,
                    end_s: float) -> FixedOutcome:
    """`arrivals` (sorted) under a process kept `keep_s` after its latest reply: a cold arrival answers after
    `cold_s` (start, import, load, answer), one while that load runs after the rest of it plus `hot_s`, the others
    after `hot_s` (no queueing: as if the process had room for every request). Intervals end by `end_s`."""
    latency = np.empty(len(arrivals))
    cold = np.zeros(len(arrivals), dtype=bool)
    loaded: list[tuple[float, float]] = []
    ready_at, expires, began = -math.inf, -math.inf, None
    for i, t in enumerate(np.asarray(arrivals, dtype=np.float64)):
        if t < ready_at:
            latency[i] = ready_at - t + hot_s
        elif t <= expires:
            latency[i] = hot_s
        else:
            if began is not None:
                loaded.append((began, expires))
            began, ready_at, cold[i] = t, t + cold_s, True
            latency[i] = cold_s
        expires = max(expires, t + latency[i] + keep_s)
    if began is not None:
        loaded.append((began, min(expires, max(end_s, began))))
    return FixedOutcome(latency, cold, loaded)


def up_at(intervals: Sequence[tuple[float, float]], times: np.ndarray) -> np.ndarray:
    """Whether each of `times` falls within one of `intervals` ([start, end))."""
    up = np.zeros(len(times), dtype=bool)
    for a, b in intervals:
        up |= (times >= a) & (times < b)
    return up


def processes_mb(count: np.ndarray | int, uss_mb: float, shared_mb: float) -> np.ndarray:
    """Memory of `count` plain processes of one kind: each one's private pages, and the shared ones once."""
    c = np.asarray(count, dtype=np.float64)
    return c * uss_mb + np.where(c > 0, shared_mb, 0.0)


def nearest_rank(values: Sequence[float] | np.ndarray, q: float) -> float:
    """The `q`-th percentile by nearest rank (a value of the sample, infinities kept); NaN for no values."""
    x = np.sort(np.asarray(values, dtype=np.float64))
    if len(x) == 0:
        return math.nan
    return float(x[max(0, math.ceil(q / 100 * len(x)) - 1)])
