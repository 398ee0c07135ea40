"""A BERT encoder in plain torch, for inference only (no transformers import).

Enough of BERT for sentence-transformers checkpoints such as all-MiniLM-L6-v2: absolute position
embeddings, post-LayerNorm self-attention blocks, GELU feed-forward. No dropout (inference only) and
no pooler (sentence-transformers pools the token states itself).

Submodule names mirror the Hugging Face checkpoint keys (`encoder.layer.0.attention.self.query.weight`)
so a safetensors state dict maps onto the module one to one. `build_encoder` constructs the module with
storage-less meta parameters (no random init runs) and then *assigns* the given tensors, so no weight
is copied: tensors mmapped from a safetensors file stay mmapped. Building does no tensor math, so it is
safe in a process that will fork (the intra-op thread pool is not started).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from torch import nn

_ACTIVATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


class BertConfig(BaseModel):
    """The fields of a Hugging Face BERT config.json that the encoder uses (others are ignored)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    hidden_act: str = "gelu"
    max_position_embeddings: int = Field(default=512, gt=0)
    type_vocab_size: int = Field(default=2, gt=0)
    layer_norm_eps: float = Field(default=1e-12, gt=0)
    pad_token_id: int = Field(default=0, ge=0)
    position_embedding_type: str = "absolute"
    model_type: str = "bert"

    @field_validator("hidden_act")
    @classmethod
    def _act(cls, value: str) -> str:
        if value not in _ACTIVATIONS:
            raise ValueError(f"activation {value!r} is not supported (supported: {', '.join(_ACTIVATIONS)})")
        return value

    @field_validator("position_embedding_type")
    @classmethod
    def _positions(cls, value: str) -> str:
        if value != "absolute":
            raise ValueError(f"position embeddings {value!r} are not supported (only 'absolute')")
        return value

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def parse(cls, data: Any) -> BertConfig:
        """Validate a config.json mapping; ValueError names each bad key."""
        try:
            config = cls.model_validate(data)
        except ValidationError as err:
            parts = [f"{'.'.join(str(p) for p in e['loc']) or '(config)'}: {e['msg']}" for e in err.errors()]
            raise ValueError("; ".join(parts)) from None
        if config.hidden_size % config.num_attention_heads:
            raise ValueError(
                f"hidden_size ({config.hidden_size}) is not a multiple of "
                f"num_attention_heads ({config.num_attention_heads})"
            )
        return config


def _empty(*shape: int) -> nn.Parameter:
    # Meta tensors have a shape and no storage; build_encoder assigns the real tensors over them.
    return nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)


class _Linear(nn.Module):
    """nn.Linear without its init: torch's init on meta tensors imports torch._dynamo (over a second)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = _empty(n_out, n_in)
        self.bias = _empty(n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class _Embedding(nn.Module):
    def __init__(self, rows: int, width: int) -> None:
        super().__init__()
        self.weight = _empty(rows, width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class _LayerNorm(nn.Module):
    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _empty(width)
        self.bias = _empty(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class _Embeddings(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = _Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = _Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = _Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = _LayerNorm(config.hidden_size, config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        x = x + self.position_embeddings(positions)[None]
        return self.LayerNorm(x)


class _SelfAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.heads = config.num_attention_heads
        self.query = _Linear(config.hidden_size, config.hidden_size)
        self.key = _Linear(config.hidden_size, config.hidden_size)
        self.value = _Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, self.heads, hidden // self.heads).transpose(1, 2)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        # mask: [batch, 1, 1, length], True where the key is a real token (never all False: [CLS] is real).
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2).reshape(batch, length, hidden)


class _DenseNorm(nn.Module):
    """Projection, residual add, LayerNorm (BERT's `*.output` blocks)."""

    def __init__(self, n_in: int, config: BertConfig) -> None:
        super().__init__()
        self.dense = _Linear(n_in, config.hidden_size)
        self.LayerNorm = _LayerNorm(config.hidden_size, config.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class _Attention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        # `self` is the checkpoint's name for this submodule (attention.self.query...).
        self.self = _SelfAttention(config)
        self.output = _DenseNorm(config.hidden_size, config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x, mask), x)


class _Intermediate(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = _Linear(config.hidden_size, config.intermediate_size)
        self.approximate = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x), approximate=self.approximate)


class _Layer(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attention = _Attention(config)
        self.intermediate = _Intermediate(config)
        self.output = _DenseNorm(config.intermediate_size, config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class _Encoder(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(_Layer(config) for _ in range(config.num_hidden_layers))


class BertEncoder(nn.Module):
    """input ids [batch, length] and attention mask [batch, length] -> token states [batch, length, hidden]."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = _Embeddings(config)
        self.encoder = _Encoder(config)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.embeddings(input_ids, token_type_ids)
        mask = attention_mask.bool()[:, None, None, :]
        for layer in self.encoder.layer:
            x = layer(x, mask)
        return x


def to_float32(tensor: torch.Tensor) -> torch.Tensor:
    """An fp16/bf16 checkpoint tensor as fp32 (CPU kernels want fp32); the only case that copies.

    Converted with numpy, not torch: a torch conversion may start the intra-op thread pool, and a
    template process that did so would deadlock its forked children.
    """
    if tensor.dtype == torch.bfloat16:
        # bf16 is the top half of an fp32: widen the bits.
        bits = tensor.view(torch.int16).numpy().view(np.uint16).astype(np.uint32) << 16
        return torch.from_numpy(bits.view(np.float32))
    if tensor.dtype in (torch.float16, torch.float64):
        return torch.from_numpy(tensor.numpy().astype(np.float32))
    raise ValueError(f"tensors of dtype {tensor.dtype} are not supported (fp32, fp16, bf16, fp64)")


def checkpoint_prefix(keys: set[str]) -> str:
    """'' for a bare BertModel checkpoint, 'bert.' for one saved from a task head (BertForX)."""
    return "bert." if "bert.embeddings.word_embeddings.weight" in keys else ""


def build_encoder(config: BertConfig, tensors: Mapping[str, torch.Tensor]) -> BertEncoder:
    """The encoder with `tensors` assigned as its weights (no init, no copies, no tensor math).

    Extra checkpoint tensors (the pooler, position_ids buffers) are ignored. Raises ValueError
    naming the first missing tensor or the first tensor whose shape does not fit the config.
    """
    model = BertEncoder(config)
    prefix = checkpoint_prefix(set(tensors))
    state: dict[str, torch.Tensor] = {}
    for name, param in model.state_dict().items():
        tensor = tensors.get(prefix + name)
        if tensor is None:
            raise ValueError(f"tensor {prefix + name!r} is missing")
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(
                f"tensor {prefix + name!r} has shape {list(tensor.shape)}, the config needs {list(param.shape)}"
            )
        if tensor.dtype != torch.float32:
            try:
                tensor = to_float32(tensor)
            except ValueError as err:
                raise ValueError(f"tensor {prefix + name!r}: {err}") from None
        state[name] = tensor
    model.load_state_dict(state, strict=True, assign=True)
    return model.requires_grad_(False).eval()
