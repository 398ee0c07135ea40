"""One server per state dir: the second refuses, naming the dir and the holder's pid; a dead holder's lock is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ember.serving.state_lock import StateDirInUse, lock_state_dir, unlock_state_dir

HOLD = "import sys, time; from pathlib import Path; from ember.serving.state_lock import lock_state_dir; " \
       "lock_state_dir(Path(sys.argv[1])); print('held', flush=True); time.sleep(60)"


def test_a_second_holder_is_refused_with_the_dir_and_the_holders_pid(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(StateDirInUse) as refused:
            lock_state_dir(tmp_path)
        assert str(tmp_path) in refused.value.message and f"pid {holder.pid}" in refused.value.message
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    fd = lock_state_dir(tmp_path)           # the kernel dropped the dead holder's lock: no stale-file trouble
    assert (tmp_path / "serve.lock").read_text().strip() == str(os.getpid())
    assert (tmp_path / "serve.lock").stat().st_mode & 0o777 == 0o600
    with pytest.raises(StateDirInUse):
        lock_state_dir(tmp_path)            # the same process's second server too
    unlock_state_dir(fd)
    unlock_state_dir(lock_state_dir(tmp_path))
