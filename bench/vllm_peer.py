"""vLLM (CPU build) used directly, in process: the peer of `bench/llm.py --engine vllm`. Runs under the vllm
environment's interpreter (`ember env build vllm`; it must not share ember's, whose torch is pinned).

The engine has the settings of ember's vllm runtime as the bench's contract gives them (ember/runtimes/vllm.py):
float32, eager (no torch.compile, which costs ~70 s here), prefix caching on, max_model_len, max_num_seqs, the KV
pool's bytes, seed 0, the engine in this process (no engine-core process); threads as the caller sets them
(OMP_NUM_THREADS; the bench gives 1 and pins this process to the ember instance's core). vLLM's offline API
(`LLM.chat`), which applies the tokenizer's chat template as ember's runtime does.

Prints one JSON line once loaded: the cold start (imports, engine, first token of a greedy chat of QUESTION), the
loaded TTFT, threads. With `--serve` it then reads one JSON command a line on stdin, `{"prompt": P, "streams": K,
"tokens": N}`, runs K concurrent greedy chats of P (temperature 0, max_tokens N, stopping at EOS as ember does)
and prints `{"tokens": ..., "wall_s": ..., "tokens_per_s": ...}`; an empty line or EOF ends it.

Usage: ENV/bin/python bench/vllm_peer.py MODEL_DIR QUESTION MAX_NUM_SEQS KV_CACHE_GB MAX_MODEL_LEN [--serve]
"""

import json
import os
import sys
import time
from typing import Any

T0 = time.perf_counter()


def chat(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def serve(llm: Any) -> None:
    from vllm import SamplingParams

    for line in sys.stdin:
        if not line.strip():
            break
        command = json.loads(line)
        params = SamplingParams(temperature=0, max_tokens=int(command["tokens"]))
        t0 = time.perf_counter()
        outs = llm.chat([chat(command["prompt"])] * int(command["streams"]), params, use_tqdm=False)
        wall = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print(json.dumps({"streams": int(command["streams"]), "tokens": tokens, "wall_s": wall,
                          "tokens_per_s": tokens / wall, "prompt_tokens": len(outs[0].prompt_token_ids)}), flush=True)


def main() -> None:
    directory, question = sys.argv[1], sys.argv[2]
    max_num_seqs, kv_cache_gb, max_model_len = int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
    import torch
    from vllm import LLM, SamplingParams

    imported = time.perf_counter()
    llm = LLM(model=directory, dtype="float32", max_model_len=max_model_len, enforce_eager=True,
              enable_prefix_caching=True, max_num_seqs=max_num_seqs, seed=0,
              kv_cache_memory_bytes=int(kv_cache_gb * (1 << 30)))
    built = time.perf_counter()
    llm.chat(chat(question), SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    first = time.perf_counter()
    print(json.dumps({"first_token": True}), flush=True)
    t0 = time.perf_counter()
    llm.chat(chat(question + " (again)"), SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    ttft = time.perf_counter() - t0
    print(json.dumps({"version": __import__("vllm").__version__, "import_s": imported - T0,
                      "engine_s": built - imported, "cold_first_token_s": first - T0, "hot_ttft_s": ttft,
                      "torch_threads": torch.get_num_threads(), "process_threads": len(os.listdir("/proc/self/task")),
                      "cpus": sorted(os.sched_getaffinity(0))}), flush=True)
    if "--serve" in sys.argv[6:]:
        serve(llm)
    os._exit(0)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # as ember's runtime (ENGINE_ENV)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
