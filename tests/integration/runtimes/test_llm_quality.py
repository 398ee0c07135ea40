"""Quality, measured: the engine's per-token perplexity on a fixed public-domain text is within 2% of the float32
reference (transformers' own GGUF loader, which de-quantises SmolLM2's Q4_1 weights to float32: an independent
path from the file to the logits). Both score the same token ids (llama.cpp's tokenization), so only the math
differs: llama.cpp's quantised kernels (8-bit activations, f16 KV) against float32 throughout."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ember.runtimes.llamacpp import LlamaCppModel
from ember.runtimes.llm_engine import ECHO_OUTPUTS, Feed
from ember.runtimes.llm_sampling import log_softmax
from ember.testing.gguf_models import smollm2_path

pytestmark = pytest.mark.slow

# Abraham Lincoln, the Gettysburg Address (1863; public domain).
TEXT = (
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, conceived in "
    "Liberty, and dedicated to the proposition that all men are created equal. Now we are engaged in a great civil "
    "war, testing whether that nation, or any nation so conceived and so dedicated, can long endure. We are met on "
    "a great battle-field of that war. We have come to dedicate a portion of that field, as a final resting place "
    "for those who here gave their lives that that nation might live. It is altogether fitting and proper that we "
    "should do this. But, in a larger sense, we can not dedicate, we can not consecrate, we can not hallow this "
    "ground. The brave men, living and dead, who struggled here, have consecrated it, far above our poor power to "
    "add or detract. The world will little note, nor long remember what we say here, but it can never forget what "
    "they did here.")


def engine_nll(ids: list[int]) -> np.ndarray:
    """Negative log-likelihood of ids[1:] under llama.cpp, through ember's engine seam (chunked, all rows)."""
    model = LlamaCppModel(smollm2_path())
    ctx = model.open(1, 1024)
    rows = []
    try:
        for start in range(0, len(ids), ECHO_OUTPUTS):
            chunk = tuple(ids[start: start + ECHO_OUTPUTS])
            out = ctx.run([Feed(0, chunk, start, len(chunk))])[0]
            assert out is not None
            rows.append(out)
    finally:
        ctx.close()
        model.close()
    logits = np.concatenate(rows)[:-1]
    return np.array([-log_softmax(row)[token] for row, token in zip(logits, ids[1:], strict=True)])


def reference_nll(ids: list[int]) -> np.ndarray:
    """The same under transformers' float32 Llama built from the same GGUF."""
    import torch
    from transformers import AutoModelForCausalLM

    path = smollm2_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
    lp = torch.log_softmax(logits, dim=-1)
    return -lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()


def test_the_engines_perplexity_is_within_two_percent_of_the_float32_reference() -> None:
    ids = LlamaCppModel(smollm2_path()).tokenize(TEXT, special=False)
    assert len(ids) > 150
    ours, ref = engine_nll(ids), reference_nll(ids)
    ppl, ppl_ref = math.exp(ours.mean()), math.exp(ref.mean())
    print(f"\nperplexity over {len(ids) - 1} tokens: llama.cpp {ppl:.3f}, float32 reference {ppl_ref:.3f} "
          f"({ppl / ppl_ref - 1:+.2%}); largest per-token NLL difference {np.abs(ours - ref).max():.3f}")
    assert abs(ppl / ppl_ref - 1) <= 0.02
