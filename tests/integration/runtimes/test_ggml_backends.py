"""One llama.cpp build on any x86-64 host: each CPU backend variant is loaded by name and decodes (each runs in a
process of its own, as a host of that level would run it), and a repacked load is probed in a child first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ember.runtimes import cpu_probe
from ember.testing.gguf_models import smollm2_path

DECODE = r"""
import json, sys
from pathlib import Path
from ember.runtimes import ggml_backends, llamacpp
model = llamacpp.LlamaCppModel(Path(sys.argv[1]))
ctx = model.lib.llama_init_from_model(model.model, model.lib.llama_context_default_params())
tokens = model.tokenize("The capital of France is", special=False)
ids = (model.lib.llama_token * len(tokens))(*tokens)
assert model.lib.llama_decode(ctx, model.lib.llama_batch_get_one(ids, len(tokens))) == 0
print(json.dumps({"variant": ggml_backends.loaded().variant, "scores": dict(ggml_backends.loaded().scores)}))
"""


def decode_with(variant: str | None) -> dict[str, object]:
    env = {**os.environ, "EMBER_GGML_CPU": variant or ""}
    done = subprocess.run([sys.executable, "-c", DECODE, str(smollm2_path())], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_baseline_variant_and_the_best_one_both_decode() -> None:
    best = decode_with(None)
    scores = best["scores"]
    assert isinstance(scores, dict)
    if not scores:
        pytest.skip("llama.cpp was built with its CPU backend linked in (no variants to choose from)")
    assert best["variant"] == max((n for n in scores if n != "sapphirerapids"), key=lambda n: scores[n])
    assert decode_with("x64")["variant"] == "x64"   # the build's floor: any x86-64 host runs it


@pytest.mark.slow
def test_repack_is_probed_once_in_a_child_and_allowed_where_it_decodes(tmp_path: Path) -> None:
    verdict = cpu_probe.probe("repack", smollm2_path(), tmp_path)
    assert verdict == cpu_probe.Verdict(True, "the probe decoded a batch")
    assert [p.name.split("-")[0] for p in tmp_path.iterdir()] == ["repack"]
