"""`ember sim` as a user runs it: a subprocess on a small case, its table, JSON and PNG, and its errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LLM = ROOT.parent / "shared" / "traces" / "azure-llm-2023"


def ember(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, "-m", "ember", "sim", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)


def test_synthetic_run_writes_table_json_and_png(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = ember("--synthetic-apps", "40", "--seed", "2", "--out", str(out), "--knob", "fixed.keep_alive_s=300")
    assert done.returncode == 0, done.stderr
    assert "policy" in done.stdout and "idle GB*h" in done.stdout
    for name in ("fixed*", "hybrid*", "ladder*"):
        assert name in done.stdout
    assert "ladder vs hybrid" in done.stdout
    report = json.loads((out / "sim.json").read_text())
    assert report["trace"]["apps"] == 40
    fixed = report["policies"]["fixed"]
    assert fixed["default"]["knob_value"] == 300.0
    assert set(fixed["default"]["starts_by_rung"]) == {"hot", "paused", "template", "zygote", "fetch"}
    assert sum(fixed["default"]["starts_by_rung"].values()) == report["trace"]["invocations"]
    assert len(report["policies"]["ladder"]["sweep"]) >= 5
    assert report["policies"]["hybrid"]["frontier_cold_start_rate"]
    assert (out / "frontiers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(not LLM.exists(), reason="../shared/traces is not beside the repository")
def test_real_llm_trace(tmp_path: Path) -> None:
    done = ember("--trace", str(LLM), "--out", str(tmp_path), "--no-sweep")
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "sim.json").read_text())
    assert report["trace"]["format"] == "azurellm" and report["trace"]["apps"] == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--trace", "no/such/trace.csv"), "trace no/such/trace.csv: no such file"),
        (("--knob", "fixed.keep_alive_s=-5"), "keep_alive_s"),
        (("--knob", "fixed.keep_alive_s=soon"), "keep_alive_s: not a number"),
        (("--knob", "ladder.warp=2"), "warp"),
        (("--policies", "fixed,lru"), "lru"),
        (("--synthetic-apps", "0"), "apps"),
        (("--runtimes", "0"), "--runtimes"),
    ],
)
def test_bad_input_is_a_clear_error(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    done = ember("--synthetic-apps", "5", *args, "--out", str(tmp_path), "--no-sweep")   # later flags win
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("ember: ") and message in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.skipif(not LLM.exists(), reason="../shared/traces is not beside the repository")
def test_wrong_format_names_file_and_field(tmp_path: Path) -> None:
    done = ember("--trace", str(LLM / "AzureLLMInferenceTrace_code.csv"), "--format", "azure2021",
                 "--out", str(tmp_path), "--no-sweep")
    assert done.returncode == 2
    assert "AzureLLMInferenceTrace_code.csv" in done.stderr and "end_timestamp" in done.stderr


def test_bad_rung_costs_file(tmp_path: Path) -> None:
    costs = tmp_path / "costs.json"
    costs.write_text('{"rungs": {"hot": {"start_ms": -1}}}')
    done = ember("--rung-costs", str(costs), "--synthetic-apps", "5", "--out", str(tmp_path), "--no-sweep")
    assert done.returncode == 2 and "hot.start_ms" in done.stderr
