"""vLLM's sleep mode behind its capability check, in the `vllm` environment's interpreter (a subprocess).

On the CPU build (this machine) vLLM's platform has no sleep mode: the model offers no sleep levels, so the node
pauses its instances instead. Where CUDA is present (the device machine) the same script puts the engine to sleep at
level 1 and 2 and checks that greedy tokens are unchanged after each wake and that sleeping gave device memory back;
it prints the sleep and wake times. Needs `ember env build vllm`: skipped with that reason otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from ember.environments.registry import Environments

ENV = Environments().status("vllm")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not ENV.built, reason=f"vllm runtime: {ENV.reason or 'not built'}")]

DRIVE = r"""
import json, sys, time
import numpy as np
from ember.runtimes.vllm import VLLMRuntime, device_used_mb
from ember.node.instance import model_sleep_levels
from ember.testing.hf_models import vllm_contract_data
from ember.wire.contract import parse_contract

outputs = ("text", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens")
options = {"kv_cache_gb": 0.25, "max_model_len": 1024, "dtype": sys.argv[2]}
contract = parse_contract(vllm_contract_data("tiny-vllm", sys.argv[1], outputs, options=options))
runtime = VLLMRuntime()
runtime.preload()
model = runtime.load(contract)

def greedy():
    arr = np.empty(1, dtype=object)
    arr[0] = json.dumps({"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}).encode()
    return b"".join(bytes(r["text"][0]) for r in model.stream({"request": arr}) if r is not None)

out = {"levels": list(model_sleep_levels(model)), "awake_mb": device_used_mb()}
if out["levels"]:
    before = greedy()
    for level in (1, 2):
        t0 = time.perf_counter()
        held = model.sleep(level)
        t1 = time.perf_counter()
        model.wake_up()
        t2 = time.perf_counter()
        out[f"level{level}"] = {"held_mb": held, "sleep_s": t1 - t0, "wake_s": t2 - t1, "same": greedy() == before}
print(json.dumps(out))
"""


def test_sleep_levels_follow_the_platform_and_a_woken_engine_answers_as_before(tmp_path: Path) -> None:
    from ember.testing.hf_models import tiny_llama_hf

    weights = tiny_llama_hf(tmp_path / "tiny-llama")
    cuda = os.environ.get("CUDA_VISIBLE_DEVICES", "") != "" or Path("/dev/nvidia0").exists()
    dtype = "bfloat16" if cuda else "float32"
    done = subprocess.run([str(ENV.python), "-c", DRIVE, str(weights), dtype], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(result)
    if result["awake_mb"] is None:      # no CUDA: vLLM's CPU build has no sleep mode
        assert result["levels"] == []
        return
    assert result["levels"] == [1, 2]
    for level in ("level1", "level2"):
        assert result[level]["same"], result
        assert result[level]["held_mb"] < result["awake_mb"], result
