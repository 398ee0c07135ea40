"""A node's serve process leaves Ray's worker niceness (15) for 0, so that its instances do not lose every
contended core (ember/cluster/join.py `normal_priority`)."""

from __future__ import annotations

import os
import subprocess
import sys


def test_a_serve_process_started_nice_runs_at_niceness_0_where_it_may() -> None:
    code = "import os; os.nice(15); from ember.cluster.join import normal_priority; print(normal_priority())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    # Root (CAP_SYS_NICE) may lower it again; anyone else keeps 15 and is told how to start the Ray nodes.
    assert int(out.stdout.split()[-1]) == (0 if os.geteuid() == 0 else 15)
    if os.geteuid() != 0:
        assert "RAY_worker_niceness=0" in out.stderr
