"""Options whose kernels depend on this CPU, tried in a child process once per host and remembered.

llama.cpp's repacked weights (`repack`, its "extra buffer types") run kernels chosen for this CPU; on some CPUs
they crash the process on batched decode (SIGSEGV: the AMX buffer type, llama.cpp issue 20824). A crash would kill
a template and leave its model UNAVAILABLE, so before a load repacks, a child process (`python -m
ember.runtimes.cpu_probe repack GGUF`) loads the same file the same way and decodes a batch on one thread and on
every core. Its verdict is kept under `probes/` beside the weight store, keyed by the CPU (model and flags), the
llama.cpp build, the CPU backend variant and the file (path, size, mtime): later loads on this host read it. A
failed probe turns the option off for that load, with the reason in the log.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("ember.llm")

PROBE_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str


def host_key() -> str:
    """What a probe's verdict depends on besides its file: the CPU, the llama.cpp build, the variant overrides."""
    cpu = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))]
        cpu = "".join(sorted(set(lines)))
    except OSError:
        pass
    try:
        from importlib.metadata import version

        build = version("llama_cpp_python")
    except Exception:   # not installed: the probe itself will say so
        build = "?"
    env = f"{os.environ.get('EMBER_GGML_CPU', '')}|{os.environ.get('EMBER_GGML_AMX', '')}"
    return hashlib.sha256(f"{cpu}\0{build}\0{env}".encode()).hexdigest()[:24]


def _file_key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}"


# What a probe's death by signal says of the kernels: these are remembered; anything else (SIGKILL: the OOM killer,
# a stop) says nothing of them, and the probe runs again next time.
CRASHES = frozenset({signal.SIGSEGV, signal.SIGILL, signal.SIGBUS, signal.SIGABRT, signal.SIGFPE})


def _why(rc: int, stderr: str) -> str:
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        return f"the probe process died of {name}"
    tail = [line for line in stderr.strip().splitlines() if line.strip()]
    return f"the probe exited with status {rc}" + (f": {tail[-1][-300:]}" if tail else "")


def probe(kind: str, target: Path, cache_dir: Path, *, command: Sequence[str] | None = None,
          timeout_s: float = PROBE_TIMEOUT_S) -> Verdict:
    """The verdict on option `kind` for `target` on this host: remembered, else tried in a child process."""
    key = hashlib.sha256(f"{kind}\0{host_key()}\0{_file_key(target)}".encode()).hexdigest()[:32]
    kept = cache_dir / f"{kind}-{key}.json"
    try:
        data = json.loads(kept.read_text())
        return Verdict(bool(data["ok"]), str(data["reason"]))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    argv = list(command or (sys.executable, "-m", "ember.runtimes.cpu_probe", kind, str(target)))
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              timeout=timeout_s, check=False, text=True, errors="replace")
        verdict = Verdict(True, "the probe decoded a batch") if done.returncode == 0 else \
            Verdict(False, _why(done.returncode, done.stderr))
    except subprocess.TimeoutExpired:   # not remembered: a slow host says nothing of the kernels
        return Verdict(False, f"the probe did not finish in {timeout_s:g} s")
    except OSError as err:
        return Verdict(False, f"the probe could not start: {err}")   # not remembered: nothing was learned
    if done.returncode < 0 and -done.returncode not in CRASHES:
        return verdict   # killed from outside: not remembered
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = kept.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"ok": verdict.ok, "reason": verdict.reason, "kind": kind, "file": str(target)}))
        os.replace(tmp, kept)
    except OSError as err:
        log.warning("cpu probe: could not keep the verdict in %s: %s", cache_dir, err)
    return verdict


def repack_allowed(gguf: Path, cache_dir: Path) -> bool:
    """Whether a load of `gguf` may repack its weights here; logs why not."""
    verdict = probe("repack", gguf, cache_dir)
    if not verdict.ok:
        log.warning("repack: off for %s on this host (%s); its weights are mapped as they are", gguf.name,
                    verdict.reason)
    return verdict.ok


def _try_repack(gguf: Path) -> None:
    """Load `gguf` repacked and decode a batch of its tokens on one thread, then on every core."""
    from ember.runtimes.llamacpp import LlamaCppModel

    model = LlamaCppModel(gguf, repack=True)
    lib = model.lib
    tokens = (model.tokenize("The quick brown fox jumps over the lazy dog, twice over.", special=False) * 4)[:32]
    for threads in sorted({1, len(os.sched_getaffinity(0)) or 1}):
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = 64, 64, 64
        params.n_threads = params.n_threads_batch = threads
        ctx = lib.llama_init_from_model(model.model, params)
        if not ctx:
            raise SystemExit("llama.cpp could not open a context")
        ids = (lib.llama_token * len(tokens))(*tokens)
        rc = lib.llama_decode(ctx, lib.llama_batch_get_one(ids, len(tokens)))
        lib.llama_free(ctx)
        if rc != 0:
            raise SystemExit(f"llama_decode returned {rc}")
    model.close()


def main(argv: Sequence[str]) -> int:
    if len(argv) != 2 or argv[0] != "repack":
        print("usage: python -m ember.runtimes.cpu_probe repack GGUF", file=sys.stderr)
        return 2
    _try_repack(Path(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
