"""A synthetic generator of Azure Functions 2019 traces, calibrated to the published characteristics.

The characteristics ("Serverless in the Wild", ATC 2020; ../shared/traces/README.md):
~45% of applications are invoked at most once per hour on average and ~81% at most once
per minute; rates span ~8 orders of magnitude and the most popular ~18.6% of applications
make ~99.6% of invocations; ~half of the functions run under 1 s on average; ~90% of
applications never use more than ~400 MB.

The model: log10(daily invocations per app) ~ Normal(MU, SIGMA), with MU and SIGMA solved
from the 45% and 81% points (a lognormal with that spread also gives the 18.6%/99.6% skew);
timer-triggered apps fire periodically, the others are Poisson with a diurnal swing;
functions per app are geometric (54% of apps have one); mean durations and memory are
lognormal with the medians and spreads that give the 50% and 90% points.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist

import numpy as np

from ember.errors import InvalidInput
from ember.sim.traces import MINUTES_PER_DAY, Azure2019Day, Trace, stable_hash, trace_from_2019

# Calibration targets (fractions) and the lognormal they pin down.
ONCE_PER_HOUR_SHARE = 0.45     # apps with <= 24 invocations a day
ONCE_PER_MINUTE_SHARE = 0.81   # apps with <= 1440 invocations a day
_Z45, _Z81 = NormalDist().inv_cdf(ONCE_PER_HOUR_SHARE), NormalDist().inv_cdf(ONCE_PER_MINUTE_SHARE)
SIGMA = (np.log10(1440) - np.log10(24)) / (_Z81 - _Z45)
MU = np.log10(24) - _Z45 * SIGMA
# Function triggers (share of functions, from the paper's Figure 3).
TRIGGERS = {"http": 0.55, "queue": 0.15, "event": 0.02, "orchestration": 0.07, "timer": 0.16,
            "storage": 0.02, "others": 0.03}
DURATION_MEDIAN_S, DURATION_SIGMA = 1.0, 2.0      # ln-space spread: ~1 ms .. minutes
MEMORY_MEDIAN_MB, MEMORY_P90_MB = 150.0, 400.0   # of the most memory an app ever uses
AVERAGE_OF_MAX = 0.85
_MEMORY_PCT_OF_MAX = (0.5, 0.6, 0.75, 0.85, 0.9, 0.95, 0.98, 1.0)   # pct1 .. pct100
DIURNAL_SWING = 0.5


@dataclass(frozen=True)
class SyntheticConfig:
    apps: int = 1000
    seed: int = 0

    def __post_init__(self) -> None:
        # (A day's minute counts are 1,440 integers per function: 100,000 apps take ~1.9 GB.)
        if not 1 <= self.apps <= 100_000:
            raise InvalidInput(f"synthetic apps must lie in [1, 100000], got {self.apps}")
        if not 0 <= self.seed < 2**63:
            raise InvalidInput(f"synthetic seed must lie in [0, 2**63), got {self.seed}")


def generate_day(config: SyntheticConfig) -> Azure2019Day:
    """One day in the 2019 format (functions as rows), deterministic for a seed."""
    rng = np.random.default_rng(config.seed)
    n = config.apps
    daily = np.maximum(1.0, 10 ** rng.normal(MU, SIGMA, n))
    names = list(TRIGGERS)
    trigger = rng.choice(len(names), size=n, p=np.array(list(TRIGGERS.values())))
    minute = np.arange(MINUTES_PER_DAY)
    owners, apps, funcs, triggers, rows, durations = [], [], [], [], [], []
    memory: dict[str, float] = {}
    mem_sigma = np.log(MEMORY_P90_MB / MEMORY_MEDIAN_MB) / NormalDist().inv_cdf(0.9)
    for a in range(n):
        counts = _app_counts(rng, daily[a], names[trigger[a]] == "timer", minute)
        n_funcs = min(10, int(rng.geometric(0.54)))
        split = rng.multinomial(counts, rng.dirichlet(np.ones(n_funcs)))   # (1440, n_funcs)
        app = stable_hash(f"app:{config.seed}:{a}")
        owner = stable_hash(f"owner:{config.seed}:{a}")
        # The calibration is on the most an app uses; the trace's average is a fixed share of it.
        memory[app] = AVERAGE_OF_MAX * float(MEMORY_MEDIAN_MB * np.exp(rng.normal(0, mem_sigma)))
        for f in range(n_funcs):
            if split[:, f].sum() == 0 and f > 0:
                continue
            owners.append(owner)
            apps.append(app)
            funcs.append(stable_hash(f"func:{config.seed}:{a}:{f}"))
            triggers.append(names[trigger[a]])
            rows.append(split[:, f])
            durations.append(1e3 * min(600.0, DURATION_MEDIAN_S * float(np.exp(rng.normal(0, DURATION_SIGMA)))))
    return Azure2019Day(owners, apps, funcs, triggers, np.vstack(rows).astype(np.int64), np.array(durations), memory)


def _app_counts(rng: np.random.Generator, daily: float, timer: bool, minute: np.ndarray) -> np.ndarray:
    """Invocations per minute for one app: periodic for timers, diurnal Poisson otherwise (at least one)."""
    if timer and daily <= MINUTES_PER_DAY:
        period = max(1, round(MINUTES_PER_DAY / daily))
        counts = np.zeros(MINUTES_PER_DAY, dtype=np.int64)
        counts[int(rng.integers(period)) % MINUTES_PER_DAY::period] = 1
    else:
        phase = rng.random() * 2 * np.pi
        shape = 1.0 + DIURNAL_SWING * np.sin(2 * np.pi * minute / MINUTES_PER_DAY + phase)
        counts = rng.poisson(daily / MINUTES_PER_DAY * shape)
    if counts.sum() == 0:
        counts[int(rng.integers(MINUTES_PER_DAY))] = 1
    return counts


def synthetic_trace(config: SyntheticConfig, placement: str = "even") -> Trace:
    """A synthetic day through the same conversion the 2019 reader uses (`placement`: see `trace_from_2019`)."""
    suffix = "" if placement == "even" else f"-{placement}"
    return trace_from_2019(generate_day(config), name=f"synthetic-{config.apps}apps-seed{config.seed}{suffix}",
                           seed=config.seed, placement=placement)


def write_azure2019(day: Azure2019Day, directory: Path, day_label: str = "d01") -> Path:
    """Write the three 2019 CSV files into `directory`; returns the invocations file."""
    directory.mkdir(parents=True, exist_ok=True)
    inv = directory / f"invocations_per_function_md.anon.{day_label}.csv"
    with inv.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["HashOwner", "HashApp", "HashFunction", "Trigger", *range(1, MINUTES_PER_DAY + 1)])
        for i in range(len(day.apps)):
            w.writerow([day.owners[i], day.apps[i], day.functions[i], day.triggers[i], *day.counts[i].tolist()])
    pct = ("0", "1", "25", "50", "75", "99", "100")
    with (directory / f"function_durations_percentiles.anon.{day_label}.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["HashOwner", "HashApp", "HashFunction", "Average", "Count", "Minimum", "Maximum",
                    *[f"percentile_Average_{p}" for p in pct]])
        for i in range(len(day.apps)):
            avg = float(day.avg_duration_ms[i])
            spread = [avg * s for s in (0.2, 0.3, 0.7, 0.9, 1.2, 3.0, 4.0)]
            w.writerow([day.owners[i], day.apps[i], day.functions[i], f"{avg:.3f}", int(day.counts[i].sum()),
                        f"{spread[0]:.3f}", f"{spread[-1]:.3f}", *[f"{s:.3f}" for s in spread]])
    mem_pct = ("1", "5", "25", "50", "75", "95", "99", "100")
    with (directory / f"app_memory_percentiles.anon.{day_label}.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["HashOwner", "HashApp", "SampleCount", "AverageAllocatedMb",
                    *[f"AverageAllocatedMb_pct{p}" for p in mem_pct]])
        owner_of = dict(zip(day.apps, day.owners, strict=True))
        for app, mb in day.app_memory_mb.items():
            spread = [mb / AVERAGE_OF_MAX * s for s in _MEMORY_PCT_OF_MAX]
            w.writerow([owner_of[app], app, 100, f"{mb:.1f}", *[f"{s:.1f}" for s in spread]])
    return inv
