"""`ember sim` as a user runs it: a subprocess on a small case, its table, JSON and PNG, and its errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ember.keepalive.policies import LadderCold, LadderPolicy

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
        (("--knob", "ladder.costs=1"), "ladder: 'costs' is not a knob"),
        (("--knob", "ladder.cold_per_app=2"), "ladder: cold_per_app is 0 or 1, got 2.0"),
        (("--policies", "fixed,lru"), "lru"),
        (("--synthetic-apps", "0"), "apps"),
        (("--runtimes", "0"), "--runtimes"),
        (("--runtimes", "1000000000"), "--runtimes must lie in [1, 10,000], got 1000000000"),   # a MemoryError before
        (("--seed", "-1"), "--seed must lie in [0, 2**63), got -1"),                              # a ValueError before
        (("--synthetic-apps", "1000000"), "synthetic apps must lie in [1, 100000]"),
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


def _tiny_traces(tmp_path: Path) -> tuple[Path, Path]:
    """A bursty LLM-format service to tune on and a two-app 2021-format trace to hold out."""
    import numpy as np

    rng = np.random.default_rng(3)
    tune = tmp_path / "tune.csv"
    t = np.cumsum(np.where(rng.random(300) < 0.05, rng.exponential(90.0, 300), rng.exponential(0.5, 300)))
    stamps = np.datetime64("2023-11-16T18:00:00") + (t * 1e6).astype("timedelta64[us]")
    tune.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    + "".join(f"{str(s).replace('T', ' ')},100,10\n" for s in stamps))
    held = tmp_path / "held.csv"
    rows = [f"app{i % 2},f,{end:.3f},0.2\n" for i, end in enumerate(np.cumsum(rng.exponential(20.0, 120)))]
    held.write_text("app,func,end_timestamp,duration\n" + "".join(rows))
    return tune, held


def test_held_out_run_writes_verdicts_json_and_one_png_per_trace(tmp_path: Path) -> None:
    tune, held = _tiny_traces(tmp_path)
    out = tmp_path / "out"
    done = ember("--tune-on", str(tune), "--held-out", str(tune), "--held-out", str(held),
                 "--tune-grid", "smooth_weight=0,1", "--tune-grid", "head_splits=4,8", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "tuned on tune:" in done.stdout and "4 combinations" in done.stdout
    assert "ladder tuned on tune, on held: claim 'dominated by no baseline" in done.stdout
    report = json.loads((out / "heldout.json").read_text())
    assert list(report["traces"]) == ["held"]                  # never reported on its own tuning trace
    tuning = report["tuning"]["tune"]
    assert set(tuning["best"]) == {"smooth_weight", "head_splits"} and len(tuning["combinations"]) == 4
    entry = report["traces"]["held"]
    assert {"fixed", "fixed-zygote", "hybrid", "hybrid-zygote"} <= set(entry["baselines"])
    assert len(entry["baselines"]["fixed"]) == 13 and len(entry["ladders"]["tune"]) == len(LadderPolicy().sweep())
    assert len(entry["cold_ladders"]["tune"]) == len(LadderCold().sweep())   # the ATC pair's objective
    assert len(entry["baselines"]["hybrid-zygote"]) > 6           # its range sweep for each variant
    assert not {"ladder", "ladder-cold"} & set(entry["baselines"])
    v = entry["verdicts"]["tune"]
    assert set(v["dominated"]) >= {"atc", "latency", "atc_latency_objective"}
    assert v["judged_by"]["atc"] == "ladder-cold" and v["judged_by"]["latency"] == "ladder"
    assert v["matched"]["latency_mean_s"]["budgets"] > 0
    assert all(h["ladder"].startswith("ladder-cold[cold_value=") for h in v["dominated"]["atc"])
    for p in entry["ladders"]["tune"]:
        assert sum(p["starts_by_rung"].values()) == entry["trace"]["invocations"]
    assert (out / "held.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "tune.png").exists()
    assert len(v["own_objective"]) == len(entry["ladders"]["tune"])          # the ladder's own objective, per value
    again = ember("--report", str(out / "heldout.json"))          # judged again from the stored points
    assert again.returncode == 0, again.stderr
    assert "ladder tuned on tune, on held: ladder's own objective" in again.stdout
    assert again.stdout.splitlines()[-1] == done.stdout.splitlines()[-2]   # the claims, as the run printed them
    for mangle in (lambda r: r.pop("tuning"), lambda r: r["traces"]["held"].pop("trace"),
                   lambda r: r["traces"]["held"]["ladders"]["tune"][0].update(knob_value="high"),
                   lambda r: r["traces"]["held"]["baselines"]["fixed"][0].update(label=None)):
        broken = json.loads((out / "heldout.json").read_text())
        mangle(broken)
        (tmp_path / "broken.json").write_text(json.dumps(broken))
        bad = ember("--report", str(tmp_path / "broken.json"))
        assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
        assert bad.stderr.startswith(f"ember: --report {tmp_path / 'broken.json'}: not a held-out run's heldout.json")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--held-out", "synthetic"), "--held-out needs --tune-on"),
        (("--tune-on", "synthetic", "--tune-grid", "smooth_weight"), "--tune-grid 'smooth_weight'"),
        (("--tune-on", "synthetic", "--tune-grid", "warp=1,2"), "'warp' is not a ladder constant"),
        (("--tune-on", "synthetic", "--tune-grid", "smooth_weight=-1"), "smooth_weight"),
        (("--tune-on", "synthetic", "--tune-grid", "range_s=60,600", "--tune-grid", "bin_s=120"),
         "ladder: range_s must lie in [120, 172800], got 60.0"),
        (("--tune-on", "synthetic", *(f"--tune-grid={k}=1,2,3,4,5,6,7,8,9,10" for k in (
            "head_splits", "decide_splits", "smooth_weight", "smooth_events", "prior_weight"))),
         "tuning grid: 100,000 combinations, at most 10,000"),
        (("--tune-on", "synthetic"), "every held-out trace is a tuning trace"),
        (("--report", "no/such/heldout.json"), "--report no/such/heldout.json: cannot read"),
    ],
)
def test_held_out_bad_input_is_a_clear_error(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    done = ember("--synthetic-apps", "3", *args, "--out", str(tmp_path))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("ember: ") and message in done.stderr
    assert "Traceback" not in done.stderr


def test_verdict_writes_every_pair_rule_and_comparison(tmp_path: Path) -> None:
    from ember.sim.synthetic import SyntheticConfig, generate_day, write_azure2019

    day = tmp_path / "day"
    write_azure2019(generate_day(SyntheticConfig(apps=12, seed=1)), day)
    out = tmp_path / "verdict.json"
    done = ember("--trace", str(day), "--verdict", str(out), "--resamples", "10")
    assert done.returncode == 0, done.stderr
    assert "max_eps" in done.stdout and "geo_saving" in done.stdout
    doc = json.loads(out.read_text())
    assert doc["trace"]["apps"] == 12
    for rule in ("charged", "excluded"):
        for pair in ("atc", "latency", "p99"):
            rows = doc["verdict"][rule][pair]
            assert {"pooled", "fixed", "fixed-zygote", "hybrid", "hybrid-zygote", "rainbowcake", "faascache"} \
                == set(rows)
            assert {"max_eps", "geo_saving", "ci_low", "ci_high"} <= set(rows["pooled"])
    assert doc["verdict"]["charged"]["atc"]["pooled"]["ladder"] == "ladder-cold"
    assert len(doc["points"]["hybrid"]) == 30 and len(doc["points"]["ladder"]) == 2 * len(LadderPolicy().sweep()) - 1


def test_verdict_names_file_line_and_column_of_a_bad_trace(tmp_path: Path) -> None:
    day = tmp_path / "day"
    day.mkdir()
    row = ["0"] * 1440
    row[2] = "1e"
    (day / "invocations_per_function_md.anon.d01.csv").write_text(
        "HashOwner,HashApp,HashFunction,Trigger," + ",".join(str(m) for m in range(1, 1441)) + "\n"
        "o,a,f,http," + ",".join(row) + "\n")
    done = ember("--trace", str(day), "--verdict", str(tmp_path / "v.json"))
    assert done.returncode == 2
    assert "invocations_per_function_md.anon.d01.csv: line 2: expected 1440 whole counts" in done.stderr
    assert "column 7 (minute 3): '1e'" in done.stderr


def test_write_preset_and_run_it(tmp_path: Path) -> None:
    preset = tmp_path / "preset.json"
    done = ember("--write-preset", str(preset))
    assert done.returncode == 0, done.stderr
    doc = json.loads(preset.read_text())
    assert doc["name"] == "azure-2019-dev" and doc["constants"]["climb_lead"] == 1.0
    doc["constants"]["head_splits"] = 4
    preset.write_text(json.dumps(doc))
    out = tmp_path / "out"
    done = ember("--synthetic-apps", "10", "--keepalive-preset", str(preset), "--no-sweep", "--policies", "ladder",
                 "--out", str(out))
    assert done.returncode == 0, done.stderr
    preset.write_text('{"constants": {"latency_value": 1}}')
    done = ember("--synthetic-apps", "10", "--keepalive-preset", str(preset), "--no-sweep", "--out", str(out))
    assert done.returncode == 2 and "latency_value is the objective's knob" in done.stderr
