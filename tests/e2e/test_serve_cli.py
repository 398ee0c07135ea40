"""`ember serve` refuses bad settings with a message naming the flag, before starting anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--port", "70000"], "port: Input should be less than or equal to 65535"),
        (["--cpu-slots", "-1"], "cpu_slots: Input should be greater than or equal to 0"),
        (["--cpu-slots", "0"], "invalid server settings: cpu_slots: 0 (a gateway only) needs a cluster"),
        (["--max-body-mb", "512"], "max_inflight_mb (256) must be at least max_body_mb (512)"),
        (["--keepalive", "forever"], "keepalive: Input should be 'contract', 'fixed', 'fixed-zygote', 'hybrid', "
                                     "'hybrid-zygote', 'ladder' or 'ladder-cold'"),
        (["--keepalive", "fixed", "--keepalive-knob", "-1"], "keepalive_knob: Input should be greater than or equal"),
        (["--models", "/nonexistent/models.yaml"], "--models: /nonexistent/models.yaml does not exist"),
        (["--log-level", "loud"], "log_level"),
    ],
)
def test_bad_settings_exit_2_naming_the_key(tmp_path: Path, args: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "ember", "serve", "--state-dir", str(tmp_path), *args],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
