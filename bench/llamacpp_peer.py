"""llama.cpp used directly, in process: the decode peer of `bench/llm.py` (llama-cpp-python's `Llama`, as a user of
the library would run it: its defaults, weights repacked where the CPU has kernels for it, one thread).

Loads the GGUF, warms up with a 4-token greedy chat, prints `{"loaded": true}`, then reads one JSON command a line
on stdin, `{"prompt": P, "tokens": N}`, streams one greedy chat of P (temperature 0, max_tokens N, stopping at EOS
as ember does) and prints `{"tokens": ..., "tokens_per_s": ...}` (tokens after the first over the time after the
first, as the bench counts ember's streams); an empty line or EOF ends it.

Usage: python bench/llamacpp_peer.py MODEL.gguf
"""

import json
import sys
import time

import llama_cpp

from ember.runtimes.ggml_backends import load


def one_stream(llm: llama_cpp.Llama, prompt: str, tokens: int) -> dict[str, float]:
    messages = [{"role": "user", "content": prompt}]
    first, count = None, 0
    for chunk in llm.create_chat_completion(messages, max_tokens=tokens, temperature=0, stream=True):
        if chunk["choices"][0]["delta"].get("content"):   # type: ignore[index,union-attr]
            count += 1
            first = first or time.perf_counter()
    end = time.perf_counter()
    return {"tokens": count, "tokens_per_s": (count - 1) / (end - first) if first and count > 1 else 0.0}


def main() -> None:
    load()   # the CPU backend variant ember picks for this host
    llm = llama_cpp.Llama(model_path=sys.argv[1], n_threads=1, n_threads_batch=1, n_ctx=2048, verbose=False)
    llm.create_chat_completion([{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0)
    print(json.dumps({"loaded": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        command = json.loads(line)
        print(json.dumps(one_stream(llm, command["prompt"], int(command["tokens"]))), flush=True)


if __name__ == "__main__":
    main()
