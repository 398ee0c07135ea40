"""Where a node's environments live and whether one is built: `Environments(root)`.

An environment NAME is a virtualenv at `ROOT/NAME` built from `ember/environments/NAME.txt` (the requirements list
ember ships), or from `NAME-VARIANT.txt` where the machine is of that variant and ember ships one: `vllm-cuda.txt`
where CUDA is present (an NVIDIA driver loaded), `vllm.txt` (vLLM's CPU build) elsewhere; `EMBER_ENV_VARIANT=cpu` or
`cuda` says which. It counts as built once its marker (`ROOT/NAME/ember-env.json`, written last by the build) names the
requirements it was built from; a list that changed since makes it stale. ROOT is `$EMBER_ENV_ROOT`, else
`envs/` under ember's state directory (`$EMBER_STATE_DIR`, else ~/.local/state/ember): outside the repository, one
per node. A model whose environment is missing or stale is refused with a ModelNotReady that names the command to
run (`ember env build NAME`), before any process starts: never a hang.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from ember.errors import InvalidInput, ModelNotReady

MARKER = "ember-env.json"
_HERE = Path(__file__).resolve().parent
VARIANTS = ("cpu", "cuda")
NVIDIA_DRIVER = Path("/proc/driver/nvidia/version")   # present while the NVIDIA kernel driver is loaded


def known() -> tuple[str, ...]:
    """The environments ember ships a requirements list for."""
    return tuple(sorted(p.stem for p in _HERE.glob("*.txt") if not p.stem.endswith(tuple(f"-{v}" for v in VARIANTS))))


def machine_variant(driver: Path = NVIDIA_DRIVER) -> str:
    """`cuda` where an NVIDIA driver is loaded, else `cpu`; `EMBER_ENV_VARIANT` overrides (InvalidInput naming it when
    it is neither)."""
    given = os.environ.get("EMBER_ENV_VARIANT")
    if given is not None:
        if given not in VARIANTS:
            raise InvalidInput(f"EMBER_ENV_VARIANT: {given[:40]!r} is not one of {', '.join(VARIANTS)}")
        return given
    return "cuda" if driver.exists() else "cpu"


def requirements_file(name: str, variant: str | None = None) -> Path:
    """The list environment `name` is built from on this machine (`variant`: as if it were of that variant)."""
    if name not in known():
        raise InvalidInput(f"environment: unknown environment {name!r} (known: {', '.join(known())})")
    special = _HERE / f"{name}-{variant or machine_variant()}.txt"
    return special if special.exists() else _HERE / f"{name}.txt"


def requirements_digest(name: str) -> str:
    return hashlib.sha256(requirements_file(name).read_bytes()).hexdigest()


def default_root() -> Path:
    env_root = os.environ.get("EMBER_ENV_ROOT")
    if env_root:
        return Path(env_root)
    from ember.config import default_state_dir

    return default_state_dir() / "envs"


@dataclass(frozen=True)
class EnvStatus:
    name: str
    path: Path
    built: bool
    reason: str            # why not built ("" when built)

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"


class Environments:
    """The node's environments under one root (default: `default_root()`)."""

    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root) if root is not None else default_root()

    def path(self, name: str) -> Path:
        requirements_file(name)   # an unknown name fails here, naming the known ones
        return self.root / name

    def status(self, name: str) -> EnvStatus:
        path = self.path(name)
        fix = f"run `ember env build {name}`"
        try:
            marker = json.loads((path / MARKER).read_text())
        except FileNotFoundError:
            return EnvStatus(name, path, False, f"environment {name!r} is not built on this node ({fix})")
        except (OSError, ValueError) as err:
            return EnvStatus(name, path, False, f"environment {name!r} has an unreadable marker ({err}; {fix})")
        if not isinstance(marker, dict) or marker.get("requirements_sha256") != requirements_digest(name):
            return EnvStatus(name, path, False,
                             f"environment {name!r} was built from another requirements list ({fix})")
        if not (path / "bin" / "python").exists():
            return EnvStatus(name, path, False, f"environment {name!r} has no interpreter at {path}/bin ({fix})")
        return EnvStatus(name, path, True, "")

    def python(self, name: str | None, default: str) -> str:
        """The interpreter for environment `name` (None: `default`, ember's own); ModelNotReady when not built."""
        if name is None:
            return default
        status = self.status(name)
        if not status.built:
            raise ModelNotReady(status.reason)
        return str(status.python)
