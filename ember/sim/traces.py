"""Trace readers: Azure Functions 2019 (per minute), 2021 (per invocation) and Azure LLM 2023.

Every reader returns a `Trace`: per application, its arrivals as *groups* of evenly
spaced arrivals (a group is one arrival for per-invocation traces, and one minute's
arrivals for the per-minute 2019 format), so a day of a busy application costs the
simulator one item per minute rather than one per invocation.

The 2019 format only counts invocations per minute; within a minute the k arrivals are
placed (seeded, the same for every policy) either evenly, 60/k seconds apart at a random
phase (`placement="even"`: one group per busy minute, cheap to simulate), or at k uniform
random times within the minute (`placement="poisson"`: a Poisson process given the count,
one group per arrival), which is what sub-minute keep-alive decisions should be judged on.
"""

from __future__ import annotations

import csv
import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ember.errors import InvalidInput

FORMATS = ("azure2019", "azure2021", "azurellm")
PLACEMENTS = ("even", "poisson")
MINUTES_PER_DAY = 1440
# Bounds on what a trace may ask of the simulator, refused with a clear error rather than met with an exhausted
# memory or an overflow: its span (a year of sparse arrivals takes ~0.5 GB and half a minute with the pooled
# prior), one function's invocations in a 2019 minute (~170,000 a second), a 2019 day's invocations placed one by
# one (`placement="poisson"`: ~180 bytes each at the peak of a fixed policy's run, so ~12 GB here), a mean
# execution time (a day) and an application's memory (a TB).
MAX_SPAN_S = 366 * 86400.0
MAX_PER_MINUTE = 10_000_000
MAX_PLACED = 1 << 26
MAX_DURATION_MS = 86400e3
MAX_MEMORY_MB = 1e6
# The times an LLM trace's TIMESTAMP may hold: numpy's nanosecond times wrap silently beyond 1677-2262, and the
# differences between two of them beyond 292 years.
_EARLIEST, _LATEST = np.datetime64("1900-01-01", "s"), np.datetime64("2150-01-01", "s")
_INVOCATIONS_2019 = re.compile(r"invocations_per_function_md\.anon\.(d\d+)\.csv$")


@dataclass
class AppTrace:
    """One application's arrivals: group g has `counts[g]` arrivals from `starts[g]`, `spacing[g]` apart."""

    name: str
    starts: np.ndarray
    counts: np.ndarray
    spacing: np.ndarray
    durations: np.ndarray   # mean execution seconds per group
    memory_mb: float = 0.0
    runtime: str = "default"

    @property
    def invocations(self) -> int:
        return int(self.counts.sum())


@dataclass
class Trace:
    name: str
    format: str
    horizon_s: float
    apps: list[AppTrace] = field(default_factory=list)

    @property
    def invocations(self) -> int:
        return sum(a.invocations for a in self.apps)


def read_trace(path: str | Path, fmt: str, *, seed: int = 0, placement: str = "even") -> Trace:
    """Read `path` (a file or a directory) in format `fmt`; InvalidInput names the file and field.

    `placement` places a 2019 minute's arrivals (see the module docstring); other formats have times."""
    if fmt not in FORMATS:
        raise InvalidInput(f"--format: unknown trace format {fmt!r} (known: {', '.join(FORMATS)})")
    p = Path(path)
    if not p.exists():
        raise InvalidInput(f"trace {p}: no such file or directory")
    if fmt == "azure2019":
        return read_azure2019(p, seed=seed, placement=placement)
    if fmt == "azure2021":
        return read_azure2021(p)
    return read_azurellm(p)


