"""Keep-alive plans, live against simulated: replay a window of a real trace against `ember serve --keepalive X`.

One application of a trace (a window of it, optionally time-scaled) is replayed, arrival by arrival, against
a real `ember serve` serving the bundled iris model under keep-alive policy X, while a sampler reads the PSS of
every node process (zygote, template, instances: /proc/PID/smaps_rollup, every `sample_s`). Then:

- live: starts per rung (the `Ember-Rung` header of each reply), start latency per rung, idle PSS-seconds (PSS
  summed over the node's processes, integrated over the idle time: from each reply to the next arrival, and
  from the last reply to the window's end), and the seconds spent in each node state (an instance up; only the
  template; only the zygote; nothing);
- sim: `ember.sim.engine.simulate` on the same arrivals (the times the replayer sent them; each execution as
  long as its live reply took), with the same policy object and the rung costs measured on this server in this
  run (mean node PSS in each state; each rung's median start latency over the hot one's);
- per arrival, the rung the policy's plan predicts (`rung_at` of its idle time, the plan refreshed at every
  arrival, as the simulator does for an application's first 64): arrivals whose idle time lies within
  `margin_s` of a plan step are undetermined live (the tick, the release, or a climb back, may fall
  either side); the others must land on the predicted rung.

The first arrival is left out of the start counts on both sides: the simulator charges it as a compulsory
cold start from nothing, while the live server keeps what it deployed (the template) until a model has served.
The served iris contract is capped at one instance (`max_scale: 1`), the simulator's model of an application:
a request that comes while another runs waits for it, and both count as hot.

bench/keepalive_replay.py runs it and prints the table; tests/e2e/test_keepalive_replay.py runs a short window.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

import ember
from ember.core.rung_costs import RungCost, RungCosts
from ember.core.rung_plan import IdlePlan
from ember.core.states import Rung
from ember.keepalive.forecast import IdleHistory
from ember.keepalive.idle_plan import LEVELS, KeepAlivePolicy, start_and_climb, start_rung
from ember.keepalive.policies import LadderPolicy
from ember.keepalive.pooled_prior import POOL_EPOCH_S, PooledPrior
from ember.node import procinfo
from ember.sim.engine import simulate
from ember.sim.traces import AppTrace, Trace, read_trace, sniff_format
from ember.testing.server import EmberServer

TRACES = Path("/work/shared/traces")
STATES = ("instance", "template", "zygote", "nothing")   # what the node holds, most first
STATE_LEVEL = {"instance": Rung.HOT, "template": Rung.TEMPLATE, "zygote": Rung.ZYGOTE, "nothing": Rung.FETCH}
BODY = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 4], "data": [5.1, 3.5, 1.4, 0.2]}]}


def window(trace_dir: Path, app: str, start_s: float, length_s: float, scale: float) -> np.ndarray:
    """Arrival times (seconds from the window's start, divided by `scale`) of one application of a trace."""
    trace = read_trace(trace_dir, sniff_format(trace_dir))
    found = [a for a in trace.apps if a.name == app]
    if not found:
        raise SystemExit(f"--app: no application {app!r} in {trace_dir} (have: {[a.name for a in trace.apps]})")
    arrivals = np.repeat(found[0].starts, found[0].counts)
    arrivals = arrivals[(arrivals >= start_s) & (arrivals < start_s + length_s)] - start_s
    return np.sort(arrivals) / scale


# --- the node's processes -----------------------------------------------------------------------------------

def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def node_processes(server_pid: int) -> dict[str, list[int]]:
    """The server's zygotes, their children (templates) and grandchildren (instances forked from a template).

    A model that keeps no template has instances forked from the zygote: they would count as templates here;
    the replay serves iris, which keeps one."""
    zygotes = [c for c in children(server_pid) if b"ember.node.zygote" in cmdline(c)]
    templates = [t for z in zygotes for t in children(z)]
    instances = [i for t in templates for i in children(t)]
    return {"zygote": zygotes, "template": templates, "instance": instances}


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@dataclass
class Sampler:
    """Samples the node's total PSS and state every `every_s` seconds in a thread."""

    server_pid: int
    every_s: float
    t: list[float] = field(default_factory=list)
    pss_mb: list[float] = field(default_factory=list)
    state: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self._stop.is_set():
            procs = node_processes(self.server_pid)
            total = 0
            for pid in (p for kind in procs.values() for p in kind):
                with contextlib.suppress(OSError):   # it left between the listing and the read
                    total += procinfo.memory_of(pid).pss_bytes
            held = next((s for s in STATES[:3] if procs[s]), "nothing")
            self.t.append(time.monotonic())
            self.pss_mb.append(total / 2**20)
            self.state.append(held)
            self._stop.wait(self.every_s)

    def stop(self) -> None:
        self._stop.set()


# --- replaying --------------------------------------------------------------------------------------------

@dataclass
class Sent:
    at: float         # monotonic send time
    done: float       # monotonic reply time
    rung: str


async def replay(url: str, arrivals: np.ndarray, t0: float, model: str = "iris") -> list[Sent]:
    """Each arrival sent to `model` at t0 + its time; the replies in arrival order."""
    out: list[Sent | None] = [None] * len(arrivals)

    async def one(i: int, client: httpx.AsyncClient) -> None:
        await asyncio.sleep(max(0.0, t0 + float(arrivals[i]) - time.monotonic()))
        at = time.monotonic()
        r = await client.post(f"{url}/v2/models/{model}/infer", json=BODY, timeout=120)
        if r.status_code != 200:   # a 202 (it became a job) would measure nothing
            raise RuntimeError(f"arrival {i}: {r.status_code} {r.text[:200]}")
        out[i] = Sent(at, time.monotonic(), r.headers.get("ember-rung", "?"))

    async with httpx.AsyncClient() as client:
        await asyncio.gather(*(one(i, client) for i in range(len(arrivals))))
    return [s for s in out if s is not None]


def idle_intervals(sent: list[Sent], end: float) -> list[tuple[float, float]]:
    """From the latest reply so far to the next arrival, and from the last reply to `end` (the simulator's idle)."""
    out, latest = [], sent[0].done
    for s in sent[1:]:
        if s.at > latest:
            out.append((latest, s.at))
        latest = max(latest, s.done)
    out.append((latest, max(latest, end)))
    return out


def overlap(t: np.ndarray, intervals: list[tuple[float, float]]) -> np.ndarray:
    """Seconds of each sample (held from its time until the next sample's) that fall within the intervals."""
    nxt = np.append(t[1:], t[-1])
    out = np.zeros(len(t))
    for a, b in intervals:
        out += np.clip(np.minimum(nxt, b) - np.maximum(t, a), 0.0, None)
    return out


def integrate(sampler: Sampler, intervals: list[tuple[float, float]]) -> tuple[float, dict[str, float]]:
    """PSS MB*s over the intervals (each sample held until the next), and seconds per node state."""
    held = overlap(np.array(sampler.t), intervals)
    states = np.array(sampler.state)
    return float(held @ np.array(sampler.pss_mb)), {s: float(held[states == s].sum()) for s in STATES}


def measured_costs(sampler: Sampler, intervals: list[tuple[float, float]], sent: list[Sent]) -> RungCosts:
    """Rung costs from this run: mean node PSS while idle in each state, median start latency over hot's."""
    t = np.array(sampler.t)
    idle = np.zeros(len(t), dtype=bool)
    for a, b in intervals:
        idle |= (t >= a) & (t < b)
    states, pss = np.array(sampler.state), np.array(sampler.pss_mb)
    defaults = RungCosts()
    mb = {s: float(pss[idle & (states == s)].mean()) if (idle & (states == s)).any() else None for s in STATES}
    lat = {r: float(np.median([s.done - s.at for s in sent[1:] if s.rung == r]))
           for r in {s.rung for s in sent[1:]}}
    hot = lat.get("hot", 0.0)

    def cost(state: str, rung: str, default: RungCost) -> RungCost:
        m = mb[state]
        start = max(0.0, lat[rung] - hot) if rung in lat else default.start_s
        return RungCost(default.idle_mb if m is None else m, start)

    hot_cost = cost("instance", "hot", defaults.hot)
    paused = RungCost(hot_cost.idle_mb, cost("instance", "paused", defaults.paused).start_s)
    cold = RungCost(0.0, cost("nothing", "fetch", defaults.cold).start_s)
    return RungCosts(hot=hot_cost, paused=paused, template=cost("template", "template", defaults.template),
                     zygote=cost("zygote", "zygote", defaults.zygote), cold=cold)


# Whether the runtime's zygote was up live throughout [a, b] (None: it came or went).
ZygoteUp = Callable[[float, float], bool | None]


def predicted(policy: KeepAlivePolicy, sent: list[Sent], margin_s: float, end: float,
              periods: list[tuple[float, float, IdlePlan]] | None = None, shares: tuple[float, ...] = (),
              shares_from: float = -np.inf, start_s: np.ndarray | None = None,
              zygote_up: ZygoteUp | None = None, prior_at: PriorAt | None = None
              ) -> tuple[list[tuple[str, bool]], np.ndarray]:
    """Per arrival after the first: the rung its plan predicts, and whether that is determined (not within
    `margin_s` of a step of the plan); and the idle seconds per level the plans hold, up to `end`.
    `periods`, if given, gets each idle period: (its start, its length, the plan that held it).

    The plan is refreshed at every arrival, the first too, as the live server does (on its next tick); an arrival
    while an execution runs (the first's included) adds an idle period of 0 (the simulator refreshes at an
    application's first 64 arrivals, then once a minute). `shares`: for a ladder pricing the zygote at its
    marginal cost, shares of time other models held it that the live plan may have been made at (the server's,
    which the replay does not see): an arrival is then determined only where the plans at each of them and at
    the even split (the one predicted, and the one held) agree on its rung, none with a step within `margin_s`;
    an arrival before `shares_from` (the server's first whole minute: it has no share yet) on the even split's
    plan alone. `start_s` (per level):
    an arrival while the plan still climbs back starts from the rung the climb began on, as in the simulator
    (`start_rung`); one within `margin_s` of the climb's end is undetermined too. `zygote_up(a, b)`:
    whether the runtime's zygote was up live throughout [a, b] (None: it came or went); a climb back from nothing
    kept that began while it was up forked the model from it (`start_and_climb`), as in the simulator."""
    history = policy.new_history()
    # The live node plans each idle period on the tick after the arrival that begins it, the first's too.
    plans = _plans(policy, history, shares, prior_at(sent[0].at) if prior_at else None)
    out, latest = [], sent[0].done
    held = np.zeros(len(LEVELS))
    for s in sent[1:]:
        gap = s.at - latest
        if gap <= 0:
            out.append((Rung.HOT.value, True))   # it came while an execution ran: the instance is hot
            history.observe(0.0)                 # an idle period of 0, for the live server and the simulator
        else:
            now = plans if s.at >= shares_from else plans[:1]
            near = any(abs(gap - b) < margin_s for p in now for b, _ in p.steps[1:])
            out.append(_start(now, gap, latest, margin_s, start_s, near, zygote_up))
            held += _held(plans[0], gap)
            if periods is not None:
                periods.append((latest, gap, plans[0]))
            history.observe(gap)
        plans = _plans(policy, history, shares, prior_at(s.at) if prior_at else None)
        latest = max(latest, s.done)
    return out, held + _held(plans[0], max(0.0, end - latest))


def _start(plans: list[IdlePlan], gap: float, latest: float, margin_s: float, start_s: np.ndarray | None,
           near: bool, zygote_up: ZygoteUp | None) -> tuple[str, bool]:
    """The rung an arrival `gap` after `latest` starts from under `plans[0]`, and whether it is determined: every
    plan of `plans`, at idle times within `margin_s`, agrees (none `near` a step), and where one of them climbs back
    from nothing kept then, `zygote_up` says whether the live zygote was up through the `margin_s` before that climb
    began (it then forked the model from it: `start_and_climb`)."""
    unknown = False

    def rung(p: IdlePlan, x: float) -> Rung:
        nonlocal unknown
        if start_s is None or zygote_up is None:
            return start_rung(p, x, start_s)
        plain, climb = start_and_climb(p, x, start_s)
        if climb is None:
            return plain
        up = zygote_up(latest + climb[0] - margin_s, latest + climb[0])
        unknown |= up is None
        return climb[1] if up else plain

    seen = {rung(p, x) for p in plans for x in (gap - margin_s, gap, gap + margin_s)}
    return rung(plans[0], gap).value, not near and len(seen) == 1 and not unknown


def _plans(policy: KeepAlivePolicy, history: IdleHistory, shares: tuple[float, ...],
           prior: PooledPrior | None = None) -> list[IdlePlan]:
    """The plan of `history` at the even split, then (a ladder) at each of `shares`; `prior`: the pooled prior."""
    if not isinstance(policy, LadderPolicy):
        return [policy.plan(history)]
    return [policy.plan(history, prior), *(policy.plan(history, prior, share) for share in shares)]


# The pooled prior the live node plans with at a time (None: none).
PriorAt = Callable[[float], PooledPrior | None]


def served_policy(policy_name: str, knob: float | None) -> KeepAlivePolicy:
    """The policy `ember serve --keepalive NAME [--keepalive-knob K]` runs: a ladder with the default preset's
    constants (`ember.config.keepalive_policy`), not the class defaults."""
    from ember.config import ServeConfig, keepalive_policy

    policy = keepalive_policy(ServeConfig(keepalive=policy_name, keepalive_knob=knob))   # type: ignore[arg-type]
    assert policy is not None
    return policy


def pooled_prior(policy: KeepAlivePolicy, sent: Mapping[str, list[Sent]], started: float) -> PriorAt | None:
    """For a ladder mixing in the pooled prior, the prior the live node plans with at time t: its epoch's
    (`ember.serving.actuator`, renewed every `POOL_EPOCH_S` from the server's start, about `started`; the first
    pools none), pooled from every model's history at the epoch's start (the idle periods that ended by then, an
    arrival while busy an idle period of 0) with each model's idle time so far censored (`LadderPolicy.pool`);
    None otherwise. A replay shorter than an epoch plans with the policy's own prior throughout, as the simulator
    does over the same arrivals."""
    if not isinstance(policy, LadderPolicy) or policy.pooled_weight <= 0:
        return None

    def at(when: float) -> PooledPrior | None:
        epoch = int(max(0.0, when - started) // POOL_EPOCH_S)
        return None if epoch == 0 else pooled(started + epoch * POOL_EPOCH_S)

    def pooled(t: float) -> PooledPrior | None:
        tables, running = [], []
        for v in sent.values():
            history = policy.new_history()
            latest: float | None = None
            for s in v:
                if s.at > t:
                    break
                if latest is not None:
                    history.observe(max(0.0, s.at - latest))
                latest = s.done if latest is None else max(latest, s.done)
            tables.append(history.table())
            running.append(None if latest is None or latest > t else t - latest)
        return policy.pool(tables, running)

    return at


def _held(plan: IdlePlan, gap: float) -> np.ndarray:
    """Seconds per level the plan holds during an idle period of `gap` seconds."""
    out = np.zeros(len(LEVELS))
    bounds = [b for b, _ in plan.steps[1:]] + [np.inf]
    for (start, rung), stop in zip(plan.steps, bounds, strict=True):
        out[LEVELS.index(rung)] += max(0.0, min(gap, stop) - start)
    return out


def serve_args(tmp: Path, names: list[str], policy_name: str, knob: float | None, tick_s: float,
               sandbox: str) -> list[str]:
    """`ember serve` arguments for the bundled iris model under each of `names` (in `tmp/models`, one runtime
    and so one zygote), each capped at one instance, under keep-alive policy `policy_name`."""
    examples = Path(ember.__file__).parent / "examples"
    models = tmp / "models"
    models.mkdir()
    # One instance at most, as the simulator models an application: a request that comes while it runs waits
    # for it (hot) instead of starting a second one.
    contract = (examples / "iris.yaml").read_text()
    assert "max_scale: 2" in contract and "name: iris\n" in contract
    for name in names:
        (models / f"{name}.yaml").write_text(contract.replace("max_scale: 2", "max_scale: 1")
                                             .replace("name: iris\n", f"name: {name}\n"))
    shutil.copytree(examples / "iris_softmax", models / "iris_softmax")
    args = ["--models", str(models), "--keepalive", policy_name, "--tick-s", str(tick_s),
            "--cpu-slots", str(len(names) + 1), "--sandbox", sandbox,
            "--queue-wait-s", "60"]   # a request waits out a full start
    return args + (["--keepalive-knob", str(knob)] if knob is not None else [])


def run(trace_dir: Path, app: str, start_s: float, length_s: float, scale: float, policy_name: str,
        knob: float | None, margin_s: float = 0.5, sample_s: float = 0.05, tick_s: float = 0.05,
        sandbox: str = "off", state_dir: Path | None = None) -> dict[str, Any]:
    arrivals = window(trace_dir, app, start_s, length_s, scale)
    horizon = length_s / scale
    policy = served_policy(policy_name, knob)
    tmp = Path(tempfile.mkdtemp(prefix="ka-replay-", dir=state_dir))
    try:
        with EmberServer(tmp / "state", *serve_args(tmp, ["iris"], policy_name, knob, tick_s, sandbox)) as server:
            assert server.proc is not None
            sampler = Sampler(server.proc.pid, sample_s)
            thread = threading.Thread(target=sampler.run, daemon=True)
            thread.start()
            time.sleep(0.5)
            t0 = time.monotonic()
            sent = asyncio.run(replay(server.url, arrivals, t0))
            end = t0 + horizon
            time.sleep(max(0.0, end - time.monotonic()) + sample_s)
            sampler.stop()
            thread.join()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return compare(policy, sent, sampler, t0, end, margin_s) | {
        "trace": str(trace_dir), "app": app, "start_s": start_s, "length_s": length_s, "scale": scale,
        "policy": policy_name, "knob": policy.knob_value(), "knob_name": policy.knob, "margin_s": margin_s}


def _states(level_s: np.ndarray) -> dict[str, float]:
    """Idle seconds per level as seconds per node state (one model: its zygote is up exactly on the zygote rung)."""
    return {"instance": float(level_s[0] + level_s[1]), "template": float(level_s[2]), "zygote": float(level_s[3]),
            "nothing": float(level_s[4])}


def first_left_out(sent: list[Sent]) -> dict[str, int]:
    """Live starts per rung less the deployed model's first start (from its template), whichever request the
    server saw first: one sent at the same moment as the first may overtake it."""
    starts = {lv.value: sum(1 for s in sent if s.rung == lv.value) for lv in LEVELS}
    first = sent[0].rung if sent[0].rung != Rung.HOT.value else Rung.TEMPLATE.value
    starts[first] = max(0, starts.get(first, 0) - 1)
    return starts


def determined_groups(pred: list[tuple[str, bool]], sent: list[Sent],
                order_s: float = 0.05) -> list[tuple[list[str], list[str]]]:
    """(predicted rungs, live rungs) per group of arrivals sent within `order_s` of each other, for the groups
    whose every arrival is determined. Within a group the server may see the requests in another order than
    they were sent (the first it sees takes the start, the others wait for it and count as hot): compared as
    sorted lists. The first arrival's group is every arrival sent before its reply: at a server's start (several
    models deploying, the first requests of each) one sent more than `order_s` later has been seen to overtake it
    and take the deployed template's start (`first_left_out`), and the first arrival is never determined."""
    groups: list[list[int]] = []
    for i, s in enumerate(sent):
        first = len(groups) == 1 and s.at < sent[0].done
        if groups and (first or s.at - sent[groups[-1][-1]].at < order_s):
            groups[-1].append(i)
        else:
            groups.append([i])
    return [(sorted(pred[i][0] for i in g), sorted(sent[i].rung for i in g)) for g in groups
            if all(pred[i][1] for i in g)]


def compare(policy: KeepAlivePolicy, sent: list[Sent], sampler: Sampler, t0: float, end: float,
            margin_s: float) -> dict[str, Any]:
    intervals = idle_intervals(sent, end)
    live_mb_s, live_state_s = integrate(sampler, intervals)
    costs = measured_costs(sampler, intervals, sent)
    trace = Trace("replay", "replay", end - t0, [AppTrace(
        "app", np.array([s.at - t0 for s in sent]), np.ones(len(sent), dtype=np.int64), np.zeros(len(sent)),
        np.array([s.done - s.at for s in sent]))])
    sim = simulate(trace, policy, costs, runtimes=1)
    sim_starts = {lv.value: int(n) for lv, n in zip(LEVELS, sim.starts, strict=True)}
    sim_starts[Rung.FETCH.value] -= 1   # its compulsory first start (left out live too)
    live_starts = first_left_out(sent)
    periods: list[tuple[float, float, IdlePlan]] = []
    pred, plan_s = predicted(policy, sent, margin_s, end, periods, start_s=costs.start_s(),
                             prior_at=pooled_prior(policy, {"model": sent}, t0))
    mismatched = []
    for start, gap, plan in periods:
        live_s, planned_s = integrate(sampler, [(start, start + gap)])[1], _states(_held(plan, gap))
        if any(abs(live_s[k] - planned_s[k]) > 0.5 for k in STATES):
            mismatched.append({"at": round(start - t0, 3), "gap": round(gap, 3),
                               "plan": [(round(b, 3), r.value) for b, r in plan.steps],
                               "live_s": {k: round(v, 2) for k, v in live_s.items()},
                               "plan_s": {k: round(v, 2) for k, v in planned_s.items()}})
    # The first arrival is no prediction: its group's order against it is unknown too.
    determined = determined_groups([("", False), *pred], sent)
    sim_state_s = _states(sim.idle_s)
    latency: dict[str, list[float]] = {}
    for s in sent[1:]:
        latency.setdefault(s.rung, []).append(s.done - s.at)
    return {
        "arrivals": len(sent), "horizon_s": end - t0,
        "live": {"starts": live_starts, "idle_pss_mb_s": live_mb_s, "state_s": live_state_s,
                 "latency_ms": {r: {"n": len(v), "p50": 1e3 * float(np.median(v)), "max": 1e3 * max(v)}
                                for r, v in latency.items()}},
        # The simulator's idle seconds per level priced per node state, as live measures them: each state's PSS
        # includes the zygote, which the engine's own total charges again as a shared process, over executions too.
        "sim": {"starts": sim_starts, "idle_mb_s": float(np.asarray(sim.idle_s) @ costs.idle_mb()),
                "state_s": sim_state_s},
        "plan": {"idle_mb_s": float(plan_s @ costs.idle_mb()), "state_s": _states(plan_s),
                 "starts": {lv.value: sum(1 for p, _ in pred if p == lv.value) for lv in LEVELS}},
        "mismatched_periods": mismatched,   # idle periods whose live states differ from the plan's by > 0.5 s
        "determined": {"n": sum(len(p) for p, _ in determined),
                       "agree": sum(len(p) for p, r in determined if p == r),
                       "disagree": [(p, r) for p, r in determined if p != r]},
        "sent": [[round(s.at - t0, 4), round(s.done - s.at, 4), s.rung, *p] for s, p in
                 zip(sent, [("", True), *pred], strict=True)],   # per arrival: at, latency, rung, predicted
        "costs": {lv.value: {"idle_mb": c.idle_mb, "start_s": c.start_s}
                  for lv, c in zip(LEVELS, costs.by_level(), strict=True)},
    }
