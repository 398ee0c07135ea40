"""vLLM (CPU build) on the model ember serves, for bench/llm.py's peer row. Runs under vLLM's own virtualenv
(`--vllm-python`; it must not share ember's, whose torch is pinned): see docs/llm.md for the recipe.

Measures, in one fresh process: start to the first token of a greedy chat completion (imports, engine
construction, first generation), the time to first token once loaded, tokens/s of one greedy stream and the
aggregate tokens/s of 8 concurrent ones. Settings chosen to compare with an ember instance: float32, eager
(no torch.compile, which costs ~70 s here), the engine in this process, one OpenMP thread. Prints one JSON line.

Usage: /path/to/vllm-venv/bin/python bench/vllm_peer.py MODEL_DIR QUESTION TOKENS
"""

import json
import os
import sys
import time

T0 = time.perf_counter()


def main() -> None:
    directory, question, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    from vllm import LLM, SamplingParams

    imported = time.perf_counter()
    llm = LLM(model=directory, dtype="float32", max_model_len=2048, enforce_eager=True)
    built = time.perf_counter()
    chat = [{"role": "user", "content": question}]
    llm.chat(chat, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    first = time.perf_counter()
    t0 = time.perf_counter()
    llm.chat(chat, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    ttft = time.perf_counter() - t0
    stream = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    out = llm.chat(chat, stream, use_tqdm=False)
    one = len(out[0].outputs[0].token_ids) / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    outs = llm.chat([chat] * 8, stream, use_tqdm=False)
    eight = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
    print(json.dumps({"version": __import__("vllm").__version__, "import_s": imported - T0,
                      "engine_s": built - imported, "cold_first_token_s": first - T0, "hot_ttft_s": ttft,
                      "one_stream_tokens_per_s": one, "eight_streams_tokens_per_s": eight}), flush=True)
    os._exit(0)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
