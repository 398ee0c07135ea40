"""The zygote and template patterns for each runtime, in a fresh interpreter.

A fresh interpreter, not the pytest process: earlier tests may already have run tensor math here, and
then any fork would deadlock for reasons that have nothing to do with the runtime under test.
The script preloads (zygote) or preloads and loads (template), forks, and the child loads if needed,
runs the contract's warmup requests plus a larger batch on 2 intra-op threads, and reports over a pipe.
A child that does not answer within the deadline is reported as hung.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ember.wire.contract import example_contracts_dir

SCRIPT = r"""
import json, os, select, sys, time
import numpy as np
from ember.runtimes import get_runtime
from ember.wire.contract import load_contract
from ember.wire.tensors import validate_inputs, warmup_inputs

contract = load_contract(sys.argv[1])
pattern, deadline = sys.argv[2], float(sys.argv[3])

def threads():
    for line in open("/proc/self/status"):
        if line.startswith("Threads:"):
            return int(line.split()[1])

def big_batch():
    inputs = warmup_inputs(contract)
    for spec in contract.inputs:
        arr = inputs[spec.name]
        if spec.datatype == "BYTES":
            arr = np.empty(32, dtype=object)
            arr[:] = [f"sentence {i} about forks, zygotes and thread pools".encode() * 8 for i in range(32)]
        else:
            arr = np.repeat(arr, 256, axis=0) + np.float32(1)
        inputs[spec.name] = arr
    return inputs

runtime = get_runtime(contract.runtime)
report = {"threads_start": threads()}
runtime.preload()
report["threads_preloaded"] = threads()
model = None
if pattern == "template":
    model = runtime.load(contract)
    report["threads_loaded"] = threads()
if pattern == "control":
    import torch
    torch.ones(512, 512) @ torch.ones(512, 512)  # starts the intra-op pool: what preload/load must not do

read_end, write_end = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(read_end)
    try:
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(2)
        started = time.perf_counter()
        child_model = model if model is not None else runtime.load(contract)
        load_s = time.perf_counter() - started
        shapes = []
        for inputs in [warmup_inputs(contract)] * contract.warmup.requests + [big_batch()]:
            validate_inputs(contract, inputs)
            out = child_model.infer(inputs)
            shapes.append({k: list(v.shape) for k, v in out.items()})
        message = {"ok": True, "load_s": load_s, "shapes": shapes}
    except BaseException as err:
        message = {"ok": False, "error": f"{type(err).__name__}: {err}"}
    os.write(write_end, json.dumps(message).encode())
    os._exit(0)
os.close(write_end)
ready, _, _ = select.select([read_end], [], [], deadline)
if ready:
    chunks = []
    while chunk := os.read(read_end, 65536):
        chunks.append(chunk)
    report["child"] = json.loads(b"".join(chunks))
    os.waitpid(pid, 0)
else:
    report["child"] = {"ok": False, "hung": True}
    os.kill(pid, 9)
    os.waitpid(pid, 0)
print(json.dumps(report))
"""

EXAMPLES = {"minilm": example_contracts_dir() / "minilm.yaml", "iris": example_contracts_dir() / "iris.yaml"}


def run(contract: Path, pattern: str, deadline: float) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(contract), pattern, str(deadline)],
        capture_output=True, text=True, timeout=deadline + 120, env=env, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("pattern", ["zygote", "template"])
@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_children_forked_after_preload_load_and_infer(example: str, pattern: str) -> None:
    report = run(EXAMPLES[example], pattern, deadline=120)
    child = report["child"]
    assert child["ok"], child
    assert len(child["shapes"]) == 4  # 3 warmup requests + the larger batch
    # preload and load start no threads (the intra-op pool would add one per extra core).
    assert report["threads_preloaded"] == report["threads_start"]
    assert report.get("threads_loaded", report["threads_preloaded"]) == report["threads_preloaded"]


@pytest.mark.slow
def test_the_check_detects_a_thread_pool_started_before_the_fork() -> None:
    # The control: tensor math before forking starts the OpenMP pool, and the child must then hang
    # (or at least the thread count must rise). This is what the test above would catch.
    if (os.cpu_count() or 1) < 2:
        pytest.skip("an intra-op pool needs at least 2 cores")
    report = run(EXAMPLES["minilm"], "control", deadline=15)
    assert report["child"].get("hung"), report
