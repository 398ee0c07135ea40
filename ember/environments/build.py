"""Build a node environment: `build(envs, name, report)`.

Steps, each reported: a virtualenv at `ROOT/NAME` (the interpreter that runs this code, so the same Python), the
requirements list installed into it with its own pip (whatever pip's configuration on this machine says: indexes,
find-links, constraints), ember made importable there by a `.pth` file naming this checkout (ember's own
dependencies are not installed: the node's processes import only what the environment's libraries bring), then a
check that the interpreter imports ember's zygote and the runtime's engine. The marker goes last, so an interrupted
build is never taken for a built one; a second build over it installs only what is missing. pip's output goes to
`ROOT/NAME/build.log`. A lock file keeps two builds of one environment apart.
"""

from __future__ import annotations

import fcntl
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

import ember
from ember.environments.registry import MARKER, Environments, requirements_digest, requirements_file
from ember.errors import EmberError

# What the built interpreter must import, per environment: ember's node side and the runtime's engine.
CHECKS = {"vllm": "import ember.node.zygote, ember.runtimes.vllm, vllm, torch; print(vllm.__version__)"}

Report = Callable[[str, int], None]   # (what is happening, packages seen so far)
_UNINSTALL = "# ember: uninstall "
_COLLECTING = re.compile(r"^(Collecting|Requirement already satisfied:) (\S+)")


class BuildFailed(EmberError):
    pass


def build(envs: Environments, name: str, report: Report | None = None, *, timeout_s: float = 3600.0) -> Path:
    """Build environment `name` under `envs.root`; its path. BuildFailed naming the step and the log."""
    say = report or (lambda what, n: None)
    path = envs.path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.parent / f".{name}.lock"):
        (path / MARKER).unlink(missing_ok=True)
        say("create the virtualenv", 0)
        _run([sys.executable, "-m", "venv", str(path)], path.parent / f".{name}.venv.log", "venv", timeout_s)
        log = path / "build.log"
        listed = requirements_file(name)
        say(f"install the requirements ({listed.name})", 0)
        _pip_install(path, listed, log, say, timeout_s)
        removed = uninstalls(listed)
        if removed:
            say(f"remove {', '.join(removed)}", 0)
            with log.open("a") as out:
                for _ in _lines([str(path / "bin" / "python"), "-m", "pip", "uninstall", "-y", *removed], out,
                                timeout_s, "pip uninstall"):
                    pass
        _link_ember(path)
        say("check the imports", 0)
        version = _check(path, name, log, timeout_s)
        marker = {"name": name, "requirements_sha256": requirements_digest(name), "python": sys.version.split()[0],
                  "ember_root": str(_ember_root()), "check": version, "built_at": time.time()}
        (path / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        say(f"built ({version})", 0)
    return path


def uninstalls(requirements: Path) -> list[str]:
    """Packages the list says to remove after installing (`# ember: uninstall A B`): what its libraries ask for
    but cannot use here."""
    names: list[str] = []
    for line in requirements.read_text().splitlines():
        if line.startswith(_UNINSTALL):
            names.extend(line[len(_UNINSTALL):].split())
    return names


def _pip_install(path: Path, requirements: Path, log: Path, say: Report, timeout_s: float) -> None:
    command = [str(path / "bin" / "python"), "-m", "pip", "install", "--progress-bar", "off", "-r", str(requirements)]
    seen = 0
    with log.open("w") as out:
        for line in _lines(command, out, timeout_s):
            found = _COLLECTING.match(line)
            if found:
                seen += 1
                say(f"resolve: {found.group(2)}", seen)
            elif line.startswith("Installing collected packages"):
                say("install the collected packages", seen)
    say("installed", seen)


def _lines(command: list[str], out: TextIO, timeout_s: float, what: str = "pip install") -> Iterator[str]:
    """The command's output lines, copied to `out`; BuildFailed when it fails or runs past `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            yield line.strip()
            if time.monotonic() > deadline:
                proc.kill()
                raise BuildFailed(f"{what}: still running after {timeout_s:g} s (log: {out.name})")
        if proc.wait() != 0:
            raise BuildFailed(f"{what} failed (exit {proc.returncode}; log: {out.name})")


def _ember_root() -> Path:
    return Path(ember.__file__).resolve().parent.parent


def _link_ember(path: Path) -> None:
    """ember importable in the environment: a .pth naming this checkout (its dependencies are not installed)."""
    sites = sorted((path / "lib").glob("python*/site-packages"))
    if not sites:
        raise BuildFailed(f"environment at {path}: no site-packages under lib/")
    (sites[0] / "ember-node.pth").write_text(f"{_ember_root()}\n")


def _check(path: Path, name: str, log: Path, timeout_s: float) -> str:
    code = CHECKS.get(name, "import ember.node.zygote")
    try:
        done = subprocess.run([str(path / "bin" / "python"), "-c", code], capture_output=True, text=True,
                              timeout=timeout_s, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    except subprocess.TimeoutExpired:
        raise BuildFailed(f"environment {name!r}: the import check ran past {timeout_s:g} s") from None
    with log.open("a") as out:
        out.write(done.stdout + done.stderr)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise BuildFailed(f"environment {name!r}: the built interpreter cannot import what it needs: {last} "
                          f"(log: {log})")
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "ok"


def _run(command: list[str], log: Path, what: str, timeout_s: float) -> None:
    with log.open("w") as out:
        for _ in _lines(command, out, timeout_s, what):
            pass


@contextmanager
def _locked(lock: Path) -> Iterator[None]:
    with lock.open("w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BuildFailed(f"another build holds {lock}; wait for it to finish") from None
        yield