def _rows(path: Path, need: tuple[str, ...], fmt: str) -> Iterator[tuple[int, dict[str, str]]]:
    """(line, row) of a CSV file with the columns `need`; a row short of one of them is refused, naming it."""
    try:
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            missing = [c for c in need if c not in (reader.fieldnames or ())]
            if missing:
                raise InvalidInput(f"trace {path}: not in the {fmt} format: missing column(s) {', '.join(missing)}")
            for row in reader:
                short = [c for c in need if row[c] is None]
                if short:
                    raise InvalidInput(f"trace {path}: line {reader.line_num}: {short[0]}: missing")
                yield reader.line_num, row
    except csv.Error as err:
        raise InvalidInput(f"trace {path}: not a CSV file: {err}") from None
    except OSError as err:
        raise InvalidInput(f"trace {path}: cannot read: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise InvalidInput(f"trace {path}: not a text CSV file") from None


def _float(path: Path, line: int, column: str, value: str | None) -> float:
    try:
        out = float(value or "")
    except ValueError:
        raise InvalidInput(f"trace {path}: line {line}: {column}: not a number: {value!r}") from None
    if not np.isfinite(out):
        raise InvalidInput(f"trace {path}: line {line}: {column}: not finite: {value!r}")
    return out


def _at_least_0(path: Path, line: int, column: str, value: str | None, most: float = np.inf) -> float:
    out = _float(path, line, column, value)
    if out < 0:
        raise InvalidInput(f"trace {path}: line {line}: {column}: negative: {out}")
    if out > most:
        raise InvalidInput(f"trace {path}: line {line}: {column}: more than {most:g}: {out}")
    return out


def _single_arrivals(name: str, arrivals: np.ndarray, durations: np.ndarray, memory_mb: float = 0.0) -> AppTrace:
    order = np.argsort(arrivals, kind="stable")
    n = len(arrivals)
    return AppTrace(name, arrivals[order], np.ones(n, dtype=np.int64), np.zeros(n), durations[order], memory_mb)


# --- Azure Functions 2021: one row per invocation -------------------------------------------------------------

def read_azure2021(path: Path) -> Trace:
    """`app,func,end_timestamp,duration` (seconds); arrival = end - duration, grouped by app."""
    if path.is_dir():
        files = sorted(path.glob("*.csv"))
        if not files:
            raise InvalidInput(f"trace {path}: no .csv file in this directory")
        path = files[0]
    by_app: dict[str, tuple[list[float], list[float]]] = {}
    for i, row in _rows(path, ("app", "func", "end_timestamp", "duration"), "azure2021"):
        end = _float(path, i, "end_timestamp", row["end_timestamp"])
        dur = _at_least_0(path, i, "duration", row["duration"], MAX_SPAN_S)
        if not abs(end) < 1e300:       # (end - dur stays finite, and so do the times from the earliest)
            raise InvalidInput(f"trace {path}: line {i}: end_timestamp: out of range: {end}")
        arrivals, durations = by_app.setdefault(row["app"], ([], []))
        arrivals.append(end - dur)
        durations.append(dur)
    if not by_app:
        raise InvalidInput(f"trace {path}: no invocations")
    apps = [_single_arrivals(name[:12], np.array(a), np.array(d)) for name, (a, d) in by_app.items()]
    origin = min(float(a.starts.min()) for a in apps)
    horizon = 0.0
    for a in apps:
        a.starts = a.starts - origin
        horizon = max(horizon, float((a.starts + a.durations).max()))
    return Trace(path.name, "azure2021", _span(path, horizon), apps)


# --- Azure LLM inference 2023: one row per request, one file per service ------------------------------------

def read_azurellm(path: Path) -> Trace:
    """`TIMESTAMP,ContextTokens,GeneratedTokens`; each file is one application (the service).

    The trace has no execution times, so idle time counts from each arrival (duration 0).
    """
    files = sorted(path.glob("*.csv")) if path.is_dir() else [path]
    if not files:
        raise InvalidInput(f"trace {path}: no .csv file in this directory")
    stamps: dict[str, np.ndarray] = {}
    for f in files:
        rows = [(i, row["TIMESTAMP"]) for i, row in _rows(f, ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
                                                           "azurellm")]
        if not rows:
            raise InvalidInput(f"trace {f}: no requests")
        stamps[f.stem] = _times(f, rows)
    origin = min(s.min() for s in stamps.values())
    apps = []
    for name, s in stamps.items():
        seconds = (s - origin).astype(np.float64) / 1e9
        apps.append(_single_arrivals(name.replace("AzureLLMInferenceTrace_", ""), seconds, np.zeros(len(s))))
    horizon = max(float(a.starts.max()) for a in apps)
    return Trace(path.name, "azurellm", _span(path, horizon), apps)


def _times(path: Path, rows: list[tuple[int, str]]) -> np.ndarray:
    """The (line, TIMESTAMP) rows' times as datetime64[ns]; the first that is not a time from 1900 to 2150 (NaT,
    empty, "now", out of that range) is refused with its line."""
    raw = [stamp for _, stamp in rows]
    try:
        # Checked at a second's resolution, whose range is wide: nanoseconds wrap silently past 2262.
        seconds = np.array(raw, dtype="datetime64[s]")
        bad = np.flatnonzero(np.isnat(seconds) | (seconds < _EARLIEST) | (seconds > _LATEST))
    except (ValueError, OverflowError):
        bad = np.array([i for i, r in enumerate(raw) if not _is_time(r)] or [0])
    if not len(bad):
        bad = np.array([i for i, r in enumerate(raw) if r.strip().lower() in ("now", "today")], dtype=np.int64)
    if len(bad):
        line, stamp = rows[int(bad[0])]
        raise InvalidInput(f"trace {path}: line {line}: TIMESTAMP: not a time from 1900 to 2150: {stamp!r}")
    return np.array(raw, dtype="datetime64[ns]")


def _is_time(text: str) -> bool:
    try:
        t = np.datetime64(text, "s")
    except (ValueError, OverflowError):
        return False
    return bool(not np.isnat(t) and _EARLIEST <= t <= _LATEST)


def _span(path: Path, horizon_s: float) -> float:
    """`horizon_s`, a trace's span, if the simulator takes it (`MAX_SPAN_S`)."""
    if not horizon_s <= MAX_SPAN_S:
        raise InvalidInput(f"trace {path}: spans {horizon_s / 86400:.4g} days; the simulator takes at most "
                           f"{MAX_SPAN_S / 86400:.0f}")
    return horizon_s


# --- Azure Functions 2019: invocations per minute, per function ---------------------------------------------

@dataclass
class Azure2019Day:
    """One day of the 2019 trace as arrays (what the CSV files hold), functions as rows."""

    owners: list[str]
    apps: list[str]
    functions: list[str]
    triggers: list[str]
    counts: np.ndarray                 # (functions, 1440) invocations per minute
    avg_duration_ms: np.ndarray        # (functions,) mean execution time, NaN if unknown
    app_memory_mb: dict[str, float] = field(default_factory=dict)   # average allocated MB per app


def _find_2019(path: Path) -> tuple[Path, Path | None, Path | None]:
    if path.is_dir():
        found = sorted(p for p in path.iterdir() if _INVOCATIONS_2019.search(p.name))
        if not found:
            raise InvalidInput(f"trace {path}: no invocations_per_function_md.anon.dNN.csv in this directory")
        path = found[0]
    m = _INVOCATIONS_2019.search(path.name)
    day = m.group(1) if m else None
    durations = path.parent / f"function_durations_percentiles.anon.{day}.csv" if day else None
    memory = path.parent / f"app_memory_percentiles.anon.{day}.csv" if day else None
    return path, durations if durations and durations.exists() else None, memory if memory and memory.exists() else None


def load_azure2019_day(path: Path) -> Azure2019Day:
    """Parse the invocation counts (and, beside them, durations and memory when present)."""
    inv, dur_path, mem_path = _find_2019(path)
    owners, apps, funcs, triggers, rows = [], [], [], [], []
    header = [str(m) for m in range(1, MINUTES_PER_DAY + 1)]
    try:
        with inv.open() as f:
            first = f.readline().rstrip("\r\n").split(",")
            if first[:4] != ["HashOwner", "HashApp", "HashFunction", "Trigger"] or first[4:] != header:
                raise InvalidInput(f"trace {inv}: not an azure2019 invocations file: the header must be "
                                   "HashOwner,HashApp,HashFunction,Trigger,1,...,1440")
            for i, line in enumerate(f, start=2):
                parts = line.rstrip("\r\n").split(",", 4)
                if len(parts) < 5:
                    raise InvalidInput(f"trace {inv}: line {i}: expected 1444 columns, found {len(parts)}")
                cells = parts[4].split(",") if parts[4] else []
                try:
                    counts = np.array(cells, dtype=np.float64)
                except ValueError:
                    counts = np.full(len(cells), np.nan)
                if (counts.shape != (MINUTES_PER_DAY,) or not ((counts >= 0) & (counts <= MAX_PER_MINUTE)).all()
                        or (counts != np.round(counts)).any()):
                    raise InvalidInput(f"trace {inv}: line {i}: expected 1440 whole counts from 0 to "
                                       f"{MAX_PER_MINUTE:,} after Trigger; {_bad_count(cells)}")
                owners.append(parts[0])
                apps.append(parts[1])
                funcs.append(parts[2])
                triggers.append(parts[3])
                rows.append(counts)
    except OSError as err:
        raise InvalidInput(f"trace {inv}: cannot read: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise InvalidInput(f"trace {inv}: not a text CSV file") from None
    except ValueError:
        raise InvalidInput(f"trace {inv}: a minute count is not a number") from None
    if not rows:
        raise InvalidInput(f"trace {inv}: no functions")
    day = Azure2019Day(owners, apps, funcs, triggers, np.vstack(rows).astype(np.int64), np.full(len(rows), np.nan))
    if dur_path is not None:
        _read_2019_durations(dur_path, day)
    if mem_path is not None:
        for i, row in _rows(mem_path, ("HashApp", "AverageAllocatedMb"), "azure2019 memory"):
            mb = _at_least_0(mem_path, i, "AverageAllocatedMb", row["AverageAllocatedMb"], MAX_MEMORY_MB)
            day.app_memory_mb[row["HashApp"]] = mb
    return day


def _bad_count(cells: list[str]) -> str:
    """Where a row's minute counts go wrong: the first cell that is no whole count in range (its column, 1-based,
    and the minute its header names), or how many columns the row has."""
    for j, cell in enumerate(cells[:MINUTES_PER_DAY]):
        try:
            v = float(cell)
        except ValueError:
            v = float("nan")
        if not (0 <= v <= MAX_PER_MINUTE and v == round(v)):
            return f"column {j + 5} (minute {j + 1}): {cell[:40]!r}"
    return f"{len(cells) + 4} columns, not 1444"


def _read_2019_durations(path: Path, day: Azure2019Day) -> None:
    index = {(a, f): i for i, (a, f) in enumerate(zip(day.apps, day.functions, strict=True))}
    for i, row in _rows(path, ("HashApp", "HashFunction", "Average"), "azure2019 durations"):
        j = index.get((row["HashApp"], row["HashFunction"]))
        if j is not None:
            day.avg_duration_ms[j] = _at_least_0(path, i, "Average", row["Average"], MAX_DURATION_MS)


def read_azure2019(path: Path, *, seed: int = 0, placement: str = "even") -> Trace:
    day = load_azure2019_day(path)
    return trace_from_2019(day, name=path.name, seed=seed, placement=placement)


def trace_from_2019(day: Azure2019Day, *, name: str = "azure2019", seed: int = 0, placement: str = "even") -> Trace:
    """Merge functions into applications and turn minute counts into arrivals: evenly spaced groups
    (`placement="even"`) or single arrivals at uniform random times within their minute ("poisson")."""
    if placement not in PLACEMENTS:
        raise InvalidInput(f"--placement: unknown placement {placement!r} (known: {', '.join(PLACEMENTS)})")
    placed = int(day.counts.sum())
    if placement == "poisson" and placed > MAX_PLACED:
        raise InvalidInput(f"--placement poisson: the day has {placed:,} invocations, at most {MAX_PLACED:,} are "
                           "placed one by one (use --placement even)")
    rng = np.random.default_rng(seed)
    order: dict[str, list[int]] = {}
    for i, app in enumerate(day.apps):
        order.setdefault(app, []).append(i)
    apps = []
    for app, rows in order.items():
        counts = day.counts[rows].sum(axis=0)
        minutes = np.flatnonzero(counts)
        if len(minutes) == 0:
            continue
        k = counts[minutes]
        calls = day.counts[rows].sum(axis=1)
        known = ~np.isnan(day.avg_duration_ms[rows])
        dur = day.avg_duration_ms[rows][known]
        dur_ms = float(np.average(dur, weights=calls[known] + 1e-9)) if known.any() else 0.0
        if placement == "poisson":
            apps.append(_single_arrivals(_short(app), poisson_minutes(rng, minutes, k),
                                         np.full(int(k.sum()), dur_ms / 1e3), day.app_memory_mb.get(app, 0.0)))
            continue
        spacing = 60.0 / k
        phase = rng.random(len(minutes))
        starts = minutes * 60.0 + phase * spacing
        apps.append(AppTrace(_short(app), starts, k.astype(np.int64), spacing, np.full(len(minutes), dur_ms / 1e3),
                             day.app_memory_mb.get(app, 0.0)))
    return Trace(name, "azure2019", MINUTES_PER_DAY * 60.0, apps)


def poisson_minutes(rng: np.random.Generator, minutes: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Sorted arrival times: counts[i] uniform random times within minute minutes[i] (Poisson given the count)."""
    at = np.repeat(minutes.astype(np.float64), counts)
    return np.sort((at + rng.random(len(at))) * 60.0)


def _short(name: str) -> str:
    return name[:12] if len(name) > 12 else name


def stable_hash(text: str) -> str:
    """A 64-hex-digit anonymised name, like the trace's hashes."""
    return hashlib.sha256(text.encode()).hexdigest()


def sniff_format(path: str | Path) -> str:
    """Guess a trace's format from its header (a directory: from the first CSV file with a known header)."""
    p = Path(path)
    if not p.exists():
        raise InvalidInput(f"trace {p}: no such file or directory")
    files = sorted(p.glob("*.csv")) if p.is_dir() else [p]
    if not files:
        raise InvalidInput(f"trace {p}: no .csv file in this directory")
    for f in files:
        try:
            with f.open() as stream:
                header = stream.readline()
        except (OSError, UnicodeDecodeError) as err:
            raise InvalidInput(f"trace {f}: cannot read: {err}") from None
        for prefix, fmt in (("HashOwner,HashApp,HashFunction,Trigger,1,", "azure2019"),
                            ("app,func,end_timestamp", "azure2021"), ("TIMESTAMP", "azurellm")):
            if header.startswith(prefix):
                return fmt
    where = files[0] if len(files) == 1 else p
    raise InvalidInput(f"trace {where}: unknown trace format (give --format: {', '.join(FORMATS)})")
