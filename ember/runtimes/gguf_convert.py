"""GGUF -> a converted model directory, once per file: the `llm` runtime's cache.

A GGUF file holds quantised weights (SmolLM2's: Q4_1 and Q8_0 blocks) and, as metadata, the model's
hyper-parameters, its tokenizer and its chat template. De-quantising it takes seconds, so it is done
once and the result kept, in the directory transformers would write for the model:

    <root>/converted/<key>/
        config.json            a LlamaConfig (hyper-parameters from the GGUF metadata)
        model.safetensors      the de-quantised weights, in the runtime's dtype (mmapped by every later load)
        tokenizer.json         the fast tokenizer transformers builds from the GGUF vocabulary and merges
        chat_template.jinja    `tokenizer.chat_template` from the metadata
        generation.json        bos/eos ids, add_bos_token, the context length
        ember.json             what was converted: the source file, its key, the converter version, timings

`<root>` is the weight store's root (`$EMBER_STORE`, else ~/.cache/ember/store). `<key>` hashes the GGUF's
size, mtime and the sha256 of its first MiB with the converter version and dtype: a changed file, a new
converter or another dtype converts again. A conversion is written to a temporary sibling directory and
renamed into place, so loaders racing on the same file never see half a directory (the loser drops its copy).

Fork safety: this module does no torch math. De-quantisation is numpy (the `gguf` package's reader and
`dequantize`), bf16 rounding is done on the float32 bits in numpy, and the safetensors file is written by
hand, so a template process that converts still forks cleanly (no intra-op thread pool is started).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import struct
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ember.errors import ModelNotReady

CONVERTER_VERSION = 1
FILES = ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja", "generation.json", "ember.json")
_HEAD_BYTES = 1 << 20

# llama.cpp's tensor names -> transformers' LlamaForCausalLM names ("{i}": the block index).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def cache_key(gguf: Path, dtype: str) -> str:
    """The file's identity (size, mtime, first MiB) with the converter version and the dtype."""
    st = gguf.stat()
    digest = hashlib.sha256()
    with gguf.open("rb") as f:
        digest.update(f.read(_HEAD_BYTES))
    ident = f"{st.st_size}:{st.st_mtime_ns}:{digest.hexdigest()}:v{CONVERTER_VERSION}:{dtype}"
    return f"{gguf.stem[:40]}-{hashlib.sha256(ident.encode()).hexdigest()[:20]}"


def converted_dir(gguf: Path, root: Path, dtype: str) -> Path:
    """The converted directory of `gguf` under `root`, converting first if no loader did yet."""
    try:
        target = root / "converted" / cache_key(gguf, dtype)
    except OSError as err:
        raise ModelNotReady(f"{gguf}: cannot read it: {err.strerror}") from None
    if _complete(target):
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        build = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    except OSError as err:
        raise ModelNotReady(f"{gguf}: cannot write its conversion under {target.parent}: {err.strerror}") from None
    try:
        os.chmod(build, 0o755)   # mkdtemp makes it 0700: other users of the root read it too
        try:
            convert(gguf, build, dtype, target.name)
        except OSError as err:   # a full disk, a read-only root
            raise ModelNotReady(f"{gguf}: cannot write its conversion to {build}: {err}") from None
        try:
            os.rename(build, target)
        except OSError:   # another loader renamed its copy first, or a broken leftover is in the way
            if not _complete(target):
                shutil.rmtree(target, ignore_errors=True)
                with contextlib.suppress(OSError):
                    os.rename(build, target)
            if not _complete(target):
                raise ModelNotReady(f"{gguf}: cannot put its conversion at {target}") from None
    finally:
        shutil.rmtree(build, ignore_errors=True)   # gone after a rename; a loser's (or a failed) copy otherwise
    return target


def _complete(target: Path) -> bool:
    return all((target / name).is_file() for name in FILES)


