"""ggml's CPU backend for this host: one build runs on any x86-64 CPU and picks its kernels when it starts.

llama.cpp is built with `GGML_BACKEND_DL` and `GGML_CPU_ALL_VARIANTS` (the Makefile's `CMAKE_ARGS`): its CPU
backend is a loadable library per instruction-set level (`libggml-cpu-x64.so`, `-haswell`, `-icelake`, `-zen4`,
`-sapphirerapids`, ...), each with a `ggml_backend_score` that says 0 where this CPU lacks what it was built for.
`load` scores every variant and registers the best one before llama.cpp's backend starts (llama.cpp's own search
looks beside the Python executable and in the working directory, where pip puts none of them).

The `sapphirerapids` variant is the only one with AMX kernels; its AMX buffer type crashes (SIGSEGV) on batched
decode on some AMX CPUs (llama.cpp issue 20824), so it is skipped unless `EMBER_GGML_AMX=1`: an AMX host runs the
best variant below it (AVX-512 with VNNI and BF16). `EMBER_GGML_CPU=<variant>` forces one (`ember env` lists them).

A llama.cpp built the usual way (its CPU backend linked in) has its backend already: `load` then does nothing.
Loading maps libraries and starts no thread (a zygote may call it and fork).
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("ember.llm")

PREFIX, SUFFIX = "libggml-cpu-", ".so"
AMX_VARIANTS = frozenset({"sapphirerapids"})


@dataclass(frozen=True)
class CpuBackend:
    """The CPU backend a process runs: the variant's name ("built-in" when linked into libggml) and why."""

    variant: str
    path: str | None
    scores: tuple[tuple[str, int], ...]   # every variant found, with this CPU's score (0: cannot run here)
    reason: str


_LOADED: CpuBackend | None = None


def _backend_dirs(lib_dir: Path) -> tuple[Path, ...]:
    """Where a llama-cpp-python install holds ggml's backend libraries: beside the package in `llama_cpp/lib/`, and
    under the platform library's `bin/` (where scikit-build installs ggml's loadable backends)."""
    return lib_dir, lib_dir.parent.parent / "bin"


def variant_files(lib_dir: Path) -> dict[str, Path]:
    """The CPU backend variants a llama-cpp-python install holds, by name."""
    found: dict[str, Path] = {}
    for where in _backend_dirs(lib_dir):
        if where.is_dir():
            for path in sorted(where.glob(f"{PREFIX}*{SUFFIX}")):
                found.setdefault(path.name[len(PREFIX):-len(SUFFIX)], path)
    return found


def choose(scores: dict[str, int], *, allow_amx: bool, forced: str | None) -> tuple[str | None, str]:
    """The variant to load from each variant's score on this CPU, and why: the forced one if it runs here, else
    the highest-scoring one (AMX variants only if allowed)."""
    if forced:
        if scores.get(forced, 0) > 0:
            return forced, f"EMBER_GGML_CPU={forced}"
        runnable = sorted(n for n, s in scores.items() if s > 0)
        raise RuntimeError(f"EMBER_GGML_CPU={forced!r}: not a variant this CPU runs (it runs: {', '.join(runnable)})")
    usable = {n: s for n, s in scores.items() if s > 0 and (allow_amx or n not in AMX_VARIANTS)}
    if not usable:
        return None, "no CPU backend variant runs on this CPU"
    best = max(usable, key=lambda n: (usable[n], n))
    skipped = [n for n in AMX_VARIANTS if scores.get(n, 0) > usable[best] and not allow_amx]
    why = f"best score ({usable[best]})" + (f"; {', '.join(skipped)} skipped: its AMX kernels crash on batched "
                                           "decode on some CPUs (EMBER_GGML_AMX=1 allows it)" if skipped else "")
    return best, why


def _score(path: Path) -> int:
    """The variant's own score for this CPU (0: it cannot run here); the library is closed again after."""
    import _ctypes

    handle = ctypes.CDLL(str(path), mode=os.RTLD_LOCAL | os.RTLD_NOW)
    try:
        fn = handle.ggml_backend_score
        fn.restype = ctypes.c_int
        return int(fn())
    except AttributeError:
        return 0
    finally:
        _ctypes.dlclose(handle._handle)


def load() -> CpuBackend:
    """Register the CPU backend for this host in the ggml that llama-cpp-python's libllama uses, once (see the
    module docstring). ggml's functions are looked up through libllama's handle, which searches the libraries it
    was linked with: a wheel holds `libggml.so` and `libggml.so.0` as two files, and only the second is libllama's."""
    global _LOADED
    if _LOADED is not None:
        return _LOADED
    import llama_cpp.llama_cpp as low

    ggml, lib_dir = low._lib, Path(low.__file__).parent / "lib"
    ggml.ggml_backend_reg_count.restype = ctypes.c_size_t
    if ggml.ggml_backend_reg_count() > 0:
        _LOADED = CpuBackend("built-in", None, (), "llama.cpp was built with its CPU backend linked in")
        return _LOADED
    ggml.ggml_backend_load.restype = ctypes.c_void_p
    ggml.ggml_backend_load.argtypes = [ctypes.c_char_p]
    _LOADED = _register(ggml, lib_dir)
    log.info("llama.cpp: CPU backend %s (%s)", _LOADED.variant, _LOADED.reason)
    return _LOADED


def _register(ggml: Any, lib_dir: Path) -> CpuBackend:
    """Load the best variant this CPU runs into `ggml`'s registry (or the one CPU backend a build without variants
    has)."""
    files = variant_files(lib_dir)
    if not files:   # loadable backends, but not one per level
        plain = next((d / "libggml-cpu.so" for d in _backend_dirs(lib_dir) if (d / "libggml-cpu.so").exists()), None)
        if plain is None or not ggml.ggml_backend_load(str(plain).encode()):
            raise RuntimeError(f"llama.cpp: no CPU backend found beside {lib_dir} (libggml-cpu*.so)")
        return CpuBackend("cpu", str(plain), (), "the one CPU backend this build has")
    scores = {name: _score(path) for name, path in files.items()}
    best, why = choose(scores, allow_amx=os.environ.get("EMBER_GGML_AMX") == "1",
                       forced=os.environ.get("EMBER_GGML_CPU") or None)
    if best is None:
        raise RuntimeError(f"llama.cpp: {why} (variants found: {', '.join(sorted(files))} in {lib_dir})")
    if not ggml.ggml_backend_load(str(files[best]).encode()):
        raise RuntimeError(f"llama.cpp: could not load its CPU backend {files[best]}")
    return CpuBackend(best, str(files[best]), tuple(sorted(scores.items())), why)


def loaded() -> CpuBackend | None:
    return _LOADED
