"""Keep-alive plans of several models sharing one zygote, live against simulated.

K applications of a trace window (each at its trace times, optionally time-scaled) are replayed against ONE
`ember serve` serving K copies of the bundled iris model under the names `iris-a`, `iris-b`, ... (one runtime,
so one zygote they share), each capped at one instance, under one keep-alive policy; `ember.testing.replay`
does the same for one application, and its notions are kept here model by model. A sampler reads, every
`sample_s`, the PSS of every node process and attributes it: the zygote (shared), and per model its template
and the template's children (its instances). Which model a template belongs to is asked of the server
(`/ember/status` lists each model's template and instance pids) whenever one not seen before appears, and
kept by (pid, start time) so that a reused pid is not taken for its predecessor; a template the server never
listed is reported as unattributed.

Compared, for the same arrivals (the times they were sent; each execution as long as its reply took) with
`ember.sim.engine.simulate(trace of the K apps, policy, the costs measured in this run, runtimes=1)`:

- per model: starts per rung (live from the `Ember-Rung` header; its first arrival left out on both sides, as
  for one model), and the seconds of its idle time (its own idle intervals: from each of its replies to its
  next arrival, and from its last to the window's end) in each of its states: an instance up (the simulator's
  hot and paused), only its template (template), no template (zygote and fetch: the zygote is not the model's);
- the shared zygote: the seconds it is up from the moment every model has had an arrival to the window's end,
  live against the simulator's union of its models' holds over the same time (`ember.sim.zygotes.union_s`).
  Before that moment a model deployed but not yet served holds the zygote live (its deploy made it), not in
  the simulator, so that time is left out on both sides;
- idle memory, MB*s: each model's own PSS (template and instances) over its idle intervals, plus the
  zygote's PSS over the time above; in the simulator each model's idle seconds per level times the mean PSS
  this run measured for a model's state (an instance up for hot and paused, its template alone for
  template, nothing below: the zygote is counted once), plus the zygote's mean PSS times the union's seconds.
  Were the zygote counted from the first arrival, the simulator's side would be the engine's own
  `RunResult.total_idle_mb_s` at these costs.

A start on "nothing kept" while another model holds the zygote is a zygote start live (the node forks it from
the zygote that is up) and in the simulator (`ember.sim.zygotes.found_up`): held by the others through the
measured full start's time before it (live, a zygote another model's start made a moment before is not ready
yet, and the start is a full one too).

Per arrival, the rung the model's plan predicts (as for one model: refreshed at every arrival; an idle time
within `margin_s` of a step is undetermined), a predicted fetch being a zygote start where the live zygote was
up through the `margin_s` before the arrival (undetermined where it came or went then); an arrival while the plan
climbs back from nothing kept, begun while the live zygote was up, is predicted from what that climb (a zygote
start's) reached, as in the simulator. A ladder pricing the
zygote at its marginal cost is told, live, the share of the past hour's whole minutes in which other models
held it (`ember.keepalive.zygote_share`, from the server's ticks, which the replay does not see): an arrival is
then determined only where the plans at the even split and at shares 0, 0.1, ..., 1 agree on its rung (but
in the server's first whole minute, when it has no share yet and plans at the even split). For such a ladder
`sim.even` is the simulator with the zygote split evenly throughout (`marginal_zygote` off): where the two
differ, the live figures side with one of them.

bench/keepalive_replay.py --apps A,B runs it; tests/e2e/test_keepalive_replay_many.py runs a short window.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ember.core.rung_costs import RungCost, RungCosts
from ember.core.states import Rung
from ember.keepalive.idle_plan import COLD, HOT, LEVELS, PAUSED, TEMPLATE, ZYGOTE, KeepAlivePolicy
from ember.keepalive.policies import LadderPolicy
from ember.keepalive.zygote_share import MINUTE_S
from ember.node import procinfo
from ember.sim.engine import simulate
from ember.sim.traces import AppTrace, Trace
from ember.sim.zygotes import union_s
from ember.testing.replay import (
    Sent,
    children,
    cmdline,
    determined_groups,
    first_left_out,
    idle_intervals,
    overlap,
    pooled_prior,
    predicted,
    replay,
    serve_args,
    served_policy,
    window,
)
from ember.testing.server import EmberServer

MODEL_STATES = ("instance", "template", "none")   # what a model holds, most first
SHARES = tuple(np.round(np.linspace(0.0, 1.0, 11), 2))
Ident = tuple[int, int]   # (pid, start time in clock ticks since boot): a pid the kernel reused is another process


def model_names(k: int) -> list[str]:
    return [f"iris-{chr(ord('a') + i)}" for i in range(k)]


# --- the node's processes, attributed --------------------------------------------------------------------------

def ident(pid: int) -> Ident | None:
    """(pid, its start time) from /proc/PID/stat (field 22; the name in parentheses may hold spaces); None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return pid, int(stat.rsplit(")", 1)[1].split()[19])


