"""LocalNode's pure parts: error frames to ember errors, exit statuses, the socket directory check."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from ember.core.slices import Slice
from ember.errors import InvalidInput, ModelFailed, ModelNotReady, WorkerCrashed
from ember.node.forkserver import error_header
from ember.node.instance import slice_from_json, slice_to_json
from ember.node.local_node import LocalNode
from ember.node.replies import describe_status, error_from


def test_error_frames_round_trip_ember_errors_and_wrap_foreign_ones() -> None:
    err = error_from(error_header(InvalidInput("input 'x': bad"), 3))
    assert type(err) is InvalidInput and str(err) == "input 'x': bad"
    err = error_from(error_header(ZeroDivisionError("division by zero")))
    assert type(err) is ModelFailed and str(err) == "ZeroDivisionError: division by zero"
    assert type(error_from(error_header(KeyError(), default="ModelNotReady"))) is ModelNotReady
    assert type(error_from({"kind": "WorkerCrashed", "message": "gone"})) is WorkerCrashed
    # names that are not ember errors never become arbitrary classes
    for name in ("SystemExit", "EmberError", "Path", ""):
        assert type(error_from({"kind": name, "message": "m"})) is ModelFailed


def test_exit_status_descriptions() -> None:
    assert describe_status(0) == "exit code 0"
    assert describe_status(-int(signal.SIGKILL)) == "killed by SIGKILL"
    assert describe_status(None) == "status unknown"


def test_slices_survive_json() -> None:
    slice_ = Slice(id="gpu0", kind="mig-1g.18gb", memory_mb=18000, cpus=(0, 1), device="MIG-abc", threads=2)
    assert slice_from_json(slice_to_json(slice_)) == slice_
    with pytest.raises(InvalidInput, match="slice"):
        slice_from_json({"id": "x", "bogus": 1})
    with pytest.raises(InvalidInput, match="slice"):
        slice_from_json("cpu-0")


def test_a_state_dir_too_long_for_unix_sockets_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="state_dir"):
        LocalNode(tmp_path / ("d" * 100))
    node = LocalNode(tmp_path)
    assert node.run_dir == tmp_path.resolve() / "run"
    assert node.pids() == {}


def test_the_nodes_own_secrets_stay_out_of_its_processes_environment(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Zygotes, and so every model's code, and snapshot hosts, and so every image, never get the server's secrets."""
    from ember.node.local_node import NODE_SECRETS, LocalNode

    for name in NODE_SECRETS:
        monkeypatch.setenv(name, "s3cret")
    monkeypatch.setenv("EMBER_SOMETHING_ELSE", "kept")
    env = LocalNode(tmp_path / "state", env={"EMBER_CLUSTER_TOKEN": "s3cret"})._env()
    assert "s3cret" not in env.values() and env["EMBER_SOMETHING_ELSE"] == "kept"
