"""Options whose kernels depend on the CPU, tried in a child process and remembered (ember.runtimes.cpu_probe)."""

import logging
import sys
from pathlib import Path

import pytest

from ember.runtimes import cpu_probe


def counting(tmp_path: Path, body: str) -> list[str]:
    """A probe command that appends a line to a file each time it runs, then runs `body`."""
    runs = tmp_path / "runs"
    return [sys.executable, "-c", f"open({str(runs)!r}, 'a').write('x'); {body}"]


def test_a_probe_that_crashes_says_which_signal_and_is_remembered(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    command = counting(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    first = cpu_probe.probe("repack", gguf, tmp_path / "probes", command=command)
    again = cpu_probe.probe("repack", gguf, tmp_path / "probes", command=command)
    assert first == again == cpu_probe.Verdict(False, "the probe process died of SIGSEGV")
    assert (tmp_path / "runs").read_text() == "x"   # once per host and file


def test_a_probe_that_passes_is_remembered_and_a_changed_file_is_tried_again(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    command = counting(tmp_path, "pass")
    assert cpu_probe.probe("repack", gguf, tmp_path / "probes", command=command).ok
    assert cpu_probe.probe("repack", gguf, tmp_path / "probes", command=command).ok
    gguf.write_bytes(b"GGUF, another")
    assert cpu_probe.probe("repack", gguf, tmp_path / "probes", command=command).ok
    assert (tmp_path / "runs").read_text() == "xx"


def test_an_error_exit_names_its_last_line(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    verdict = cpu_probe.probe("repack", gguf, tmp_path / "p", command=[sys.executable, "-c", "raise SystemExit('no')"])
    assert verdict == cpu_probe.Verdict(False, "the probe exited with status 1: no")


def test_a_probe_that_hangs_is_stopped(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    verdict = cpu_probe.probe("repack", gguf, tmp_path / "p", command=[sys.executable, "-c", "import time; "
                                                                        "time.sleep(30)"], timeout_s=0.5)
    assert verdict == cpu_probe.Verdict(False, "the probe did not finish in 0.5 s")


def test_repack_is_refused_with_the_reason_logged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    real = cpu_probe.probe
    crash = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]
    monkeypatch.setattr(cpu_probe, "probe", lambda kind, target, cache: real(kind, target, cache, command=crash))
    with caplog.at_level(logging.WARNING, logger="ember.llm"):
        assert not cpu_probe.repack_allowed(gguf, tmp_path / "probes")
    assert "repack: off for m.gguf on this host (the probe process died of SIGSEGV)" in caplog.text


def test_a_probe_killed_from_outside_is_not_remembered(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    command = counting(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    for _ in range(2):   # SIGKILL (the OOM killer, a stop) says nothing of the kernels: tried again
        assert cpu_probe.probe("repack", gguf, tmp_path / "probes", command=command) == \
            cpu_probe.Verdict(False, "the probe process died of SIGKILL")
    assert (tmp_path / "runs").read_text() == "xx"