def owners_from_status(status: Mapping[str, Any]) -> dict[int, tuple[str, str]]:
    """pid -> (model, "template" or "instance") from `/ember/status`."""
    out: dict[int, tuple[str, str]] = {}
    for m in status.get("models", []):
        if m.get("template") and m["template"].get("pid"):
            out[int(m["template"]["pid"])] = (m["name"], "template")
        for inst in m.get("instances", []):
            if inst.get("pid"):
                out[int(inst["pid"])] = (m["name"], "instance")
    return out


@dataclass(frozen=True)
class Sample:
    """One look at the node: the zygotes' PSS, and per child of a zygote its own PSS and its children's."""

    t: float
    zygotes: int
    zygote_mb: float
    children: dict[Ident, tuple[float, float, int]]   # zygote child -> (its MB, its children's MB, how many)


def _pss_mb(pid: int) -> float:
    with contextlib.suppress(OSError):   # it left between the listing and the read
        return procinfo.memory_of(pid).pss_bytes / 2**20
    return 0.0


def look(server_pid: int) -> Sample:
    zygotes = [c for c in children(server_pid) if b"ember.node.zygote" in cmdline(c)]
    kids: dict[Ident, tuple[float, float, int]] = {}
    for pid in (c for z in zygotes for c in children(z)):
        key = ident(pid)
        if key is not None:
            grand = children(pid)
            kids[key] = (_pss_mb(pid), sum(_pss_mb(g) for g in grand), len(grand))
    return Sample(time.monotonic(), len(zygotes), sum(_pss_mb(z) for z in zygotes), kids)


