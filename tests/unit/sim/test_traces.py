"""Trace readers on the real files in ../shared/traces and on bad input."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from ember.errors import InvalidInput
from ember.sim.traces import read_trace, sniff_format

TRACES = Path(__file__).resolve().parents[3].parent / "shared" / "traces"
LLM = TRACES / "azure-llm-2023"
A2021 = TRACES / "azure-functions-2021-sample" / "Azure2021_200.csv"
needs_traces = pytest.mark.skipif(not LLM.exists(), reason="../shared/traces is not beside the repository")


def rows(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


@needs_traces
def test_azure2021_sample() -> None:
    data = rows(A2021)
    trace = read_trace(A2021, "azure2021")
    assert trace.invocations == len(data)
    assert len(trace.apps) == len({r["app"] for r in data})
    for app in trace.apps:
        assert (np.diff(app.starts) >= 0).all()
    first = min(float(r["end_timestamp"]) - float(r["duration"]) for r in data)
    assert min(a.starts.min() for a in trace.apps) == pytest.approx(0.0)
    last_end = max(float(r["end_timestamp"]) for r in data)
    assert trace.horizon_s == pytest.approx(last_end - first)


@needs_traces
def test_azure_llm_directory() -> None:
    trace = read_trace(LLM, "azurellm")
    counts = {a.name: a.invocations for a in trace.apps}
    assert counts == {"code": len(rows(LLM / "AzureLLMInferenceTrace_code.csv")),
                      "conv": len(rows(LLM / "AzureLLMInferenceTrace_conv.csv"))}
    assert 3000 < trace.horizon_s < 4000        # about an hour
    conv = next(a for a in trace.apps if a.name == "conv")
    assert (np.diff(conv.starts) >= 0).all()


@needs_traces
def test_sniffing() -> None:
    assert sniff_format(LLM) == "azurellm"
    assert sniff_format(A2021) == "azure2021"


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="nope.csv: no such file"):
        read_trace(tmp_path / "nope.csv", "azure2021")


def test_unknown_format() -> None:
    with pytest.raises(InvalidInput, match="--format"):
        read_trace(".", "azure2030")


@needs_traces
def test_wrong_format_names_the_missing_columns() -> None:
    with pytest.raises(InvalidInput, match=r"_code.csv: not in the azure2021 format.*end_timestamp"):
        read_trace(LLM / "AzureLLMInferenceTrace_code.csv", "azure2021")
    with pytest.raises(InvalidInput, match="not an azure2019 invocations file"):
        read_trace(A2021, "azure2019")
    with pytest.raises(InvalidInput, match="no invocations_per_function_md"):
        read_trace(A2021.parent, "azure2019")


def test_bad_values_name_line_and_column(tmp_path: Path) -> None:
    bad = tmp_path / "t.csv"
    bad.write_text("app,func,end_timestamp,duration\na,f,10.0,1.0\na,f,12.0,abc\n")
    with pytest.raises(InvalidInput, match="line 3: duration: not a number"):
        read_trace(bad, "azure2021")
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2\n")
    with pytest.raises(InvalidInput, match="line 2: TIMESTAMP: not a time from 1900 to 2150: 'yesterday'"):
        read_trace(bad, "azurellm")
    day = tmp_path / "invocations_per_function_md.anon.d01.csv"
    day.write_text("HashOwner,HashApp,HashFunction,Trigger," + ",".join(str(m) for m in range(1, 1441)) + "\n"
                   "o,a,f,http," + ",".join(["1"] * 1439) + "\n")
    with pytest.raises(InvalidInput, match="line 2: expected 1440 whole counts.*; 1443 columns, not 1444"):
        read_trace(tmp_path, "azure2019")
    header = "HashOwner,HashApp,HashFunction,Trigger," + ",".join(str(m) for m in range(1, 1441)) + "\n"
    for cell, shown in (("x", "'x'"), ("-1", "'-1'"), ("1.5", "'1.5'")):
        row = ["0"] * 1440
        row[6] = cell
        day.write_text(header + "o,a,f,http," + ",".join(["0"] * 1440) + "\n" + "o,a,g,http," + ",".join(row) + "\n")
        with pytest.raises(InvalidInput, match=f"d01.csv: line 3: expected .*; column 11 \\(minute 7\\): {shown}"):
            read_trace(tmp_path, "azure2019")
    junk = tmp_path / "junk" / "x.csv"
    junk.parent.mkdir()
    junk.write_text("a,b\n1,2\n")
    with pytest.raises(InvalidInput, match="x.csv: unknown trace format"):
        sniff_format(junk.parent)
    day_dir = tmp_path / "day"
    day_dir.mkdir()
    (day_dir / "app_memory_percentiles.anon.d01.csv").write_text("HashOwner,HashApp,SampleCount,AverageAllocatedMb\n")
    (day_dir / "invocations_per_function_md.anon.d01.csv").write_text(day.read_text())
    assert sniff_format(day_dir) == "azure2019"            # the invocations file, though another sorts first
