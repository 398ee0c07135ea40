"""Choosing the next token from an engine's logits, per sequence, in numpy.

Greedy at temperature 0, else a draw from the top-p nucleus of softmax(logits / T) with the sequence's own
generator (numpy's PCG64, seeded by the request or by the OS): the process's global RNG is never touched, so a
seed draws the same numbers alone or in any batch (the logits may differ in the last bits in a batch, llama.cpp's
kernels seeing other rows, so a near-tie may still go another way). `logit_bias` is added first; a grammar (structured
output) masks the tokens it does not allow before either. Log-probabilities, when asked, are those of the
model's distribution (log-softmax of the biased, masked logits, at temperature 1), as OpenAI reports them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ember.errors import InvalidInput


class Mask(Protocol):
    """What a grammar allows next: `allowed(logits)` returns the logits with disallowed tokens at -inf;
    `accept(token)` advances it; `done` once it can accept nothing more."""

    def allowed(self, logits: np.ndarray) -> np.ndarray: ...

    def accept(self, token: int) -> None: ...


@dataclass(frozen=True)
class Choice:
    """A picked token and, when asked, its log-probability and the top alternatives (id, logprob)."""

    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


class Sampler:
    def __init__(self, temperature: float, top_p: float, seed: int | None, *,
                 logit_bias: dict[int, float] | None = None, logprobs: bool = False, top_logprobs: int = 0,
                 mask: Mask | None = None) -> None:
        self.temperature, self.top_p = temperature, top_p
        self.rng = None
        if temperature > 0:
            self.rng = np.random.Generator(np.random.PCG64(seed if seed is not None
                                                           else int.from_bytes(os.urandom(8), "little")))
        self.bias = None
        if logit_bias:
            self.bias = (np.fromiter(logit_bias.keys(), dtype=np.int64),
                         np.fromiter(logit_bias.values(), dtype=np.float32))
        self.logprobs, self.top_logprobs, self.mask = logprobs, top_logprobs, mask

    def pick(self, logits: np.ndarray) -> Choice:
        if self.bias is not None:
            logits = logits.copy()
            keep = self.bias[0] < len(logits)
            logits[self.bias[0][keep]] += self.bias[1][keep]
        if self.mask is not None:
            logits = self.mask.allowed(logits)
            if not np.isfinite(logits).any():   # accepting a token the grammar refuses aborts llama.cpp
                raise InvalidInput("response_format: the grammar allows no next token here (does the schema ask "
                                   "for a character no token can make, such as NUL?)")
        token = self._draw(logits)
        if self.mask is not None:
            self.mask.accept(token)
        if not self.logprobs:
            return Choice(token)
        lp = log_softmax(logits)
        return Choice(token, float(lp[token]), top_of(lp, self.top_logprobs))

    def _draw(self, logits: np.ndarray) -> int:
        if self.rng is None:
            return int(np.argmax(logits))
        x = logits.astype(np.float64)
        scaled = (x - x.max()) / self.temperature   # shifted first: a subnormal T cannot overflow to inf - inf
        probs = np.exp(scaled)
        probs /= probs.sum()
        if self.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            sorted_probs = probs[order]
            outside = (np.cumsum(sorted_probs) - sorted_probs) >= self.top_p   # the first token always stays
            sorted_probs[outside] = 0.0
            return int(order[_choose(self.rng, sorted_probs)])
        return _choose(self.rng, probs)


def _choose(rng: np.random.Generator, weights: np.ndarray) -> int:
    """An index drawn with probability proportional to `weights` (one uniform draw: reproducible per seed)."""
    cumulative = np.cumsum(weights)
    return int(min(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"), len(weights) - 1))


def top_of(lp: np.ndarray, k: int) -> tuple[tuple[int, float], ...]:
    """The `k` most likely tokens of log-probabilities `lp`, most likely first, as (id, logprob): not those at -inf
    (what a grammar masks)."""
    if k <= 0:
        return ()
    best = np.argpartition(-lp, k - 1)[:k]
    best = best[np.argsort(-lp[best], kind="stable")]
    return tuple((int(i), float(lp[i])) for i in best if np.isfinite(lp[i]))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = x[np.isfinite(x)].max(initial=0.0)
    return x - (m + np.log(np.exp(x - m).sum()))
