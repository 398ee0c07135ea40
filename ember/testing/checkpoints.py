"""Synthetic safetensors checkpoints with realistic LLM tensor shapes and random bytes, for store tests and benches.

Written tensor by tensor from a reused buffer, so a 4 GiB checkpoint needs a few MiB of memory. Each tensor's
bytes come from its own seed: two checkpoints share a tensor's bytes exactly when they share its seed.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

_ITEMSIZE = {"F16": 2, "BF16": 2, "F32": 4}
_BLOCK = 8 << 20


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str
    seed: int

    @property
    def nbytes(self) -> int:
        n = _ITEMSIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n


def llm_specs(total_bytes: int, hidden: int = 2048, intermediate: int = 5632, kv: int = 256, vocab: int = 32000,
              dtype: str = "F16", seed: int = 0) -> list[TensorSpec]:
    """A decoder-only model (embedding, attention with grouped KV, gated MLP, norms) cut to about `total_bytes`."""
    specs = [TensorSpec("model.embed_tokens.weight", (vocab, hidden), dtype, seed)]
    layer_shapes = [
        ("self_attn.q_proj.weight", (hidden, hidden)), ("self_attn.k_proj.weight", (kv, hidden)),
        ("self_attn.v_proj.weight", (kv, hidden)), ("self_attn.o_proj.weight", (hidden, hidden)),
        ("mlp.gate_proj.weight", (intermediate, hidden)), ("mlp.up_proj.weight", (intermediate, hidden)),
        ("mlp.down_proj.weight", (hidden, intermediate)), ("input_layernorm.weight", (hidden,)),
        ("post_attention_layernorm.weight", (hidden,)),
    ]
    layer = 0
    while sum(s.nbytes for s in specs) < total_bytes:
        for suffix, shape in layer_shapes:
            specs.append(TensorSpec(f"model.layers.{layer}.{suffix}", shape, dtype, seed * 1_000_003 + len(specs)))
        layer += 1
    specs.append(TensorSpec("model.norm.weight", (hidden,), dtype, seed * 1_000_003 + len(specs)))
    return specs


def small_specs(seed: int = 0, layers: int = 4, hidden: int = 256) -> list[TensorSpec]:
    """A few MB: enough tensors and sizes to exercise chunking, dedupe and eviction quickly."""
    layer_bytes = 2 * (2 * hidden * hidden + 2 * (hidden // 4) * hidden + 3 * 3 * hidden * hidden + 2 * hidden)
    return llm_specs(2 * 1000 * hidden + layers * layer_bytes - 1, hidden=hidden, intermediate=hidden * 3,
                     kv=hidden // 4, vocab=1000, seed=seed)


def fine_tune(base: list[TensorSpec], changed_fraction: float, seed: int = 10_000) -> list[TensorSpec]:
    """A derived checkpoint: about `changed_fraction` of the bytes new, an extra tensor first (every offset moves)."""
    total = sum(s.nbytes for s in base)
    out = [TensorSpec("lora.extra", (64, 64), base[0].dtype, seed)]
    changed = 0
    for i, spec in enumerate(reversed(base)):
        if changed + spec.nbytes <= changed_fraction * total and spec.nbytes > 0 and i % 2 == 0:
            spec = replace(spec, seed=seed + 1 + i)
            changed += spec.nbytes
        out.append(spec)
    return [out[0], *reversed(out[1:])]


def write_checkpoint(path: Path, specs: list[TensorSpec], metadata: dict[str, str] | None = None) -> Path:
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for spec in specs:
        header[spec.name] = {"dtype": spec.dtype, "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep tensor data 8-byte aligned, as safetensors does
    buf = np.empty(_BLOCK // 8, dtype=np.float64)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for spec in specs:
            rng = np.random.default_rng(spec.seed)
            left = spec.nbytes
            while left:
                rng.random(out=buf)
                n = min(left, _BLOCK)
                # Random bits make NaNs too; keep values finite so tensors compare equal to themselves.
                raw = buf.view(np.uint16)[: n // 2] & np.uint16(0x3BFF)
                f.write(raw.tobytes())
                left -= n
    return path


def mismatches(expected: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ in name, dtype, shape or any bit (empty when the two are bit-for-bit equal)."""
    bad = sorted(set(expected) ^ set(got))
    for name in set(expected) & set(got):
        a, b = expected[name], got[name]
        same = a.dtype == b.dtype and a.shape == b.shape
        if not (same and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))):
            bad.append(name)
    return bad