@dataclass
class ManySampler:
    """Looks at the node every `every_s` in a thread; asks `resolve` (pid -> (model, kind)) about zygote children
    not seen before, at most every `resolve_every_s` while some are unknown."""

    server_pid: int
    every_s: float
    resolve: Callable[[], dict[int, tuple[str, str]]]
    resolve_every_s: float = 0.2
    samples: list[Sample] = field(default_factory=list)
    owners: dict[Ident, tuple[str, str]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _asked: float = 0.0

    def run(self) -> None:
        while not self._stop.is_set():
            sample = look(self.server_pid)
            self.samples.append(sample)
            if any(k not in self.owners for k in sample.children) and \
                    time.monotonic() - self._asked >= self.resolve_every_s:
                self._asked = time.monotonic()
                with contextlib.suppress(Exception):   # the server busy or going: asked again on the next look
                    for pid, owner in self.resolve().items():
                        key = ident(pid)
                        if key is not None:
                            self.owners[key] = owner
            self._stop.wait(self.every_s)

    def stop(self) -> None:
        self._stop.set()


@dataclass
class Attributed:
    """The samples per owner: times, the zygote's PSS and whether one is up, per model its PSS and state."""

    t: np.ndarray
    zygote_mb: np.ndarray
    zygote_up: np.ndarray
    model_mb: dict[str, np.ndarray]
    model_state: dict[str, np.ndarray]
    unattributed_mb: np.ndarray


def attribute(samples: list[Sample], owners: Mapping[Ident, tuple[str, str]], models: list[str]) -> Attributed:
    """Each sample's PSS per owner: a zygote child is its model's template (its children the model's instances),
    or an instance forked from the zygote itself; one no owner is known for is unattributed."""
    n = len(samples)
    mb = {m: np.zeros(n) for m in models}
    has_template = {m: np.zeros(n, dtype=bool) for m in models}
    has_instance = {m: np.zeros(n, dtype=bool) for m in models}
    unattributed = np.zeros(n)
    for i, s in enumerate(samples):
        for key, (own, kids, n_kids) in s.children.items():
            model, kind = owners.get(key, ("", ""))
            if model not in mb:
                unattributed[i] += own + kids
                continue
            mb[model][i] += own + kids
            if kind == "template":
                has_template[model][i] = True
            has_instance[model][i] |= kind == "instance" or n_kids > 0
    state = {m: np.where(has_instance[m], "instance", np.where(has_template[m], "template", "none")) for m in models}
    return Attributed(np.array([s.t for s in samples]), np.array([s.zygote_mb for s in samples]),
                      np.array([s.zygotes > 0 for s in samples]), mb, state, unattributed)


def steady(t: np.ndarray, values: np.ndarray, a: float, b: float) -> bool | None:
    """The value the samples held throughout [a, b] (each held until the next), None if it changed (or none)."""
    held = values[overlap(t, [(a, b)]) > 0]
    return bool(held[0]) if len(held) and (held == held[0]).all() else None


# --- the simulator's side ------------------------------------------------------------------------------------

def model_state_s(level_s: np.ndarray) -> dict[str, float]:
    """A model's idle seconds per level as seconds per model state (the zygote is shared: not the model's)."""
    return {"instance": float(level_s[HOT] + level_s[PAUSED]), "template": float(level_s[TEMPLATE]),
            "none": float(level_s[ZYGOTE] + level_s[COLD])}


def measured_costs(live: Attributed, idle: Mapping[str, list[tuple[float, float]]], since: float, end: float,
                   sent: Mapping[str, list[Sent]]) -> RungCosts:
    """From this run: a model's mean own PSS while idle with an instance up and with its template alone (all
    models' samples together), the zygote's mean PSS while up, each rung's median start latency over hot's."""
    inst, tmpl = [], []
    for m, intervals in idle.items():
        on = overlap(live.t, intervals) > 0
        inst.append(live.model_mb[m][on & (live.model_state[m] == "instance")])
        tmpl.append(live.model_mb[m][on & (live.model_state[m] == "template")])
    zyg = live.zygote_mb[(overlap(live.t, [(since, end)]) > 0) & live.zygote_up]
    defaults = RungCosts()
    later = [s for v in sent.values() for s in v[1:]]
    lat = {r: float(np.median([s.done - s.at for s in later if s.rung == r])) for r in {s.rung for s in later}}

    def cost(samples: list[np.ndarray] | np.ndarray, rung: str, default: RungCost) -> RungCost:
        mb = np.concatenate(samples) if isinstance(samples, list) else samples
        start = max(0.0, lat[rung] - lat.get("hot", 0.0)) if rung in lat else default.start_s
        return RungCost(float(mb.mean()) if len(mb) else default.idle_mb, start)

    hot = cost(inst, "hot", defaults.hot)
    return RungCosts(hot=hot, paused=RungCost(hot.idle_mb, cost(inst, "paused", defaults.paused).start_s),
                     template=cost(tmpl, "template", defaults.template), zygote=cost(zyg, "zygote", defaults.zygote),
                     cold=RungCost(0.0, cost(zyg, "fetch", defaults.cold).start_s))


# --- comparing -------------------------------------------------------------------------------------------------

def _live_model(sent: list[Sent], live: Attributed, model: str, intervals: list[tuple[float, float]],
                pred: list[tuple[str, bool]], margin_s: float) -> dict[str, Any]:
    held = overlap(live.t, intervals)
    state = live.model_state[model]
    # A predicted "nothing kept" is a zygote start where another model kept the zygote up through the margin.
    seen = []
    for s, (rung, known) in zip(sent[1:], pred, strict=True):
        if rung == Rung.FETCH.value and known:
            up = steady(live.t, live.zygote_up, s.at - margin_s, s.at)
            rung, known = (Rung.ZYGOTE.value if up else rung), up is not None
        seen.append((rung, known))
    groups = determined_groups([("", False), *seen], sent)
    return {"starts": first_left_out(sent), "idle_mb_s": float(held @ live.model_mb[model]),
            "state_s": {k: float(held[state == k].sum()) for k in MODEL_STATES},
            "determined": {"n": sum(len(p) for p, _ in groups), "agree": sum(len(p) for p, r in groups if p == r),
                           "disagree": [(p, r) for p, r in groups if p != r]},
            "predicted": seen}


def compare_many(policy: KeepAlivePolicy, sent: Mapping[str, list[Sent]], live: Attributed, t0: float, end: float,
                 margin_s: float, shares_from: float = -np.inf, started: float | None = None) -> dict[str, Any]:
    """Live against simulated, per model, for the zygote, and in total (see the module's docstring);
    `shares_from`: when the server may first have had a zygote share (a whole minute after it started);
    `started`: about when it started (its pooled prior's epochs; default `t0`)."""
    models = list(sent)
    since = max(v[0].at for v in sent.values())   # every model has had an arrival
    idle = {m: idle_intervals(v, end) for m, v in sent.items()}
    costs = measured_costs(live, idle, since, end, sent)
    arrivals = {m: np.array([s.at - t0 for s in v]) for m, v in sent.items()}
    trace = Trace("replay", "replay", end - t0, [AppTrace(
        m, arrivals[m], np.ones(len(v), dtype=np.int64), np.zeros(len(v)), np.array([s.done - s.at for s in v]))
        for m, v in sent.items()])
    # How long a zygote a full start makes takes to be ready for another's start: the measured full start's
    # time (none made live: no zygote was made during the replay, none to wait for).
    full = any(s.rung == Rung.FETCH.value for v in sent.values() for s in v[1:])
    ready_s = costs.cold.start_s if full else 0.0
    sim = simulate(trace, policy, costs, runtimes=1, per_app=True, ready_s=ready_s)
    holds = [sim.apps[i][2] for i in range(len(models))]
    per_model_mb = costs.own_mb()   # the zygote is counted once, below
    shares = SHARES if isinstance(policy, LadderPolicy) and policy.marginal_zygote and len(models) > 1 else ()
    prior_at = pooled_prior(policy, sent, t0 if started is None else started)
    out: dict[str, Any] = {}
    for i, m in enumerate(models):
        starts, idle_s, _ = sim.apps[i]
        sim_starts = {lv.value: int(n) for lv, n in zip(LEVELS, starts, strict=True)}
        sim_starts[Rung.FETCH.value] -= 1   # its compulsory first start (left out live too)
        pred, _ = predicted(policy, sent[m], margin_s, end, shares=shares, shares_from=shares_from, prior_at=prior_at,
                            start_s=costs.start_s(), zygote_up=lambda a, b: steady(live.t, live.zygote_up, a, b))
        out[m] = {"live": _live_model(sent[m], live, m, idle[m], pred, margin_s),
                  "sim": {"starts": sim_starts, "idle_mb_s": float(idle_s @ per_model_mb),
                          "state_s": model_state_s(idle_s)}}
    window = overlap(live.t, [(since, end)])
    union = union_s(holds, end - t0, since_s=since - t0)
    up = live.zygote_up[window > 0]
    zygote = {"live": {"up_s": float(window[live.zygote_up].sum()), "mb_s": float(window @ live.zygote_mb),
                       "releases": int((up[:-1] & ~up[1:]).sum())},
              "sim": {"up_s": union, "mb_s": union * costs.zygote.idle_mb}}
    if shares and isinstance(policy, LadderPolicy):
        _even_split(replace(policy, marginal_zygote=False), trace, costs, since - t0, ready_s, out, zygote)
    return {
        "horizon_s": end - t0, "since_s": since - t0, "models": out, "zygote": zygote,
        "total": {side: zygote[side]["mb_s"] + sum(v[side]["idle_mb_s"] for v in out.values())
                  for side in ("live", "sim")},
        "unattributed_mb_s": float(overlap(live.t, [(t0, end)]) @ live.unattributed_mb),
        "sent": {m: [[round(s.at - t0, 4), round(s.done - s.at, 4), s.rung, *p] for s, p in
                     zip(v, [("", True), *out[m]["live"].pop("predicted")], strict=True)] for m, v in sent.items()},
        "costs": {lv.value: {"idle_mb": c.idle_mb, "start_s": c.start_s}
                  for lv, c in zip(LEVELS, costs.by_level(), strict=True)},
    }


def _even_split(policy: KeepAlivePolicy, trace: Trace, costs: RungCosts, since_s: float, ready_s: float,
                out: dict[str, Any], zygote: dict[str, Any]) -> None:
    """Adds "even" beside "sim": the simulator's starts (as the live node counts them) and zygote seconds up with
    the zygote split evenly throughout."""
    sim = simulate(trace, policy, costs, runtimes=1, per_app=True, ready_s=ready_s)
    holds = [sim.apps[i][2] for i in range(len(out))]
    for i, m in enumerate(out):
        starts = {lv.value: int(n) for lv, n in zip(LEVELS, sim.apps[i][0], strict=True)}
        starts[Rung.FETCH.value] -= 1
        out[m]["even"] = {"starts": starts, "state_s": model_state_s(sim.apps[i][1]),
                          "idle_mb_s": float(sim.apps[i][1] @ costs.own_mb())}
    up = union_s(holds, trace.horizon_s, since_s=since_s)
    zygote["even"] = {"up_s": up, "mb_s": up * costs.zygote.idle_mb}


# --- running ---------------------------------------------------------------------------------------------------

async def replay_all(url: str, arrivals: Mapping[str, np.ndarray], t0: float) -> dict[str, list[Sent]]:
    replies = await asyncio.gather(*(replay(url, a, t0, m) for m, a in arrivals.items()))
    return dict(zip(arrivals, replies, strict=True))


def run_many(trace_dir: Path, apps: list[str], start_s: float, length_s: float, scale: float, policy_name: str,
             knob: float | None, margin_s: float = 0.5, sample_s: float = 0.05, tick_s: float = 0.05,
             sandbox: str = "off", state_dir: Path | None = None) -> dict[str, Any]:
    """Replay `apps` of the trace window together against one server (model i serves app i); see the module."""
    names = model_names(len(apps))
    arrivals = {m: window(trace_dir, app, start_s, length_s, scale) for m, app in zip(names, apps, strict=True)}
    empty = [app for m, app in zip(names, apps, strict=True) if not len(arrivals[m])]
    if empty:
        raise SystemExit(f"--apps: no arrivals of {empty} in the window")
    policy = served_policy(policy_name, knob)
    tmp = Path(tempfile.mkdtemp(prefix="ka-many-", dir=state_dir))
    started = time.monotonic()   # the server's zygote shares count whole minutes from its first tick, after this
    try:
        with EmberServer(tmp / "state", *serve_args(tmp, names, policy_name, knob, tick_s, sandbox)) as server:
            assert server.proc is not None
            sampler = ManySampler(server.proc.pid, sample_s, lambda: owners_from_status(server.status()))
            thread = threading.Thread(target=sampler.run, daemon=True)
            thread.start()
            time.sleep(0.5)
            t0 = time.monotonic()
            sent = asyncio.run(replay_all(server.url, arrivals, t0))
            end = t0 + length_s / scale
            time.sleep(max(0.0, end - time.monotonic()) + sample_s)
            sampler.stop()
            thread.join()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    live = attribute(sampler.samples, sampler.owners, names)
    return compare_many(policy, sent, live, t0, end, margin_s, started + MINUTE_S, started) | {
        "trace": str(trace_dir), "apps": dict(zip(names, apps, strict=True)), "start_s": start_s,
        "length_s": length_s, "scale": scale, "policy": policy_name, "knob": policy.knob_value(),
        "knob_name": policy.knob, "margin_s": margin_s}


__all__ = ["MODEL_STATES", "Attributed", "ManySampler", "Sample", "attribute", "compare_many",
           "model_names", "owners_from_status", "run_many", "steady"]
