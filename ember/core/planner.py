"""The buffer planner: how many warm slices of each profile to hold per model, by linear programming.

Given, per model, a forecast of how many instances it will need at once in the coming
period (a Poisson count with the forecast mean, or explicit tail probabilities), which
slice profiles it runs on and how many instances one slice serves, and, per profile, how
many slices exist and what an idle one costs, choose warm slices w[m, p] to minimise

    sum_m cold_start_cost[m] * E[(D_m - covered_m)^+]  +  sum_{m,p} idle_cost[p] * w[m, p]

subject to sum_m w[m, p] <= capacity[p]. The expected shortfall is convex and piecewise
linear in the coverage: covering the j-th instance of model m saves P(D_m > j) cold
starts. With one variable u[m, j] in [0, 1] per instance and covered_m = sum_j u[m, j]
<= sum_p per_slice[m, p] * w[m, p], the LP is exact at integral coverages (the benefits
decrease in j, so the solver fills instances in order). Instances whose saving is below
the cheapest way to cover them are never worth covering and are left out of the model,
which keeps 1,000 models x 6 profiles small. Solved with OR-Tools GLOP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ember.core.clock import Clock
from ember.errors import InvalidInput

# Forecast counts are cut where the tail probability is negligible.
_TAIL_EPS = 1e-6
_MAX_UNITS = 10_000


@dataclass(frozen=True)
class SliceProfile:
    """A kind of slice (a MIG profile, a whole GPU, a CPU slot): how many exist and what an idle one costs."""

    name: str
    capacity: int           # slices of this profile available for warm pools (all nodes)
    idle_cost: float        # cost of one warm idle slice over the planning period (same unit as cold_start_cost)

    def __post_init__(self) -> None:
        if self.capacity < 0:
            raise InvalidInput(f"profile {self.name}: capacity must be >= 0, got {self.capacity}")
        if not (self.idle_cost >= 0 and math.isfinite(self.idle_cost)):
            raise InvalidInput(f"profile {self.name}: idle_cost must be a finite number >= 0, got {self.idle_cost}")


def on_nodes(name: str, per_node: int, nodes: int, idle_cost: float) -> SliceProfile:
    """A profile from slices per node and node count (the LP pools a profile's slices across nodes)."""
    if per_node < 0 or nodes < 0:
        raise InvalidInput(f"profile {name}: per_node and nodes must be >= 0, got {per_node} and {nodes}")
    return SliceProfile(name, per_node * nodes, idle_cost)


@dataclass(frozen=True)
class ModelDemand:
    """One model's forecast: `expected` instances needed at once (Poisson), or `exceed[j]` = P(D > j)."""

    name: str
    expected: float
    per_slice: dict[str, float]          # profile -> instances one warm slice of it serves (absent: cannot run)
    cold_start_cost: float = 1.0
    exceed: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not (self.expected >= 0 and math.isfinite(self.expected)):
            raise InvalidInput(f"model {self.name}: expected must be a finite number >= 0, got {self.expected}")
        if not self.cold_start_cost >= 0:
            raise InvalidInput(f"model {self.name}: cold_start_cost must be >= 0, got {self.cold_start_cost}")
        for p, k in self.per_slice.items():
            if not (k >= 0 and math.isfinite(k)):
                raise InvalidInput(f"model {self.name}: per_slice[{p}] must be a finite number >= 0, got {k}")
        if self.exceed is not None:
            e = np.asarray(self.exceed)
            if ((e < 0) | (e > 1)).any() or (np.diff(e) > 1e-12).any():
                raise InvalidInput(f"model {self.name}: exceed must be probabilities that never increase")

    def tail(self) -> np.ndarray:
        """P(D > j) for j = 0, 1, ... until negligible."""
        if self.exceed is not None:
            return np.asarray(self.exceed, dtype=np.float64)
        lam = self.expected
        if lam <= 0:
            return np.zeros(0)
        n = int(min(_MAX_UNITS, lam + 10 * math.sqrt(lam) + 20))
        j = np.arange(n)
        log_pmf = -lam + j * math.log(lam) - np.array([math.lgamma(x + 1) for x in j])
        tail = 1.0 - np.cumsum(np.exp(log_pmf))
        keep = tail > _TAIL_EPS
        return np.clip(tail[keep], 0.0, 1.0)

    @property
    def mean(self) -> float:
        return float(self.tail().sum()) if self.exceed is not None else self.expected


@dataclass(frozen=True)
class BufferPlan:
    warm: dict[str, dict[str, float]]         # the LP's warm slices per model and profile (fractional)
    rounded: dict[str, dict[str, int]]        # an integral plan within capacity
    expected_cold_starts: float               # of the LP plan
    idle_cost: float                          # of the LP plan
    objective: float
    status: str
    variables: int
    build_s: float = 0.0                      # timed only when plan_buffer is given a clock
    solve_s: float = field(default=0.0)


def plan_buffer(demands: list[ModelDemand], profiles: list[SliceProfile], clock: Clock | None = None) -> BufferPlan:
    """Solve the warm-pool LP; raises InvalidInput for unknown profiles or an unsolvable LP.

    `clock` (the caller's) times building and solving the LP, for benchmarks.
    """
    now = clock.now if clock is not None else (lambda: 0.0)
    began = now()
    by_name = {p.name: p for p in profiles}
    if len(by_name) != len(profiles):
        raise InvalidInput("profiles: names must be unique")
    lp = _Lp(profiles)
    for i, d in enumerate(demands):
        unknown = set(d.per_slice) - set(by_name)
        if unknown:
            raise InvalidInput(f"model {d.name}: per_slice names unknown profile(s) {', '.join(sorted(unknown))}")
        lp.add_model(i, d, by_name)
    built = now()
    lp.solve()
    solved = now()
    warm: dict[str, dict[str, float]] = {d.name: {} for d in demands}
    idle = 0.0
    for (i, p), v in lp.warm_values().items():
        warm[demands[i].name][p] = v
        idle += v * by_name[p].idle_cost
    cold = sum(d.cold_start_cost * float(d.tail().sum()) for d in demands)
    saved = sum(demands[i].cold_start_cost * s for i, s in lp.saved().items())
    return BufferPlan(warm, _round(demands, profiles, warm), _expected_cold(demands, warm), idle,
                      cold - saved + idle, "optimal", lp.variables, built - began, solved - built)


class _Lp:
    """The GLOP model: capacity rows per profile, a coverage row and instance variables per model."""

    def __init__(self, profiles: list[SliceProfile]) -> None:
        from ortools.linear_solver import pywraplp

        self._pywraplp = pywraplp
        solver = pywraplp.Solver.CreateSolver("GLOP")
        if solver is None:
            raise InvalidInput("OR-Tools GLOP is not available")
        self.solver = solver
        self.inf = solver.infinity()
        self.cap = {p.name: solver.RowConstraint(-self.inf, float(p.capacity), "") for p in profiles}
        self.objective = solver.Objective()
        self.w: dict[tuple[int, str], Any] = {}
        self.u: dict[int, tuple[np.ndarray, list[Any]]] = {}

    def add_model(self, i: int, d: ModelDemand, by_name: dict[str, SliceProfile]) -> None:
        tail = d.tail()
        usable = [(p, k) for p, k in d.per_slice.items() if k > 0]
        if not usable or len(tail) == 0:
            return
        # An instance whose saving is below the cheapest way to cover it is never covered: leave it out.
        cheapest = min(by_name[p].idle_cost / k for p, k in usable)
        worth = tail[tail * d.cold_start_cost > cheapest]
        if len(worth) == 0:
            return
        cover = self.solver.RowConstraint(-self.inf, 0.0, "")
        us = []
        for pj in worth:
            u = self.solver.NumVar(0.0, 1.0, "")
            cover.SetCoefficient(u, 1.0)
            self.objective.SetCoefficient(u, -d.cold_start_cost * float(pj))
            us.append(u)
        self.u[i] = (worth, us)
        for p, k in usable:
            w = self.solver.NumVar(0.0, self.inf, "")
            cover.SetCoefficient(w, -float(k))
            self.cap[p].SetCoefficient(w, 1.0)
            self.objective.SetCoefficient(w, by_name[p].idle_cost)
            self.w[(i, p)] = w

    def solve(self) -> None:
        self.objective.SetMinimization()
        status = self.solver.Solve()
        s = self._pywraplp.Solver
        names = {s.FEASIBLE: "feasible only", s.INFEASIBLE: "infeasible", s.UNBOUNDED: "unbounded"}
        if status != s.OPTIMAL:
            raise InvalidInput(f"buffer plan: the LP is {names.get(status, 'unsolved')}")

    @property
    def variables(self) -> int:
        return int(self.solver.NumVariables())

    def warm_values(self) -> dict[tuple[int, str], float]:
        values = {key: float(w.solution_value()) for key, w in self.w.items()}
        return {key: v for key, v in values.items() if v > 1e-9}

    def saved(self) -> dict[int, float]:
        """Per model, the expected cold starts the plan avoids."""
        return {i: float(worth @ np.array([u.solution_value() for u in us])) for i, (worth, us) in self.u.items()}


def _expected_cold(demands: list[ModelDemand], warm: dict[str, dict[str, float]]) -> float:
    """E[(D - covered)^+] summed over models (unweighted), with linear interpolation between integers."""
    total = 0.0
    for d in demands:
        tail = d.tail()
        covered = sum(d.per_slice.get(p, 0.0) * v for p, v in warm[d.name].items())
        full = math.floor(covered + 1e-9)
        rest = tail[full:].sum() - (covered - full) * (tail[full] if full < len(tail) else 0.0)
        total += float(max(0.0, rest))
    return total


def _round(demands: list[ModelDemand], profiles: list[SliceProfile],
           warm: dict[str, dict[str, float]]) -> dict[str, dict[str, int]]:
    """Floor every amount, then hand out what capacity is left to the largest fractions first."""
    left = {p.name: p.capacity for p in profiles}
    out: dict[str, dict[str, int]] = {d.name: {} for d in demands}
    fractions = []
    for model, per in warm.items():
        for p, v in per.items():
            whole = min(math.floor(v + 1e-9), left[p])
            if whole:
                out[model][p] = whole
                left[p] -= whole
            if v - whole > 1e-9:
                fractions.append((v - whole, model, p))
    for frac, model, p in sorted(fractions, reverse=True):
        if frac >= 0.5 and left[p] > 0:
            out[model][p] = out[model].get(p, 0) + 1
            left[p] -= 1
    return out
