"""A real PostgreSQL server on 127.0.0.1, for the shared job store's tests: initdb into a temp dir, then
`postgres` in the foreground, stopped (fast shutdown) and its directory removed on `close()`.

PostgreSQL refuses to run as root: under root the server runs as the `postgres` system user (Debian's
package creates it) and the temp dir is handed to it. Trust authentication on loopback only, fsync off
(a test server: durability across power loss is not what these tests check). Debian does not put the
server binaries on PATH: they are looked up in /usr/lib/postgresql/<version>/bin, newest first.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from ember.ports import free_port

__all__ = ["PostgresServer", "available", "bin_dir"]

SUPERUSER = "ember"


def bin_dir() -> Path | None:
    """The directory holding `initdb` and `postgres`, or None when the server is not installed."""
    found = shutil.which("postgres")
    if found and (Path(found).resolve().parent / "initdb").exists():
        return Path(found).resolve().parent
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"),
                      key=lambda p: [int(x) for x in re.findall(r"\d+", p.parent.parent.name)], reverse=True)
    return versions[0].parent if versions else None


def available() -> bool:
    return bin_dir() is not None and (os.geteuid() != 0 or _system_user() is not None)


def _system_user() -> pwd.struct_passwd | None:
    try:
        return pwd.getpwnam("postgres")
    except KeyError:
        return None


class PostgresServer:
    def __init__(self, host: str = "127.0.0.1") -> None:
        """`host`: the address it listens on besides loopback, and its URLs name (a network namespace's bridge)."""
        self.host = host
        found = bin_dir()
        if found is None:
            raise RuntimeError("PostgreSQL is not installed: run `make system` (apt-get install postgresql)")
        self.bin = found
        self.port = 0
        self.work = Path(tempfile.mkdtemp(prefix="ember-pg-"))
        self._proc: subprocess.Popen[bytes] | None = None
        self._as: dict[str, Any] = {}
        if os.geteuid() == 0:
            user = _system_user()
            if user is None:
                raise RuntimeError("running as root, and there is no `postgres` user to run the server as")
            os.chown(self.work, user.pw_uid, user.pw_gid)
            self._as = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@{self.host}:{self.port}/{dbname}"

    def start(self, timeout_s: float = 60.0) -> PostgresServer:
        data, log = self.work / "data", self.work / "postgres.log"
        subprocess.run([str(self.bin / "initdb"), "-D", str(data), "-U", SUPERUSER, "--auth=trust", "--no-sync",
                        "--no-locale", "-E", "UTF8"], cwd=self.work, check=True, capture_output=True, **self._as)
        self.port = free_port()
        listen = "127.0.0.1"
        if self.host != "127.0.0.1":   # trusted from the host's subnets too (initdb trusts loopback only)
            listen += f",{self.host}"
            with (data / "pg_hba.conf").open("a") as hba:
                hba.write("host all all samenet trust\n")
        with log.open("ab") as out:
            self._proc = subprocess.Popen(
                [str(self.bin / "postgres"), "-D", str(data), "-h", listen, "-p", str(self.port),
                 "-k", str(self.work), "-c", "fsync=off", "-c", "full_page_writes=off", "-c", "max_connections=200"],
                cwd=self.work, stdout=out, stderr=subprocess.STDOUT, **self._as)
        self._wait_ready(timeout_s, log)
        return self

    def _wait_ready(self, timeout_s: float, log: Path) -> None:
        import psycopg

        deadline = time.monotonic() + timeout_s
        while True:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(f"postgres exited ({self._proc.returncode}): {log.read_text()[-2000:]}")
            try:
                psycopg.connect(self.url(), connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"postgres not ready after {timeout_s:g} s: {log.read_text()[-2000:]}") from None
                time.sleep(0.1)

    def create_database(self, name: str) -> str:
        """A new empty database; its URL."""
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.url(name)

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGINT)     # fast shutdown: disconnect clients, stop
            try:
                self._proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        with contextlib.suppress(OSError):
            shutil.rmtree(self.work)

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
