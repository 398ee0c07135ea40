from __future__ import annotations

import numpy as np
import pytest
import torch

from ember.runtimes.bert import BertConfig, build_encoder, checkpoint_prefix, to_float32

TINY = {
    "vocab_size": 11,
    "hidden_size": 8,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 16,
    "max_position_embeddings": 12,
    "type_vocab_size": 2,
    "hidden_act": "gelu",
}


def tiny_tensors(config: BertConfig, seed: int = 0, prefix: str = "") -> dict[str, torch.Tensor]:
    """Random weights under the checkpoint names, built without touching the encoder class."""
    gen = np.random.default_rng(seed)
    h, i = config.hidden_size, config.intermediate_size
    shapes = {
        "embeddings.word_embeddings.weight": (config.vocab_size, h),
        "embeddings.position_embeddings.weight": (config.max_position_embeddings, h),
        "embeddings.token_type_embeddings.weight": (config.type_vocab_size, h),
        "embeddings.LayerNorm.weight": (h,),
        "embeddings.LayerNorm.bias": (h,),
    }
    for n in range(config.num_hidden_layers):
        p = f"encoder.layer.{n}."
        for part in ("query", "key", "value"):
            shapes[f"{p}attention.self.{part}.weight"] = (h, h)
            shapes[f"{p}attention.self.{part}.bias"] = (h,)
        shapes |= {
            f"{p}attention.output.dense.weight": (h, h),
            f"{p}attention.output.dense.bias": (h,),
            f"{p}attention.output.LayerNorm.weight": (h,),
            f"{p}attention.output.LayerNorm.bias": (h,),
            f"{p}intermediate.dense.weight": (i, h),
            f"{p}intermediate.dense.bias": (i,),
            f"{p}output.dense.weight": (h, i),
            f"{p}output.dense.bias": (h,),
            f"{p}output.LayerNorm.weight": (h,),
            f"{p}output.LayerNorm.bias": (h,),
        }
    tensors = {prefix + k: torch.from_numpy(gen.normal(size=s).astype(np.float32)) for k, s in shapes.items()}
    tensors[prefix + "pooler.dense.weight"] = torch.zeros(h, h)  # extra tensors are ignored
    return tensors


def reference_forward(
    config: BertConfig, t: dict[str, torch.Tensor], ids: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """BERT written out longhand (additive mask, explicit softmax), to check the module against."""
    h, heads = config.hidden_size, config.num_attention_heads
    eps = config.layer_norm_eps

    def ln(x: torch.Tensor, name: str) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, (h,), t[name + ".weight"], t[name + ".bias"], eps)

    def lin(x: torch.Tensor, name: str) -> torch.Tensor:
        return x @ t[name + ".weight"].T + t[name + ".bias"]

    length = ids.shape[1]
    x = t["embeddings.word_embeddings.weight"][ids] + t["embeddings.position_embeddings.weight"][:length]
    x = ln(x + t["embeddings.token_type_embeddings.weight"][0], "embeddings.LayerNorm")
    additive = (1.0 - mask[:, None, None, :].float()) * -1e9
    for n in range(config.num_hidden_layers):
        p = f"encoder.layer.{n}."
        q, k, v = (lin(x, p + "attention.self." + s).view(*ids.shape, heads, -1).transpose(1, 2)
                   for s in ("query", "key", "value"))
        scores = q @ k.transpose(-1, -2) / (h // heads) ** 0.5 + additive
        ctx = (scores.softmax(-1) @ v).transpose(1, 2).reshape(*ids.shape, h)
        x = ln(lin(ctx, p + "attention.output.dense") + x, p + "attention.output.LayerNorm")
        inner = torch.nn.functional.gelu(lin(x, p + "intermediate.dense"))
        x = ln(lin(inner, p + "output.dense") + x, p + "output.LayerNorm")
    return x


IDS = torch.tensor([[1, 5, 7, 2, 0, 0], [1, 3, 4, 9, 6, 2]])
MASK = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])


def test_encoder_matches_a_longhand_bert() -> None:
    config = BertConfig.parse(TINY)
    tensors = tiny_tensors(config)
    model = build_encoder(config, tensors)
    with torch.inference_mode():
        got = model(IDS, MASK)
    want = reference_forward(config, tensors, IDS, MASK)
    real = MASK.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-4)


def test_padding_does_not_change_real_token_states() -> None:
    config = BertConfig.parse(TINY)
    model = build_encoder(config, tiny_tensors(config))
    with torch.inference_mode():
        padded = model(IDS[:1], MASK[:1])[0, :4]
        alone = model(IDS[:1, :4], MASK[:1, :4])[0]
    torch.testing.assert_close(padded, alone, rtol=1e-5, atol=1e-5)


def test_weights_are_assigned_not_copied() -> None:
    config = BertConfig.parse(TINY)
    tensors = tiny_tensors(config)
    model = build_encoder(config, tensors)
    weight = model.embeddings.word_embeddings.weight
    assert weight.data_ptr() == tensors["embeddings.word_embeddings.weight"].data_ptr()
    assert not weight.requires_grad


def test_a_task_head_checkpoint_with_bert_prefix_loads() -> None:
    config = BertConfig.parse(TINY)
    tensors = tiny_tensors(config, prefix="bert.")
    assert checkpoint_prefix(set(tensors)) == "bert."
    with torch.inference_mode():
        out = build_encoder(config, tensors)(IDS, MASK)
    assert out.shape == (2, 6, 8)


def test_missing_tensor_is_named() -> None:
    config = BertConfig.parse(TINY)
    tensors = tiny_tensors(config)
    del tensors["encoder.layer.1.attention.self.key.bias"]
    with pytest.raises(ValueError, match=r"tensor 'encoder.layer.1.attention.self.key.bias' is missing"):
        build_encoder(config, tensors)


def test_tensor_of_the_wrong_shape_is_named() -> None:
    config = BertConfig.parse(TINY)
    tensors = tiny_tensors(config)
    tensors["embeddings.word_embeddings.weight"] = torch.zeros(12, 8)
    with pytest.raises(ValueError, match=r"'embeddings.word_embeddings.weight' has shape \[12, 8\], .* \[11, 8\]"):
        build_encoder(config, tensors)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_half_precision_checkpoints_are_widened_exactly(dtype: torch.dtype) -> None:
    source = torch.tensor([0.0, -1.5, 3.140625, 65504.0 if dtype == torch.float16 else 1e30]).to(dtype)
    widened = to_float32(source)
    assert widened.dtype == torch.float32
    assert widened.tolist() == source.float().tolist()


def test_integer_weights_are_refused_with_the_tensor_name() -> None:
    config = BertConfig.parse(TINY)
    tensors = tiny_tensors(config)
    tensors["embeddings.LayerNorm.bias"] = torch.zeros(8, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"tensor 'embeddings.LayerNorm.bias': .*torch.int32"):
        build_encoder(config, tensors)


@pytest.mark.parametrize(
    ("patch", "names"),
    [
        ({"hidden_act": "swish"}, "hidden_act"),
        ({"position_embedding_type": "relative_key"}, "position_embedding_type"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"num_attention_heads": 3}, "not a multiple of num_attention_heads"),
        ({"vocab_size": None}, "vocab_size"),
    ],
)
def test_config_errors_name_the_key(patch: dict[str, object], names: str) -> None:
    with pytest.raises(ValueError, match=names):
        BertConfig.parse({**TINY, **patch})
