"""The ladder's idle levels and the plans keep-alive policies make of them, and the policy interface.

A policy's answer for one model is an `IdlePlan` (`ember.core.rung_plan`, the plain value the core's lifecycle
carries out): a step function of idle time (seconds since the execution ended) onto the idle rungs `LEVELS`,
cheapest to start first, each with an integer code (`HOT` .. `COLD`) for array work. A `PlanTable` holds many
plans as padded arrays, as the simulator and the live actuator evaluate them; `start_rung` is where a request
starts from while a plan climbs back. `KeepAlivePolicy` is the one interface both drivers (the simulator and the
live actuator) call, whatever the policy; `PolicyBase` (its defaults: a policy that neither prices the zygote
by its share nor pools a prior) and the knob checks (`check_knob`, `check_floor`) are what the policies share.

The policies themselves live in `ember.keepalive.policies` (fixed, hybrid histogram, ladder, and the
registry `make_policy`) and `ember.sim.keepalive_layered` (RainbowCake); both import from here,
never the other way round.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar, Protocol

import numpy as np

from ember.core.rung_plan import IdlePlan
from ember.core.states import Rung
from ember.errors import InvalidInput
from ember.keepalive.forecast import HistogramSpec, HistoryTable, IdleHistory
from ember.keepalive.pooled_prior import PooledPrior

# The ladder's levels in code order; FETCH stands for "nothing kept" (a full cold start).
LEVELS: tuple[Rung, ...] = (Rung.HOT, Rung.PAUSED, Rung.TEMPLATE, Rung.ZYGOTE, Rung.FETCH)
HOT, PAUSED, TEMPLATE, ZYGOTE, COLD = range(5)
# Levels whose start needs a new process: a cold start as the ATC'20 paper (and `RunResult.cold_start_rate`) counts.
NEW_PROCESS = np.array([0.0, 0.0, 1.0, 1.0, 1.0])
DAY_S = 86400.0
_CODE = {r: i for i, r in enumerate(LEVELS)}


def start_rung(plan: IdlePlan, idle_s: float, start_s: np.ndarray | None = None) -> Rung:
    """The rung a request after `idle_s` idle starts from: the plan's, unless a climb back to a warmer rung (a
    pre-warm) is still under way (`PlanTable.climbs`; `start_s` per level, its start time; None: climbs take
    no time); the request then waits for it, counted as a start from the rung the climb began on."""
    if start_s is None:
        return plan.rung_at(idle_s)
    return start_and_climb(plan, idle_s, start_s)[0]


def start_and_climb(plan: IdlePlan, idle_s: float, start_s: np.ndarray) -> tuple[Rung, tuple[float, Rung] | None]:
    """`start_rung` of a request after `idle_s` idle, and, if it comes while the plan climbs back from nothing
    kept (`start_rung` FETCH, the plan's rung warmer), the idle time that climb began at and the rung the
    request starts from if the runtime's zygote was up then (`PlanTable.fetch_climbs`); else None."""
    table = PlanTable.of(plan)
    origin, ready = table.climbs(start_s)
    j = _step_at(table, idle_s)
    climbing = idle_s < ready[0, j]
    rung = LEVELS[int(origin[0, j] if climbing else table.codes[0, j])]
    if not (climbing and origin[0, j] == COLD and table.codes[0, j] != COLD):
        return rung, None
    since, up = table.fetch_climbs(np.zeros(1, dtype=np.int64), np.array([j]), np.array([idle_s]), start_s)
    return rung, (float(since[0]), LEVELS[int(up[0])])


def _step_at(table: PlanTable, idle_s: float) -> int:
    """The step of a one-row table held after `idle_s` idle (the first before its first break)."""
    return max(0, int(np.searchsorted(table.breaks[0], idle_s, side="right")) - 1)


@dataclass
class PlanTable:
    """m plans as padded arrays: breaks (m, K) seconds (+inf padding), codes (m, K) level codes."""

    breaks: np.ndarray
    codes: np.ndarray

    def row(self, i: int) -> IdlePlan:
        keep = np.isfinite(self.breaks[i])
        return IdlePlan(tuple((float(b), LEVELS[int(c)]) for b, c in zip(self.breaks[i][keep], self.codes[i][keep],
                                                                          strict=True)))

    def climbs(self, start_s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(m, K) each: per step, the rung a request that comes while the step is held starts from while a climb
        is under way, and the idle time that climb is done at (-inf: none under way).

        A climb from rung a to a warmer b begins at the step and takes `start_s[a] - start_s[b]` (live, the node
        starts the instance, template or zygote then), after any climb still under way: a chain of climbs (from
        nothing to the zygote, then to hot) starts requests from where it began until its last is done. A drop is
        at once, and ends a climb under way unless it drops to a rung still warmer than where that began."""
        origin, ready, _ = self.chains(start_s)
        return origin, ready

    def chains(self, start_s: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`climbs`, and per step the idle time the chain of climbs under way began at (-inf: none)."""
        m, k = self.breaks.shape
        codes = self.codes.astype(np.int64)
        origin = codes.copy()
        ready = np.full((m, k), -np.inf)
        since = np.full((m, k), -np.inf)
        finite = np.isfinite(self.breaks)
        # Only the rows that climb, up to their last step (most plans only ever drop).
        rows = np.flatnonzero(((codes[:, 1:] < codes[:, :-1]) & finite[:, 1:]).any(axis=1))
        if not len(rows):
            return origin, ready, since
        width = int(finite[rows].sum(axis=1).max())
        c, at_all = codes[rows, :width], self.breaks[rows, :width]
        o_all, r_all, s_all = origin[rows, :width], ready[rows, :width], since[rows, :width]
        for j in range(1, width):
            a, b, at = c[:, j - 1], c[:, j], at_all[:, j]
            o, r, s = o_all[:, j - 1], r_all[:, j - 1], s_all[:, j - 1]
            going = r > at
            climb, keep = b < a, (b == a) | ((b > a) & going & (b < o))
            with np.errstate(invalid="ignore"):              # padding steps (+inf) are never reached
                r_all[:, j] = np.where(climb, np.maximum(r, at) + start_s[a] - start_s[b], np.where(keep, r, -np.inf))
            o_all[:, j] = np.where(climb, np.where(going, o, a), np.where(keep, o, b))
            s_all[:, j] = np.where(climb & ~going, at, np.where(climb | keep, s, -np.inf))
        origin[rows, :width], ready[rows, :width], since[rows, :width] = o_all, r_all, s_all
        return origin, ready, since

    def start_levels(self, segs: np.ndarray, step: np.ndarray, gaps: np.ndarray,
                     start_s: np.ndarray | None) -> np.ndarray:
        """`start_rung` of many periods: each idle for `gaps`, planned by row `segs`, ended in `step`."""
        level = self.codes[segs, step].astype(np.int64)
        if start_s is None or self.breaks.shape[1] < 2:
            return level
        # Only the periods that end at or after their plan's first climb can end during one.
        up = (self.codes[:, 1:] < self.codes[:, :-1]) & np.isfinite(self.breaks[:, 1:])
        first_up = np.where(up.any(axis=1), up.argmax(axis=1) + 1, self.breaks.shape[1])
        late = np.flatnonzero(step >= first_up[segs])
        if not len(late):
            return level
        rows, at = np.unique(segs[late], return_inverse=True)
        j = step[late]
        w = int(j.max()) + 1                                    # the steps they reach
        origin, ready = PlanTable(self.breaks[rows, :w], self.codes[rows, :w]).climbs(start_s)
        level[late] = np.where(gaps[late] < ready[at, j], origin[at, j], level[late])
        return level

    def fetch_climbs(self, segs: np.ndarray, step: np.ndarray, gaps: np.ndarray,
                     start_s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For periods that end while their plan still climbs back from nothing kept (`start_levels` gave them
        FETCH, their step a warmer rung; each idle for `gaps`, planned by row `segs`, ended in `step`): the idle
        time that chain of climbs began at, and the level they start from if the runtime's zygote was up then.
        Live, the node then forks the model from that zygote: the climb from nothing takes a zygote start's time,
        and a request that comes while it is under way is a zygote start (not a full one)."""
        rows, at = np.unique(segs, return_inverse=True)
        w = int(step.max()) + 1 if len(step) else 1
        sub = PlanTable(self.breaks[rows, :w], self.codes[rows, :w])
        fast = np.array(start_s, dtype=np.float64)
        fast[COLD] = fast[ZYGOTE]
        origin, ready = sub.climbs(fast)
        level = np.where(gaps < ready[at, step], origin[at, step], self.codes[segs, step])
        return sub.chains(start_s)[2][at, step], np.where(level == COLD, ZYGOTE, level).astype(np.int64)

    @classmethod
    def merge(cls, m: int, parts: list[tuple[np.ndarray, PlanTable]]) -> PlanTable:
        """Assemble m rows from tables that each hold some of them."""
        width = max((p.breaks.shape[1] for _, p in parts), default=1)
        breaks = np.full((m, width), np.inf)
        codes = np.full((m, width), COLD, dtype=np.int8)
        for rows, p in parts:
            breaks[rows, : p.breaks.shape[1]] = p.breaks
            codes[rows, : p.codes.shape[1]] = p.codes
        return cls(breaks, codes)

    @classmethod
    def of(cls, plan: IdlePlan) -> PlanTable:
        """One row: `plan`."""
        return cls(np.array([[s for s, _ in plan.steps]], dtype=np.float64),
                   np.array([[_CODE[r] for _, r in plan.steps]], dtype=np.int8))

    @classmethod
    def constant(cls, m: int, steps: list[tuple[float, int]]) -> PlanTable:
        return cls(np.tile([s for s, _ in steps], (m, 1)).astype(np.float64),
                   np.tile([c for _, c in steps], (m, 1)).astype(np.int8))


class KeepAlivePolicy(Protocol):
    """The interface both drivers use, whatever the policy (its name and knob's name: class attributes, read only)."""

    @property
    def name(self) -> str: ...
    @property
    def knob(self) -> str: ...

    def new_history(self) -> IdleHistory: ...
    def plans(self, table: HistoryTable, need_s: np.ndarray | None = None) -> PlanTable: ...
    def plan(self, history: IdleHistory, prior: PooledPrior | None = None,
             zygote_others: float | None = None) -> IdlePlan: ...
    def knob_value(self) -> float: ...
    def with_knob(self, value: float) -> KeepAlivePolicy: ...
    def sweep(self) -> tuple[float, ...]: ...
    def prices_zygote_share(self) -> bool: ...
    def replans(self, plan: IdlePlan, before: float | None, after: float | None) -> bool: ...
    def with_memory_copy(self, memory_copy_mb: float) -> KeepAlivePolicy: ...
    def pool(self, tables: list[HistoryTable], running_s: list[float | None] | None = None) -> PooledPrior | None: ...


class PolicyBase:
    """What every policy shares: a history of its own spec, one plan from its table, its knob to sweep; and the
    live driver's questions answered for a policy that prices nothing by the zygote's share and pools no prior."""

    name: ClassVar[str]
    knob: ClassVar[str]
    spec: HistogramSpec

    def new_history(self) -> IdleHistory:
        return IdleHistory(self.spec)

    def plans(self, table: HistoryTable, need_s: np.ndarray | None = None) -> PlanTable:
        raise NotImplementedError

    def plan(self, history: IdleHistory, prior: PooledPrior | None = None,
             zygote_others: float | None = None) -> IdlePlan:
        """The plan of one history (`prior`, `zygote_others`: for a policy that uses them, `LadderPolicy`)."""
        return self.plans(history.table()).row(0)

    def knob_value(self) -> float:
        return float(getattr(self, self.knob))

    def with_knob(self, value: float) -> Any:
        return replace(self, **{self.knob: value})  # type: ignore[type-var]

    def prices_zygote_share(self) -> bool:
        """Whether its plans price the runtime's zygote by the share of time other models hold it (`zygote_others`):
        the driver then tells it that share (`ember.keepalive.zygote_share`)."""
        return False

    def replans(self, plan: IdlePlan, before: float | None, after: float | None) -> bool:
        """Whether `plan`, made at zygote share `before`, can change at share `after` (None: the even split)."""
        return False

    def with_memory_copy(self, memory_copy_mb: float) -> Any:
        """The policy as a store-backed model with this many MB in the weight store's memory tier pays."""
        return self

    def pool(self, tables: list[HistoryTable], running_s: list[float | None] | None = None) -> PooledPrior | None:
        """The prior pooled over the node's models' histories, for `plan` (None: it pools none)."""
        return None


def check_floor(name: str, floor: int) -> None:
    """A policy's `floor` (where it drops to outside its hot window) must be nothing or the zygote."""
    if floor not in (COLD, ZYGOTE):
        raise InvalidInput(f"{name}: floor must be the fetch ({COLD}) or zygote ({ZYGOTE}) level, got {floor}")


def check_knob(policy: str, name: str, value: float, lo: float, hi: float) -> None:
    """Raises InvalidInput naming the policy and knob unless lo <= value <= hi."""
    if not (lo <= value <= hi):
        raise InvalidInput(f"{policy}: {name} must lie in [{lo:g}, {hi:g}], got {value!r}")


# A policy's knobs: its dataclass fields of these types (costs, rungs and histogram specs are not set by number).
_KNOB_TYPES = ("float", "int", "bool")


def numeric_knobs(cls: type) -> dict[str, str]:
    """The knobs of a policy class that a number sets, each with its type's name."""
    return {f.name: str(f.type) for f in fields(cls) if f.init and str(f.type) in _KNOB_TYPES}


def typed_knobs(policy: str, cls: type, knobs: Mapping[str, float]) -> dict[str, Any]:
    """Knobs given as numbers at the edge (`--knob`), checked against `cls`'s numeric knobs and typed: a whole
    number for an int, 0 or 1 for a bool. InvalidInput names the policy and the knob. (Ranges are the class's.)"""
    known = numeric_knobs(cls)
    out: dict[str, Any] = {}
    for name, value in knobs.items():
        kind = known.get(name)
        if kind is None:
            raise InvalidInput(f"{policy}: {name!r} is not a knob (knobs: {', '.join(sorted(known))})")
        if kind == "float":
            out[name] = float(value)
        elif kind == "bool":
            if value not in (0, 1):
                raise InvalidInput(f"{policy}: {name} is 0 or 1, got {value!r}")
            out[name] = bool(value)
        else:
            if not (abs(value) < 2**53 and value == int(value)):
                raise InvalidInput(f"{policy}: {name} must be a whole number, got {value!r}")
            out[name] = int(value)
    return out
