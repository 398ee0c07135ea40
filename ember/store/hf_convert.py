"""A Hugging Face model directory (config.json, *.safetensors, tokenizer files) to one GGUF file, with llama.cpp's
own converter, for `ember store push DIR NAME` (docs/llm.md, "Weights").

The converter, `convert_hf_to_gguf.py` with the `conversion/` package and `gguf-py` it imports, ships in
llama-cpp-python's sdist, not in its wheel: `make install` extracts it from the sdist of the installed version into
`<venv>/share/ember/llama-convert` ($EMBER_LLAMA_CONVERT names another directory). It runs in a subprocess with
this interpreter (it imports torch and transformers; this module does not), offline.

A conversion is cached under `out_dir/<key>/`, the key a hash of the directory's files (their relative paths and
contents), the output type and the converter script: pushing the same directory again reuses the file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from ember.errors import InvalidInput, StoreError

CONVERTER_ENV = "EMBER_LLAMA_CONVERT"
SCRIPT = "convert_hf_to_gguf.py"
OUTTYPES = ("q8_0", "f16", "bf16", "f32", "auto")
# What a generative model's config.json names in "architectures" (LlamaForCausalLM, Gemma3ForConditionalGeneration,
# GPT2LMHeadModel): an encoder (BertModel, ...) is pushed as it is, for the embedding runtime.
_GENERATIVE = ("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")
_WEIGHTS = ("*.safetensors", "pytorch_model*.bin")


def _config(path: Path) -> dict[str, object] | None:
    try:
        data = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _architectures(config: dict[str, object]) -> list[str]:
    names = config.get("architectures")
    text = config.get("text_config")
    if not names and isinstance(text, dict):
        names = text.get("architectures")
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []


def is_hf_dir(path: Path) -> bool:
    """A directory whose config.json names a generative (text-generating) Hugging Face architecture: the kind
    `ember store push` converts to GGUF for the llm runtime."""
    if not path.is_dir():
        return False
    config = _config(path)
    return config is not None and any(a.endswith(_GENERATIVE) for a in _architectures(config))


def converter() -> Path:
    """llama.cpp's convert_hf_to_gguf.py: in $EMBER_LLAMA_CONVERT (a directory, or the script), else where
    `make install` puts it, `<sys.prefix>/share/ember/llama-convert`."""
    env = os.environ.get(CONVERTER_ENV)
    where = Path(env) if env else Path(sys.prefix) / "share" / "ember" / "llama-convert"
    script = where if where.suffix == ".py" else where / SCRIPT
    if not script.is_file():
        hint = f"${CONVERTER_ENV}={env}" if env else "`make install` (after `rm .venv/.installed` in an older venv)"
        raise StoreError(f"llama.cpp's converter {script} is missing: {hint} extracts it from llama-cpp-python's "
                         f"sdist")
    return script


def _files(hf_dir: Path) -> list[Path]:
    """The directory's files, symlinks followed (a Hugging Face cache snapshot links its blobs), hidden ones left."""
    return sorted(p for p in hf_dir.rglob("*") if p.is_file()
                  and not any(part.startswith(".") for part in p.relative_to(hf_dir).parts))


def content_key(hf_dir: Path, outtype: str, script: Path) -> str:
    """The cache key: the files' relative paths and contents, the output type, the converter script."""
    import blake3

    from ember.store.hashing import digest_file

    h = blake3.blake3()
    h.update(f"{outtype}\0{digest_file(script)}\0".encode())
    for f in _files(hf_dir):
        h.update(f"{f.relative_to(hf_dir).as_posix()}\0{f.stat().st_size}\0{digest_file(f)}\0".encode())
    return h.hexdigest()[:32]


def check(hf_dir: Path) -> None:
    """Refuse, naming what is missing, a directory the converter could not take."""
    if not hf_dir.is_dir():
        raise InvalidInput(f"convert: {hf_dir} is not a directory")
    if not (hf_dir / "config.json").is_file():
        raise InvalidInput(f"convert: {hf_dir} has no config.json: not a Hugging Face model directory")
    config = _config(hf_dir)
    if config is None:
        raise InvalidInput(f"convert: {hf_dir / 'config.json'} is not a JSON object")
    if not _architectures(config):
        raise InvalidInput(f"convert: {hf_dir / 'config.json'} names no architecture (\"architectures\")")
    if not any(any(hf_dir.glob(pattern)) for pattern in _WEIGHTS):
        raise InvalidInput(f"convert: {hf_dir} holds no weights ({' or '.join(_WEIGHTS)})")


def convert(hf_dir: Path, out_dir: Path, outtype: str = "q8_0", timeout: float | None = None,
            say: Callable[[str], None] = lambda _: None) -> Path:
    """Convert `hf_dir` to `out_dir/<key>/model-<outtype>.gguf` with llama.cpp's converter, or return the file an
    earlier call wrote; `say` hears which. The converter's own error (an architecture it does not know, a missing
    tokenizer, ...) is passed on in an InvalidInput; its whole log is kept beside the output, in convert.log."""
    if outtype not in OUTTYPES:
        raise InvalidInput(f"convert: outtype {outtype!r} is not one of {', '.join(OUTTYPES)}")
    hf_dir = hf_dir.resolve()
    check(hf_dir)
    script = converter()
    target = out_dir / content_key(hf_dir, outtype, script)
    gguf = target / f"model-{outtype}.gguf"
    if gguf.is_file():
        say(f"{hf_dir}: the cached conversion {gguf}")
        return gguf
    target.mkdir(parents=True, exist_ok=True)
    log = target / "convert.log"
    say(f"converting {hf_dir} to GGUF ({outtype}) with llama.cpp's converter (its log: {log})")
    fd, tmp_name = tempfile.mkstemp(prefix=".convert-", suffix=".gguf", dir=target)
    os.close(fd)
    tmp = Path(tmp_name)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONUNBUFFERED": "1"}
    env.pop("NO_LOCAL_GGUF", None)   # the converter's own gguf-py, which matches it, before the installed gguf
    try:
        with open(log, "wb") as out:
            done = subprocess.run([sys.executable, str(script), str(hf_dir), "--outfile", str(tmp),
                                   "--outtype", outtype], stdout=out, stderr=subprocess.STDOUT, env=env,
                                  cwd=target, timeout=timeout, check=False)
        if done.returncode != 0:
            raise InvalidInput(f"convert: llama.cpp's converter could not convert {hf_dir}: "
                               f"{_reason(log.read_text(errors='replace'))} (its log: {log})")
        if not tmp.is_file() or tmp.stat().st_size == 0:
            raise StoreError(f"convert: llama.cpp's converter wrote no file for {hf_dir} (its log: {log})")
        tmp.chmod(0o644)   # mkstemp's file is the owner's only
        os.replace(tmp, gguf)
    except subprocess.TimeoutExpired as err:
        raise StoreError(f"convert: llama.cpp's converter ran past {timeout} s on {hf_dir} (its log: {log})") \
            from err
    finally:
        tmp.unlink(missing_ok=True)
    return gguf


def _reason(output: str) -> str:
    """The converter's error, from its log: its ERROR lines, else the exception a traceback ended with."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line.split(":", 2)[-1].strip() for line in lines if line.startswith("ERROR:")]
    if errors:
        return "; ".join(errors)
    for line in reversed(lines):
        if not line.startswith(("INFO:", "WARNING:", "DEBUG:")) and not line.startswith("File "):
            return line
    return "it exited with an error and said nothing"

