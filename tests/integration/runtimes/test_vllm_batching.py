"""The vllm runtime's streams share the engine's steps: requests that arrive together are prefilled in one step.

Runs ember's VLLMModel in the `vllm` environment's interpreter (a subprocess: vLLM does not import in ember's own
environment), on a random-weight tiny Llama, driving its streams as the instance server does (one reply from each
stream in turn) and counting the real engine's steps. Needs `ember env build vllm`: skipped with that reason
otherwise.
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
import json, sys
import numpy as np
from ember.runtimes.vllm import VLLMRuntime
from ember.testing.hf_models import vllm_contract_data
from ember.wire.contract import parse_contract

outputs = ("text", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens")
contract = parse_contract(vllm_contract_data("tiny-vllm", sys.argv[1], outputs))
runtime = VLLMRuntime()
runtime.preload()
model = runtime.load(contract)
steps = 0
step = model.engine.step
def counted():
    global steps
    steps += 1
    return step()
model.engine.step = counted

def request(i):
    arr = np.empty(1, dtype=object)
    arr[0] = json.dumps({"prompt": f"Once upon a time {i}", "max_tokens": 6, "temperature": 0}).encode()
    return {"request": arr}

streams = {i: model.stream(request(i)) for i in range(8)}   # arrived together, as the instance server admits them
tokens = {}
while streams:
    for i, replies in list(streams.items()):
        try:
            reply = next(replies)
        except StopIteration:
            del streams[i]
            continue
        if reply is not None:
            tokens[i] = int(reply["completion_tokens"][0])
print(json.dumps({"steps": steps, "tokens": tokens}))
"""


def test_streams_arriving_together_share_the_prefill_step(tmp_path: Path) -> None:
    from ember.testing.hf_models import tiny_llama_hf

    weights = tiny_llama_hf(tmp_path / "tiny-llama")
    done = subprocess.run([str(ENV.python), "-c", DRIVE, str(weights)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["tokens"] == {str(i): 6 for i in range(8)}
    # One step prefills all eight and gives each its first token, five more give the rest: 6 steps. Before, each
    # new stream ran a step of its own on its first turn: 8 steps just to let them all in.
    assert result["steps"] == 6
