"""Batched Llama decoding over per-sequence KV slots: the math behind continuous batching.

transformers' Llama runs one batch whose rows share a length; continuous batching needs rows of different
lengths that join and leave between steps. So the forward pass is written here over the tensors of a loaded
`LlamaForCausalLM` (the same weights, mmapped; no copy): a decode step is one pass for every running sequence,
each at its own position, attending to its own slot of a shared KV buffer through a mask. A prefill fills one
slot with a prompt chunk. The model is memory-bound when decoding (each step reads every weight once), so B
sequences in one step cost little more than one. Greedy output equals transformers' `generate` token for
token (tests/integration/runtimes/test_llm_parity.py).

KV layout: per layer one key and one value tensor of [slots, kv_heads, capacity, head_dim]; running sequences
occupy slots 0..n-1 (a leaving one is replaced by the last, so a step's rows are a prefix of the buffer: views,
no gather). Capacity doubles when a sequence outgrows it; the buffers are reused, never freed, as first touch
of fresh memory is slow on these VMs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Layer:
    input_norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    post_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


class LlamaWeights:
    """The tensors of a loaded LlamaForCausalLM and the few numbers the forward pass needs."""

    def __init__(self, model: Any) -> None:
        config, core = model.config, model.model
        self.layers = [Layer(m.input_layernorm.weight, m.self_attn.q_proj.weight, m.self_attn.k_proj.weight,
                             m.self_attn.v_proj.weight, m.self_attn.o_proj.weight,
                             m.post_attention_layernorm.weight, m.mlp.gate_proj.weight, m.mlp.up_proj.weight,
                             m.mlp.down_proj.weight) for m in core.layers]
        if any(getattr(m.self_attn.q_proj, "bias", None) is not None for m in core.layers):
            raise ValueError("attention biases are not supported")
        self.embed = core.embed_tokens.weight
        self.norm = core.norm.weight
        self.lm_head = model.lm_head.weight
        self.eps = float(config.rms_norm_eps)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.inv_freq = core.rotary_emb.inv_freq.float()
        self.rope_scale = float(getattr(core.rotary_emb, "attention_scaling", 1.0))
        self.dtype = self.embed.dtype


class KVSlots:
    """Key/value buffers for up to `slots` sequences; `lengths[i]` tokens of slot i are valid."""

    def __init__(self, weights: LlamaWeights, slots: int, capacity: int = 64) -> None:
        self.w, self.slots, self.capacity = weights, slots, 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.lengths = [0] * slots
        self.reserve(capacity)

    @property
    def bytes_per_token(self) -> int:
        return 2 * len(self.w.layers) * self.w.kv_heads * self.w.head_dim * self.w.embed.element_size()

    def reserve(self, tokens: int) -> None:
        """Room for `tokens` positions in every slot (capacity doubles; contents are kept)."""
        import torch

        if tokens <= self.capacity:
            return
        capacity = max(tokens, 2 * self.capacity, 64)
        shape = (self.slots, self.w.kv_heads, capacity, self.w.head_dim)
        for store in (self.keys, self.values):
            for i in range(len(self.w.layers)):
                fresh = torch.zeros(shape, dtype=self.w.dtype)
                if store[i:]:
                    fresh[:, :, : self.capacity] = store[i]
                    store[i] = fresh
                else:
                    store.append(fresh)
        self.capacity = capacity

    def move(self, src: int, dst: int) -> None:
        """Slot `src`'s contents into slot `dst` (a leaving sequence's slot is refilled by the last one)."""
        n = self.lengths[src]
        for store in (self.keys, self.values):
            for t in store:
                t[dst, :, :n] = t[src, :, :n]
        self.lengths[dst] = n

    def export(self, slot: int, n: int) -> torch.Tensor:
        """The first `n` positions of a slot as one tensor [layers, 2, kv_heads, n, head_dim] (a copy)."""
        import torch

        return torch.stack([torch.stack([k[slot, :, :n], v[slot, :, :n]]) for k, v in zip(self.keys, self.values,
                                                                                            strict=True)])

    def restore(self, slot: int, kv: torch.Tensor) -> None:
        """Fill the first positions of a slot from an `export`ed tensor (a prefix-cache hit)."""
        n = kv.shape[3]
        self.reserve(n)
        for i, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            k[slot, :, :n] = kv[i, 0]
            v[slot, :, :n] = kv[i, 1]
        self.lengths[slot] = n


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    import torch

    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    import torch

    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _rope(w: LlamaWeights, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for `positions` [B, T], shaped [B, 1, T, head_dim] (as transformers computes them)."""
    import torch

    freqs = positions.float()[..., None] * w.inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * w.rope_scale, emb.sin() * w.rope_scale
    return cos.to(w.dtype)[:, None], sin.to(w.dtype)[:, None]


