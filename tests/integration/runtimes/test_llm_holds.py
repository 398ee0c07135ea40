"""The llm runtime's holds (what a zygote keeps loaded for its children): by model key, one load per file."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ember.node import procinfo
from ember.runtimes.llm import LLMRuntime
from ember.wire.contract import example_contracts_dir, load_contract

SMOLLM2 = load_contract(example_contracts_dir() / "smollm2.yaml")


def mapped(path: Path) -> bool:
    return any(p == str(path) for _, _, p in procinfo.file_mappings())


def test_models_on_one_file_share_a_hold_and_a_child_keeps_only_its_own(tmp_path: Path) -> None:
    bundled = SMOLLM2.weights_path()
    assert bundled is not None
    gguf, other_path = tmp_path / "one.gguf", tmp_path / "other.gguf"   # copies: no other test maps them
    shutil.copyfile(bundled, gguf)
    shutil.copyfile(bundled, other_path)
    a = SMOLLM2.model_copy(update={"weights": str(gguf)})
    b = SMOLLM2.model_copy(update={"name": "smollm2-b", "weights": str(gguf)})   # the same file, another key
    other = SMOLLM2.model_copy(update={"name": "other", "weights": str(other_path)})
    runtime = LLMRuntime(cache_root=tmp_path / "store")
    assert runtime.hold(a) and runtime.hold(b) and runtime.hold(other)
    assert len(runtime._held) == 2
    runtime.drop(a)
    assert mapped(gguf)                       # b still holds the file
    runtime.drop(b)
    assert not mapped(gguf) and mapped(other_path)

    runtime.hold(a)
    os.utime(other_path, ns=(1, 1))           # the other model's file changed after its hold
    runtime.keep(a)                           # a child of `a`: the other's load goes
    assert mapped(gguf) and not mapped(other_path)
    model = runtime.load(a)
    assert runtime._held == {} and model.engine is not None
    model.engine.close()
