"""`ember store push DIR NAME` of a Hugging Face directory: converted once to GGUF by llama.cpp's own converter
(installed by `make install` from llama-cpp-python's sdist), the GGUF pushed, then served by the llm runtime from
`weights: store:NAME`; a second push reuses the cached conversion; what the converter cannot take is one clear
line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ember.runtimes.llm import LLMRuntime
from ember.store import StoreConfig, WeightStore
from ember.store.hf_convert import is_hf_dir
from ember.wire.contract import example_contracts_dir, load_contract, parse_contract


def _ember(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "EMBER_STORE": str(root)}
    return subprocess.run([sys.executable, "-m", "ember", "store", "--no-memory", "--quiet", *args],
                          capture_output=True, text=True, env=env, timeout=600)


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama as Hugging Face saves it: config.json, model.safetensors, and SmolLM2's
    tokenizer (tokenizer.json, tokenizer_config.json, chat template) rebuilt by transformers from the bundled GGUF."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from ember.testing.gguf_models import smollm2_path

    out = tmp_path_factory.mktemp("hf") / "tiny-llama"
    gguf = smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def test_which_directories_are_converted(tmp_path: Path) -> None:
    def model(name: str, config: object) -> Path:
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        return d

    assert is_hf_dir(model("llama", {"architectures": ["LlamaForCausalLM"]}))
    assert is_hf_dir(model("gemma3", {"architectures": ["Gemma3ForConditionalGeneration"]}))
    assert is_hf_dir(model("gpt2", {"architectures": ["GPT2LMHeadModel"]}))
    assert not is_hf_dir(model("bert", {"architectures": ["BertModel"]}))   # the embedding runtime's: as it is
    assert not is_hf_dir(model("plain", {"hidden_size": 256}))
    assert not is_hf_dir(model("broken", "not an object"))
    assert not is_hf_dir(tmp_path / "missing")


def test_a_directory_without_config_json_is_one_clear_line(tmp_path: Path) -> None:
    d = tmp_path / "weights-only"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"\0" * 16)
    result = _ember(tmp_path / "store", "push", "--gguf", str(d), "x:1")
    assert result.returncode == 2, result.stderr
    assert f"{d} has no config.json" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_an_hf_directory_is_converted_pushed_and_served(hf_llama: Path, tmp_path: Path) -> None:
    root = tmp_path / "store"
    started = time.perf_counter()
    first = _ember(root, "push", str(hf_llama), "tiny:1")
    converting = time.perf_counter() - started
    assert first.returncode == 0, first.stderr
    assert "with llama.cpp's converter" in first.stdout
    assert "pushed tiny:1: 1 files" in first.stdout
    [gguf] = (root / "converted").glob("*/model-q8_0.gguf")
    written = gguf.stat().st_mtime_ns

    started = time.perf_counter()
    second = _ember(root, "push", str(hf_llama), "tiny:2")
    cached = time.perf_counter() - started
    assert second.returncode == 0, second.stderr
    assert f"the cached conversion {gguf}" in second.stdout and "converter" not in second.stdout
    assert gguf.stat().st_mtime_ns == written
    print(f"\nhf push: converting {converting:.1f} s, cached {cached:.1f} s (each with the CLI's start)")

    data = load_contract(example_contracts_dir() / "smollm2.yaml").model_dump(mode="json", exclude={"source"})
    data.update(name="tiny", weights="store:tiny:1",
                options={**data["options"], "kv_tokens": None, "snapshots": False})
    store = WeightStore(StoreConfig.build(root=root, memory_dir=None))
    try:
        model = LLMRuntime(cache_root=root).load(parse_contract(data), store=store)
    finally:
        store.close()
    assert model.engine.context_length == 2048   # max_position_embeddings, written by the converter
    request = np.empty(1, dtype=object)
    request[0] = json.dumps({"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}).encode()
    reply = model.infer({"request": request})
    assert int(reply["completion_tokens"][0]) >= 1
    assert bytes(reply["finish_reason"][0]) in (b"length", b"stop")
    assert int(reply["prompt_tokens"][0]) == 5   # SmolLM2's tokenizer, carried over by the converter


@pytest.mark.slow
def test_an_architecture_the_converter_does_not_know_is_its_own_message(hf_llama: Path, tmp_path: Path) -> None:
    d = tmp_path / "unknown"
    shutil.copytree(hf_llama, d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchForCausalLM"]}))
    result = _ember(tmp_path / "store", "push", str(d), "x:1")
    assert result.returncode == 2
    assert "Model NoSuchForCausalLM is not supported" in result.stderr
    assert "Traceback" not in result.stderr
