"""`ember store` as a user runs it: push, ls, stats, pull --to, gc, and clear errors for bad input."""

from __future__ import annotations

import filecmp
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ember.store import StoreConfig
from ember.testing.checkpoints import small_specs, write_checkpoint


def _ember(*args: str, env_root: Path, shm: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "EMBER_STORE": str(env_root)}
    return subprocess.run([sys.executable, "-m", "ember", "store", "--memory-dir", str(shm), *args],
                          capture_output=True, text=True, env=env, timeout=120)


@pytest.fixture
def shm(tmp_path: Path) -> Path:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    path = base / f"ember-e2e-{os.getpid()}-{tmp_path.name}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_push_ls_stats_pull_gc(tmp_path: Path, shm: Path) -> None:
    model = tmp_path / "model"
    write_checkpoint(model / "model.safetensors", small_specs(seed=3))
    (model / "config.json").write_text('{"a": 1}')
    root = tmp_path / "store"
    pushed = _ember("push", str(model), "tiny:1", "--quiet", env_root=root, shm=shm)
    assert pushed.returncode == 0, pushed.stderr
    assert "pushed tiny:1: 2 files" in pushed.stdout
    assert _ember("push", str(model), "tiny:2", "--quiet", env_root=root, shm=shm).returncode == 0
    listed = _ember("ls", env_root=root, shm=shm)
    assert listed.stdout.split() == ["tiny:1", "tiny:2"]
    stats = _ember("stats", env_root=root, shm=shm)
    assert stats.returncode == 0 and "dedupe ratio: 2.00x" in stats.stdout
    out = tmp_path / "pulled"
    pulled = _ember("pull", "tiny:2", "--to", str(out), "--quiet", env_root=root, shm=shm)
    assert pulled.returncode == 0, pulled.stderr
    assert filecmp.cmp(model / "model.safetensors", out / "model.safetensors", shallow=False)
    assert (out / "config.json").read_text() == '{"a": 1}'
    (root / "manifests" / "tiny" / "2.json").unlink()
    (root / "manifests" / "tiny" / "1.json").unlink()
    gc = _ember("gc", "--verify", env_root=root, shm=shm)
    assert gc.returncode == 0 and "removed" in gc.stdout and "0 corrupt" in gc.stdout
    assert not any((root / "chunks").glob("*/*"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["pull", "ghost:1"], "has no model ghost:1"),
        (["push", "/no/such/dir", "x:1"], "does not exist"),
        (["push", ".", "bad/name:1"], "name 'bad/name'"),
        (["--memory-capacity", "-1", "stats"], "memory_capacity"),
        (["--origin", "ftp://nope", "ls"], "origin"),
    ],
)
def test_bad_input_is_one_clear_line(tmp_path: Path, shm: Path, args: list[str], message: str) -> None:
    result = _ember(*args, env_root=tmp_path / "store", shm=shm)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_a_command_leaves_no_memory_tier_behind_unless_asked(tmp_path: Path) -> None:
    root = tmp_path / "fresh"
    memory = StoreConfig(root=root).memory_dir
    if memory is None:
        pytest.skip("no /dev/shm here: no memory tier")
    assert not memory.exists()
    try:
        env = {**os.environ, "EMBER_STORE": str(root)}
        stats = subprocess.run([sys.executable, "-m", "ember", "store", "stats"], capture_output=True, text=True,
                               env=env, timeout=120)
        assert stats.returncode == 0, stats.stderr
        assert not memory.exists()
        kept = subprocess.run([sys.executable, "-m", "ember", "store", "--keep-memory-tier", "stats"],
                              capture_output=True, text=True, env=env, timeout=120)
        assert kept.returncode == 0, kept.stderr
        assert (memory / "chunks").is_dir()
    finally:
        shutil.rmtree(memory, ignore_errors=True)
