"""A sandboxed `ember serve`: a model over its contract's memory dies alone (502) and the next request is served;
the server's state is its own (jobs database 0600, sockets' directory 0700); a server run from the directory that
holds its state serves, and its model sees none of that directory."""

from __future__ import annotations

import errno
import stat
from pathlib import Path

import httpx
import pytest

from ember.node.cgroups import Cgroups
from ember.testing.server import EmberServer

JAIL = Path(__file__).resolve().parents[1] / "integration" / "node" / "models"

pytestmark = pytest.mark.slow


def attempt(server: EmberServer, cmd: str) -> httpx.Response:
    body = {"inputs": [{"name": "cmd", "shape": [1], "datatype": "BYTES", "data": [cmd]}]}
    return httpx.post(server.url + "/v2/models/jail/infer", json=body, timeout=60)


def test_a_model_over_its_memory_is_killed_alone_and_the_server_serves_on(tmp_path: Path) -> None:
    cgroups = Cgroups.open()
    if isinstance(cgroups, str):   # then an address-space limit: tests/integration/node/test_sandbox.py checks it
        pytest.skip(f"no memory cgroups here: {cgroups}")
    cgroups.close()
    models = tmp_path / "models"
    models.mkdir()
    (models / "jail.yaml").write_text((JAIL / "jail.yaml").read_text().replace("memory_mb: 256", "memory_mb: 96"))
    (models / "jail.py").symlink_to(JAIL / "jail.py")
    with EmberServer(tmp_path / "state", "--models", str(models), "--cpu-slots", "1") as server:
        assert attempt(server, "alloc:16").status_code == 200
        over = attempt(server, "alloc:400")
        sandbox = server.instances("jail")
        assert over.status_code == 502, (over.text, sandbox)   # WorkerCrashed: the OOM killer took the instance
        again = attempt(server, "alloc:16")
        assert again.status_code == 200 and again.json()["outputs"][0]["data"][0] == 0
        assert stat.S_IMODE((tmp_path / "state" / "jobs.sqlite3").stat().st_mode) == 0o600
        assert stat.S_IMODE((tmp_path / "state" / "run").stat().st_mode) == 0o700
        assert "killed for going over its contract's memory_mb (96 MB)" in server.log.read_text()


def test_serve_from_the_directory_holding_its_state_serves_and_the_model_sees_none_of_it(tmp_path: Path) -> None:
    """`cd DIR && ember serve --state-dir DIR/state`: every inference was a 503 `fork failed: PermissionError ...
    state/run/rt2/i3.s` (the zygote had DIR on its path and the sandbox bound DIR, with the node's 0700 run
    directory, into the model's view) while `/v2/health/ready` said 200. Now it serves, the model reads nothing of
    DIR, and the server's command line is not in its /proc."""
    home = tmp_path / "h"
    proj = home / "p"
    (proj / "models").mkdir(parents=True)
    home.chmod(0o700)   # a home directory: closed to other users
    (proj / "notes.txt").write_text("the project's")
    (proj / "models" / "jail.yaml").write_text((JAIL / "jail.yaml").read_text())
    (proj / "models" / "jail.py").symlink_to(JAIL / "jail.py")
    with EmberServer(proj / "state", "--models", "models", "--cpu-slots", "1", cwd=proj) as server:
        own = attempt(server, f"read:{proj / 'models' / 'jail.yaml'}")
        assert own.status_code == 200, (own.text, server.log.read_text()[-2000:])
        assert own.json()["outputs"][0]["data"][0] == 0
        notes = attempt(server, f"read:{proj / 'notes.txt'}").json()["outputs"][0]["data"][0]
        assert server.proc is not None
        cmdline = attempt(server, f"read:/proc/{server.proc.pid}/cmdline").json()["outputs"][0]["data"][0]
        log = server.log.read_text()
        if "filesystem:read-only (" not in log:   # a view of its own (else the log says why not)
            assert notes == errno.ENOENT
        if "processes:hidden (" not in log:
            assert cmdline == errno.ENOENT
        assert httpx.get(server.url + "/v2/health/ready").status_code == 200
