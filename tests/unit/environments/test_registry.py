"""Node environments: the requirements lists ember ships, when an environment counts as built, and the refusal that
names the command to run when it does not (no process started, no wait)."""

from __future__ import annotations

import asyncio
import json
import re
import tempfile
from pathlib import Path

import pytest

from ember.environments.build import uninstalls
from ember.environments.registry import MARKER, Environments, known, requirements_digest, requirements_file
from ember.errors import InvalidInput, ModelNotReady
from ember.node.local_node import LocalNode
from ember.wire.contract import parse_contract


def _built(root: Path, name: str = "vllm", digest: str | None = None) -> Path:
    path = root / name
    (path / "bin").mkdir(parents=True)
    (path / "bin" / "python").write_text("")
    (path / MARKER).write_text(json.dumps({"requirements_sha256": digest or requirements_digest(name)}))
    return path


def test_the_vllm_list_pins_every_package_and_the_cpu_torch() -> None:
    assert "vllm" in known()
    lines = [line.strip() for line in requirements_file("vllm").read_text().splitlines()]
    pins = [line for line in lines if line and not line.startswith("#")]
    assert pins and all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][0-9A-Za-z.+]*", p) for p in pins), pins
    assert "torch==2.13.0+cpu" in pins   # never a CUDA build of several GB
    assert uninstalls(requirements_file("vllm")) == ["torchvision", "torchaudio", "torchcodec"]


def test_missing_stale_and_built(tmp_path: Path) -> None:
    envs = Environments(tmp_path)
    missing = envs.status("vllm")
    assert not missing.built and missing.reason == \
        "environment 'vllm' is not built on this node (run `ember env build vllm`)"
    path = _built(tmp_path, digest="0" * 64)
    assert "was built from another requirements list" in envs.status("vllm").reason
    (path / MARKER).write_text(json.dumps({"requirements_sha256": requirements_digest("vllm")}))
    assert envs.status("vllm").built
    assert envs.python("vllm", "/usr/bin/python3") == str(path / "bin" / "python")
    assert envs.python(None, "/usr/bin/python3") == "/usr/bin/python3"


def test_an_unbuilt_environment_is_model_not_ready_and_an_unknown_one_invalid(tmp_path: Path) -> None:
    with pytest.raises(ModelNotReady, match="run `ember env build vllm`"):
        Environments(tmp_path).python("vllm", "python3")
    with pytest.raises(InvalidInput, match="^environment: unknown environment 'nope' \\(known: .*vllm"):
        Environments(tmp_path).status("nope")


def test_the_root_is_the_env_var_else_under_the_state_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("EMBER_ENV_ROOT", raising=False)
    monkeypatch.setenv("EMBER_STATE_DIR", str(tmp_path / "state"))
    assert Environments().root == tmp_path / "state" / "envs"
    monkeypatch.setenv("EMBER_ENV_ROOT", str(tmp_path / "elsewhere"))
    assert Environments().root == tmp_path / "elsewhere"


def test_a_node_refuses_a_vllm_model_at_once_when_its_environment_is_missing(tmp_path: Path) -> None:
    contract = parse_contract({"name": "m", "runtime": "vllm", "weights": str(tmp_path),
                               "inputs": [{"name": "request", "datatype": "BYTES", "shape": [1]}],
                               "outputs": [{"name": "text", "datatype": "BYTES", "shape": [1]}]})

    async def main() -> None:
        node = LocalNode(tempfile.mkdtemp(prefix="ember-env-", dir="/tmp"), environments=Environments(tmp_path))
        try:
            with pytest.raises(ModelNotReady, match=r"^environment 'vllm' is not built on this node "
                                                    r"\(run `ember env build vllm`\)$"):
                await asyncio.wait_for(node.prepare(contract), 5)
            assert node.pids() == {} and not node.has_zygote("vllm")
        finally:
            await node.close()

    asyncio.run(main())


def test_where_cuda_is_present_vllm_is_built_from_its_cuda_list(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    from ember.environments.registry import machine_variant

    monkeypatch.delenv("EMBER_ENV_VARIANT", raising=False)
    driver = tmp_path / "version"
    assert machine_variant(driver) == "cpu"
    driver.write_text("NVRM version: ...")
    assert machine_variant(driver) == "cuda"
    assert known() == ("vllm",)   # a variant's list is not an environment of its own
    cuda = requirements_file("vllm", "cuda")
    assert cuda.name == "vllm-cuda.txt" and requirements_file("vllm", "cpu").name == "vllm.txt"
    pins = [line for line in cuda.read_text().splitlines() if line and not line.startswith("#")]
    assert pins == ["vllm==0.32.0"] and uninstalls(cuda) == []   # vLLM's CUDA build pins its own torch


def test_the_variant_is_named_by_the_environment_and_a_cpu_build_is_stale_on_a_cuda_machine(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("EMBER_ENV_VARIANT", "cpu")
    _built(tmp_path)
    assert Environments(tmp_path).status("vllm").built
    monkeypatch.setenv("EMBER_ENV_VARIANT", "cuda")
    status = Environments(tmp_path).status("vllm")
    assert not status.built and "another requirements list" in status.reason and "ember env build vllm" in status.reason
    monkeypatch.setenv("EMBER_ENV_VARIANT", "rocm")
    with pytest.raises(InvalidInput, match="^EMBER_ENV_VARIANT: 'rocm' is not one of cpu, cuda"):
        requirements_file("vllm")
