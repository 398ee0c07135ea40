"""A fuzzer over the trace files `ember sim` reads: CSV rows of each format with cells drawn from valid values and
from what breaks readers (NaT, empty, non-numbers, NaN, infinities, huge and negative values, rows too short or too
long, spans of centuries). Whatever the file holds, the reader either refuses it with `InvalidInput` naming the
file (and, for a bad row, its line), or returns a trace the simulator can run: every arrival finite, in order and
within the span, every duration finite and >= 0, and the span at most `MAX_SPAN_S`. A trace it accepts is then
simulated (a fixed keep-alive, and the ladder as the held-out evaluation runs it, with the pooled prior), which
must not raise."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ember.core.rung_costs import RungCosts
from ember.errors import InvalidInput
from ember.keepalive.policies import FixedKeepAlive, LadderPolicy
from ember.sim.runner import run_one
from ember.sim.traces import MAX_SPAN_S, MINUTES_PER_DAY, Azure2019Day, Trace, read_trace, trace_from_2019

FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# What breaks readers, for a cell of any column.
_nasty = (st.sampled_from(["-1", "-0.0", "1e300", "-1e300", "1e12", "nan", "inf", "-inf", "", "abc", " 3 ", "1,5",
                           "0x10", "1e-320", "2.5", "1e8", "NaT", "nat", "yesterday", "99999-01-01", "2023-13-01",
                           "2023-11-16 25:00:00", "1677-09-22", "2262-04-11", "1970-01-01", "é", '"q"'])
          | st.floats(allow_nan=True, allow_infinity=True).map(repr) | st.integers(-10**20, 10**20).map(str))
_names = st.sampled_from(["a", "b", "c", "app-with-a-long-name-" * 3])
_seconds = st.floats(0.0, 4000.0).map(lambda x: f"{x:.3f}")


@st.composite
def _mutated(draw: st.DrawFn, rows: st.SearchStrategy[list[list[str]]]) -> list[list[str]]:
    """Valid rows, and in some examples up to three mutations: a cell replaced by a nasty value, a row cut short
    or lengthened (a reader must name what is wrong, not fail on it)."""
    out = [list(r) for r in draw(rows)]
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2, 3])) if out else 0):
        row = out[draw(st.integers(0, len(out) - 1))]
        how = draw(st.sampled_from(["cell", "cell", "cell", "cut", "extend"])) if row else "extend"
        if how == "cell":
            row[draw(st.integers(0, len(row) - 1))] = draw(_nasty)
        elif how == "cut":
            del row[draw(st.integers(0, len(row) - 1)):]
        else:
            row.append("extra")
    return out


def _csv(header: list[str], rows: list[list[str]]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return out.getvalue()


_2021_row = st.tuples(_names, _names, _seconds, st.floats(0.0, 30.0).map(lambda x: f"{x:.3f}")).map(list)
_azure2021 = _mutated(st.lists(_2021_row, max_size=12)).map(
    lambda rows: _csv(["app", "func", "end_timestamp", "duration"], rows))
_origin = np.datetime64("2023-11-16T18:15:46", "ns")
_llm_row = st.tuples(st.floats(0.0, 4000.0).map(lambda x: str(_origin + np.timedelta64(int(x * 1e9), "ns"))),
                     st.integers(1, 4000).map(str), st.integers(1, 500).map(str)).map(list)
_azurellm = _mutated(st.lists(_llm_row, max_size=12)).map(
    lambda rows: _csv(["TIMESTAMP", "ContextTokens", "GeneratedTokens"], rows))


@st.composite
def _2019_rows(draw: st.DrawFn) -> list[list[str]]:
    """Per function, 1,440 minute counts, a few of them drawn (the rest 0)."""
    rows = []
    for _ in range(draw(st.integers(0, 4))):
        counts = ["0"] * MINUTES_PER_DAY
        for _ in range(draw(st.integers(0, 6))):
            counts[draw(st.integers(0, MINUTES_PER_DAY - 1))] = str(draw(st.integers(0, 50)))
        rows.append([draw(_names), draw(_names), draw(_names), "http", *counts])
    return rows


_azure2019 = _mutated(_2019_rows()).map(lambda rows: _csv(
    ["HashOwner", "HashApp", "HashFunction", "Trigger", *map(str, range(1, MINUTES_PER_DAY + 1))], rows))


def _check(trace: Trace) -> None:
    """What the simulator relies on in a trace it is given."""
    assert np.isfinite(trace.horizon_s) and 0.0 <= trace.horizon_s <= MAX_SPAN_S
    for app in trace.apps:
        assert len(app.starts) == len(app.counts) == len(app.durations) > 0
        assert np.isfinite(app.starts).all() and np.isfinite(app.durations).all()
        assert (app.starts >= 0).all() and (np.diff(app.starts) >= 0).all() and (app.durations >= 0).all()
        assert (app.counts >= 1).all() and np.isfinite(app.spacing).all()
        assert app.starts.max() <= trace.horizon_s
    costs = RungCosts()
    for policy in (FixedKeepAlive(keep_alive_s=60.0), LadderPolicy(pooled_weight=1.0, smooth_events=1.0)):
        result = run_one(trace, policy, costs)
        assert result.invocations == trace.invocations


def _read(tmp_path: Path, name: str, text: str, fmt: str, placement: str = "poisson") -> None:
    path = tmp_path / name
    path.write_text(text)
    try:
        trace = read_trace(path, fmt, placement=placement)
    except InvalidInput as err:
        assert str(err).startswith(f"trace {path}: "), err
        event("refused")
        return
    event("read")
    _check(trace)


@FUZZ
@given(text=_azure2021)
def test_azure2021_files_are_read_or_refused_clearly(tmp_path: Path, text: str) -> None:
    _read(tmp_path, "t.csv", text, "azure2021")


@FUZZ
@given(text=_azurellm)
def test_azurellm_files_are_read_or_refused_clearly(tmp_path: Path, text: str) -> None:
    _read(tmp_path, "AzureLLMInferenceTrace_code.csv", text, "azurellm")


@settings(FUZZ, max_examples=25)
@given(text=_azure2019, placement=st.sampled_from(["even", "poisson"]))
def test_azure2019_days_are_read_or_refused_clearly(tmp_path: Path, text: str, placement: str) -> None:
    _read(tmp_path, "invocations_per_function_md.anon.d01.csv", text, "azure2019", placement)


def _refused(path: Path, text: str, fmt: str, message: str) -> None:
    path.write_text(text)
    try:
        read_trace(path.parent if fmt == "azure2019" else path, fmt)
    except InvalidInput as err:
        assert message in str(err), err
    else:
        raise AssertionError(f"{text[:80]!r} was read")


def test_a_bad_row_is_refused_with_its_line_and_column(tmp_path: Path) -> None:
    llm = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,1,2\n"
    for bad, message in (("NaT,1,2", "line 3: TIMESTAMP: not a time from 1900 to 2150: 'NaT'"),
                         (",1,2", "line 3: TIMESTAMP: not a time from 1900 to 2150: ''"),
                         ("now,1,2", "line 3: TIMESTAMP: not a time from 1900 to 2150: 'now'"),
                         # numpy's nanosecond times wrap silently outside 1677-2262 (to 1677-09-21 here)
                         ("2262-04-12,1,2", "line 3: TIMESTAMP: not a time from 1900 to 2150: '2262-04-12'"),
                         ("2023-11-16 18:15:47", "line 3: ContextTokens: missing"),
                         ("2025-11-16 18:15:47,1,2", "spans 731 days; the simulator takes at most 366"),
                         ('"' + "x" * 200_000 + '",1,2', "not a CSV file: field larger than field limit")):
        _refused(tmp_path / "llm.csv", llm + bad + "\n", "azurellm", message)
    functions = "app,func,end_timestamp,duration\na,f,10,1\n"
    for bad, message in (("b,f,1e300,1", "line 3: end_timestamp: out of range: 1e+300"),
                         ("b,f,-1e308,1", "line 3: end_timestamp: out of range: -1e+308"),
                         ("b,f,1e308,1e308", "line 3: duration: more than 3.16224e+07: 1e+308"),
                         ("b,f,1e9,1", "spans 1.157e+04 days; the simulator takes at most 366")):
        _refused(tmp_path / "functions.csv", functions + bad + "\n", "azure2021", message)


def test_a_bad_2019_day_is_refused_naming_the_file_line_and_column(tmp_path: Path) -> None:
    header = "HashOwner,HashApp,HashFunction,Trigger," + ",".join(map(str, range(1, 1441)))
    day = tmp_path / "invocations_per_function_md.anon.d01.csv"
    for count in ("2.5", "1e8", "-1", "nan"):
        _refused(day, f"{header}\no,a,f,http,{count}" + ",0" * 1439 + "\n", "azure2019",
                 "line 2: expected 1440 whole counts from 0 to 10,000,000")
    day.write_text(f"{header}\no,a,f,http,3" + ",0" * 1439 + "\n")
    for name, text, message in (
            ("function_durations_percentiles.anon.d01.csv", "HashApp,HashFunction,Average\na,f,1e308\n",
             "line 2: Average: more than 8.64e+07: 1e+308"),
            ("function_durations_percentiles.anon.d01.csv", "HashApp,HashFunction,Average\na,f,-5\n",
             "line 2: Average: negative: -5.0"),
            ("app_memory_percentiles.anon.d01.csv", "HashApp,AverageAllocatedMb\na,1e7\n",
             "line 2: AverageAllocatedMb: more than 1e+06: 10000000.0")):
        _refused(tmp_path / name, text, "azure2019", message)
        (tmp_path / name).unlink()
    # A day whose invocations placed one by one would take more than the machine has (~180 bytes each at the
    # peak): refused before any is placed, and read as minute groups with --placement even.
    busy = np.full((1, MINUTES_PER_DAY), 50_000, dtype=np.int64)
    many = Azure2019Day(["o"], ["a"], ["f"], ["http"], busy, np.full(1, np.nan))
    try:
        trace_from_2019(many, placement="poisson")
    except InvalidInput as err:
        assert "--placement poisson: the day has 72,000,000 invocations, at most 67,108,864" in str(err)
    else:
        raise AssertionError("72 million invocations were placed one by one")
    assert trace_from_2019(many, placement="even").invocations == 72_000_000