def _layers(w: LlamaWeights, kv: KVSlots, x: torch.Tensor, positions: torch.Tensor, write: Any,
            attend: Any) -> torch.Tensor:
    """The decoder layers over hidden states x [B, T, hidden]; `write(i, k, v)` stores the new keys and
    values of layer i, `attend(i, q)` returns the attention output [B, heads, T, head_dim]."""
    import torch.nn.functional as F

    b, t, _ = x.shape
    cos, sin = _rope(w, positions)
    for i, layer in enumerate(w.layers):
        h = _rms(x, layer.input_norm, w.eps)
        q = F.linear(h, layer.q).view(b, t, w.heads, w.head_dim).transpose(1, 2)
        k = F.linear(h, layer.k).view(b, t, w.kv_heads, w.head_dim).transpose(1, 2)
        v = F.linear(h, layer.v).view(b, t, w.kv_heads, w.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        write(i, k, v)
        out = attend(i, q).transpose(1, 2).reshape(b, t, w.heads * w.head_dim)
        x = x + F.linear(out, layer.o)
        h = _rms(x, layer.post_norm, w.eps)
        x = x + F.linear(F.silu(F.linear(h, layer.gate)) * F.linear(h, layer.up), layer.down)
    return x


def _logits(w: LlamaWeights, x: torch.Tensor) -> torch.Tensor:
    import torch.nn.functional as F

    return F.linear(_rms(x, w.norm, w.eps), w.lm_head).float()


def prefill(w: LlamaWeights, kv: KVSlots, slot: int, ids: list[int]) -> torch.Tensor:
    """Append prompt tokens `ids` to slot `slot` (after its valid positions); the logits after the last one."""
    import torch
    import torch.nn.functional as F

    start, t = kv.lengths[slot], len(ids)
    kv.reserve(start + t)
    positions = torch.arange(start, start + t)[None]
    # Query j (absolute position start + j) sees keys 0 .. start + j.
    mask = torch.arange(start + t)[None, :] <= positions[0][:, None]

    def write(i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        kv.keys[i][slot, :, start:start + t] = k[0]
        kv.values[i][slot, :, start:start + t] = v[0]

    def attend(i: int, q: torch.Tensor) -> torch.Tensor:
        keys = kv.keys[i][slot:slot + 1, :, :start + t]
        values = kv.values[i][slot:slot + 1, :, :start + t]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)

    with torch.inference_mode():
        x = _layers(w, kv, F.embedding(torch.tensor([ids]), w.embed), positions, write, attend)
        kv.lengths[slot] = start + t
        return _logits(w, x[:, -1])[0]


def decode(w: LlamaWeights, kv: KVSlots, tokens: list[int]) -> torch.Tensor:
    """One step for the sequences in slots 0..len(tokens)-1, each fed its token; logits [B, vocab]."""
    import torch
    import torch.nn.functional as F

    b = len(tokens)
    lengths = torch.tensor(kv.lengths[:b])
    longest = int(lengths.max()) + 1
    kv.reserve(longest)
    rows = torch.arange(b)
    mask = (torch.arange(longest)[None, :] <= lengths[:, None])[:, None, None, :]   # [B, 1, 1, L]

    def write(i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        kv.keys[i][rows, :, lengths] = k[:, :, 0]
        kv.values[i][rows, :, lengths] = v[:, :, 0]

    def attend(i: int, q: torch.Tensor) -> torch.Tensor:
        keys, values = kv.keys[i][:b, :, :longest], kv.values[i][:b, :, :longest]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)

    with torch.inference_mode():
        x = _layers(w, kv, F.embedding(torch.tensor(tokens)[:, None], w.embed), lengths[:, None], write, attend)
        for i in range(b):
            kv.lengths[i] += 1
        return _logits(w, x[:, -1])