def convert(gguf: Path, out: Path, dtype: str, key: str = "") -> None:
    """Write the converted directory for `gguf` (cache key `key`) into `out`, an existing empty directory."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    started = time.perf_counter()
    try:
        reader = GGUFReader(gguf)
    except (OSError, ValueError) as err:
        raise ModelNotReady(f"{gguf}: not a readable GGUF file: {err}") from None
    meta = {name: _value(field) for name, field in reader.fields.items() if not name.startswith("tokenizer.ggml.")}
    meta.update({name: reader.fields[name].contents() for name in reader.fields
                 if name.startswith("tokenizer.ggml.") and name.endswith("_id")})
    meta["tokenizer.ggml.add_bos_token"] = _value(reader.fields.get("tokenizer.ggml.add_bos_token"))
    names = [t.name for t in reader.tensors]
    config = llama_config(meta, names, str(gguf))
    config["dtype"] = dtype
    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        hf_name = hf_tensor_name(t.name)
        if hf_name is None:
            raise ModelNotReady(f"{gguf}: tensor {t.name!r} has no place in a Llama model")
        weights = dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))
        if t.name.endswith("attn_q.weight"):
            weights = unpermute_rope(weights, config["num_attention_heads"])
        elif t.name.endswith("attn_k.weight"):
            weights = unpermute_rope(weights, config["num_key_value_heads"])
        tensors[hf_name] = np.ascontiguousarray(weights, dtype=np.float32)
    dequantised = time.perf_counter()
    write_safetensors(out / "model.safetensors", tensors, dtype)
    del tensors
    _write_tokenizer(gguf, out)
    template = meta.get("tokenizer.chat_template")
    if not isinstance(template, str) or not template.strip():
        raise ModelNotReady(f"{gguf}: the metadata has no tokenizer.chat_template")
    (out / "chat_template.jinja").write_text(template)
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                             "tokenizer.ggml.eom_token_id") if isinstance(meta.get(k), int)]
    generation = {"bos_token_id": meta.get("tokenizer.ggml.bos_token_id"), "eos_token_ids": sorted(set(eos)),
                  "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token") or False),
                  "context_length": config["max_position_embeddings"]}
    (out / "generation.json").write_text(json.dumps(generation, indent=1))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "ember.json").write_text(json.dumps({
        "source": str(gguf), "key": key or out.name, "converter_version": CONVERTER_VERSION, "dtype": dtype,
        "dequantise_s": round(dequantised - started, 3), "total_s": round(time.perf_counter() - started, 3),
    }, indent=1))


def llama_config(meta: dict[str, Any], tensor_names: list[str], where: str) -> dict[str, Any]:
    """The LlamaConfig dict the metadata describes (ModelNotReady for what this converter cannot serve)."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ModelNotReady(f"{where}: general.architecture {arch!r} is not supported (supported: llama)")
    if meta.get("llama.rope.scaling.type") not in (None, "none"):
        raise ModelNotReady(f"{where}: llama.rope.scaling.type {meta['llama.rope.scaling.type']!r} is not supported")

    def need(key: str) -> Any:
        if f"llama.{key}" not in meta:
            raise ModelNotReady(f"{where}: the metadata has no llama.{key}")
        return meta[f"llama.{key}"]

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    vocab = meta.get("llama.vocab_size")
    if vocab is None:
        raise ModelNotReady(f"{where}: the metadata has no llama.vocab_size")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": int(vocab), "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)),
        "head_dim": int(meta.get("llama.attention.key_length", hidden // heads)),
        "max_position_embeddings": int(need("context_length")),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }


def hf_tensor_name(name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (None: not a Llama tensor)."""
    stem, _, kind = name.rpartition(".")
    if kind not in ("weight", "bias"):
        return None
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{kind}"
    return None


def unpermute_rope(weights: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's row order for q/k projections (it interleaves each head's rotary halves)."""
    half = weights.shape[0] // heads // 2
    return weights.reshape(heads, half, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def to_bf16_bits(array: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even like torch's `.to(torch.bfloat16)`."""
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return np.where(np.isnan(array), np.uint32(0x7FC0), rounded).astype(np.uint16)


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype: str) -> None:
    """A safetensors file of float32 arrays, stored as F32 or BF16 (written by hand: numpy has no bfloat16)."""
    tag = {"float32": "F32", "bfloat16": "BF16"}[dtype]
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    payloads, offset = [], 0
    for name in sorted(tensors):
        array = tensors[name]
        data = to_bf16_bits(array) if dtype == "bfloat16" else np.ascontiguousarray(array, dtype="<f4")
        header[name] = {"dtype": tag, "shape": list(array.shape), "data_offsets": [offset, offset + data.nbytes]}
        payloads.append(data)
        offset += data.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)   # the data starts 8-byte aligned
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for data in payloads:
            f.write(data.tobytes())


def _write_tokenizer(gguf: Path, out: Path) -> None:
    """transformers' GGUF tokenizer conversion (vocabulary, merges, special tokens), saved as tokenizer.json."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as err:  # transformers raises ValueError, KeyError, ... for a tokenizer it cannot build
        raise ModelNotReady(f"{gguf}: cannot build its tokenizer: {type(err).__name__}: {err}") from None
    tokenizer.backend_tokenizer.save(str(out / "tokenizer.json"))


def _value(field: Any) -> Any:
    if field is None:
        return None
    with contextlib.suppress(Exception):
        value = field.contents()
        return value if not isinstance(value, list) or len(value) <= 64 else None   # token tables: not here
    return None
