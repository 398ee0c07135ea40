"""How often a prefix-cache hit changes greedy output, and what gives repeatable output (SmolLM2, in process).

Prompts share a long system prompt (rules of a made-up game, about `--prefix-tokens` tokens) and differ in the
user's question. Each prompt's greedy continuation (`--tokens` tokens, temperature 0, a stream alone) is computed:

- `cold`: with no prefix cache (`prefix_cache_mb: 0`), every prompt from its first token;
- `cold again`: the same, a second time (is the engine itself repeatable for the same shapes?);
- `cached`: with the default prefix cache, after the first prompt filled it, so every later prompt restores the
  shared prefix and computes only its own tail (other chunk shapes, so other rounding);
- `repeatable`: the same with `options.repeatable: true` (hits cut to whole steps of `step_tokens`).

A prompt counts as differing when its token ids differ anywhere; the first differing position is reported.

Usage: python bench/llm_repeatable.py [--prompts 24] [--prefix-tokens 600] [--tokens 48]
Writes bench/results/llm_repeatable.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from rich.console import Console
from rich.table import Table

from ember.runtimes.llm import LLMModel, LLMRuntime
from ember.wire.contract import example_contracts_dir, load_contract
from ember.wire.generation import parse_request

RESULTS = Path(__file__).resolve().parent / "results"
THINGS = ["river", "lantern", "falcon", "copper", "meadow", "harbor", "thistle", "granite", "ember", "orchard",
          "compass", "velvet", "glacier", "saffron", "anchor", "willow"]
QUESTIONS = ["Who moves first?", "How does a player win?", "What happens on a tie?", "Summarise rule 3.",
             "Can a falcon capture a river?", "How many tokens does each player start with?",
             "Explain the scoring in one sentence.", "What is forbidden on the first turn?",
             "Which piece is the strongest?", "What ends the game early?", "Give a short strategy tip.",
             "Is trading allowed?", "What does the lantern do?", "How long is a turn?",
             "Can two players share a harbor?", "What is the penalty for a late move?",
             "Describe the board.", "What is rule 12 about?", "Can copper be traded for saffron?",
             "How do you set up the game?", "What happens at midnight?", "Which rule is most often forgotten?",
             "Who keeps score?", "List three legal opening moves."]


def system_prompt(target_tokens: int) -> str:
    rules, i = [], 0
    while len(" ".join(rules)) < target_tokens * 4:   # about 4 characters a token in English
        a, b = THINGS[i % len(THINGS)], THINGS[(i * 7 + 3) % len(THINGS)]
        rules.append(f"Rule {i + 1}: a {a} may be exchanged for two {b}s only after the {i % 5 + 2}th turn, "
                     f"and never by the player holding the {THINGS[(i * 3) % len(THINGS)]}.")
        i += 1
    return "You referee the board game Tallow. " + " ".join(rules)


def continuation(model: LLMModel, system: str, question: str, tokens: int) -> tuple[list[int], int]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    req = parse_request(json.dumps({"messages": messages, "temperature": 0, "max_tokens": tokens}).encode())
    ids = model.prompt_ids(req)
    return model.tokens(ids, req, tokens), len(ids)


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--prefix-tokens", type=int, default=600)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    contract = load_contract(example_contracts_dir() / "smollm2.yaml")
    with tempfile.TemporaryDirectory(prefix="ember-repeatable-") as root:
        cached = LLMRuntime(cache_root=Path(root)).load(contract)
        cold = LLMModel(contract, cached.engine, cached.options.model_copy(update={"prefix_cache_mb": 0}),
                        cached.model_id)
        aligned = LLMModel(contract, cached.engine, cached.options.model_copy(update={"repeatable": True}),
                           cached.model_id)
        system = system_prompt(args.prefix_tokens)
        rows = []
        started = time.perf_counter()
        for question in (QUESTIONS * 4)[: args.prompts]:
            a, n = continuation(cold, system, question, args.tokens)
            again, _ = continuation(cold, system, question, args.tokens)
            hit, _ = continuation(cached, system, question, args.tokens)
            aligned_hit, _ = continuation(aligned, system, question, args.tokens)
            rows.append({"question": question, "prompt_tokens": n, "cold_vs_cold_again": first_difference(a, again),
                         "cold_vs_cached": first_difference(a, hit),
                         "cold_vs_repeatable": first_difference(a, aligned_hit)})
            print(f"{len(rows):3d} {n} tokens: cold again {rows[-1]['cold_vs_cold_again']}, cached "
                  f"{rows[-1]['cold_vs_cached']}, repeatable {rows[-1]['cold_vs_repeatable']}", flush=True)
    report(rows, args, time.perf_counter() - started)


def report(rows: list[dict[str, object]], args: argparse.Namespace, seconds: float) -> None:
    n = len(rows)
    again = [r for r in rows if r["cold_vs_cold_again"] is not None]
    hits = [r for r in rows[1:] if r["cold_vs_cached"] is not None]   # the first prompt fills the cache
    aligned = [r for r in rows[1:] if r["cold_vs_repeatable"] is not None]
    table = Table(title=f"greedy continuations of {args.tokens} tokens, SmolLM2 Q4_1, {n} prompts sharing a "
                        f"~{rows[0]['prompt_tokens']}-token prefix")
    for col in ("comparison", "prompts differing", "first differing token (each)"):
        table.add_column(col)
    table.add_row("no cache, run twice", f"{len(again)} of {n}", str([r["cold_vs_cold_again"] for r in again]))
    table.add_row("no cache vs a prefix-cache hit", f"{len(hits)} of {n - 1}",
                  str([r["cold_vs_cached"] for r in hits]))
    table.add_row("no cache vs a hit with repeatable: true", f"{len(aligned)} of {n - 1}",
                  str([r["cold_vs_repeatable"] for r in aligned]))
    Console().print(table)
    RESULTS.mkdir(exist_ok=True)
    out = {"prompts": n, "tokens": args.tokens, "prefix_tokens": args.prefix_tokens, "seconds": round(seconds, 1),
           "no_cache_repeat_differing": len(again), "cache_hit_differing": len(hits),
           "repeatable_hit_differing": len(aligned), "cache_hit_compared": n - 1, "rows": rows}
    (RESULTS / "llm_repeatable.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
