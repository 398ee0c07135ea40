"""The KV-prefix cache of an LLM instance: the keys and values of recent prompts, reused by later prompts that
begin the same way (a chat's system prompt, a few-shot header).

Attention is causal, so the KV of a prompt's first n tokens depends on those n tokens only: any cached prompt
serves every later prompt that shares a prefix with it, up to their longest common prefix (as SGLang's radix
cache does, with a list instead of a tree: an instance holds tens of prompts, not thousands). Entries are
evicted least recently used first, by bytes. An entry is the engine's own bytes of a sequence's KV
(`Context.save`): restored whole into a sequence, then cut to the matching prefix. Snapshots of entries go to
the weight store (ember.runtimes.llm_snapshot).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

MIN_PREFIX = 16   # tokens: shorter matches cost more to copy in than they save


class PrefixCache:
    def __init__(self, limit_bytes: int, *, whole: bool = False) -> None:
        """`whole`: for an engine that cannot cut a sequence back (sliding windows), an entry serves only prompts
        it is a prefix of, so a longer entry neither serves nor replaces a shorter one."""
        self.limit_bytes, self.whole = limit_bytes, whole
        self._entries: OrderedDict[tuple[int, ...], bytes] = OrderedDict()
        self._uses: dict[tuple[int, ...], int] = {}
        self.bytes = 0
        self.hits = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def items(self) -> list[tuple[tuple[int, ...], bytes]]:
        """Entries, most recently used first."""
        return list(reversed(self._entries.items()))

    def lookup(self, ids: list[int]) -> tuple[int, bytes | None]:
        """The longest cached prefix of `ids` (at most all but the last token, whose logits are needed):
        (its length, the entry's bytes, which may hold more), or (0, None) under MIN_PREFIX tokens."""
        want = np.asarray(ids[:-1], dtype=np.int64)
        best, found = 0, None
        for tokens in self._entries:
            n = _common(want, tokens)
            if self.whole and n != len(tokens):
                continue
            if n > best:
                best, found = n, tokens
        if found is None or best < MIN_PREFIX:
            return 0, None
        self._entries.move_to_end(found)
        self._uses[found] = self._uses.get(found, 0) + 1
        self.hits += 1
        self.hit_tokens += best
        return best, self._entries[found]

    def hottest(self, n: int) -> list[tuple[tuple[int, ...], bytes]]:
        """Up to `n` entries that served at least one hit, most hits first."""
        used = sorted((t for t in self._entries if self._uses.get(t)), key=lambda t: -self._uses[t])
        return [(t, self._entries[t]) for t in used[:n]]

    def get(self, ids: list[int]) -> bytes | None:
        return self._entries.get(tuple(ids))

    def wants(self, ids: list[int]) -> bool:
        """Whether inserting `ids` would keep anything new."""
        if self.limit_bytes <= 0 or len(ids) < MIN_PREFIX:
            return False
        return tuple(ids) not in self._entries if self.whole else not self.covers(ids)

    def fits(self, size: int) -> bool:
        """Whether an entry of `size` bytes would be kept (checked before the engine copies it out)."""
        return size <= self.limit_bytes // 2

    def covers(self, ids: list[int]) -> bool:
        """Whether an entry already holds all of `ids`."""
        want = np.asarray(ids, dtype=np.int64)
        return any(_common(want, tokens) == len(ids) for tokens in self._entries)

    def insert(self, ids: list[int], kv: bytes) -> None:
        """Keep `kv`, the KV of `ids`; entries that are prefixes of `ids` go (it serves what they served)."""
        if self.limit_bytes <= 0 or len(ids) < MIN_PREFIX:
            return
        size = len(kv)
        if not self.fits(size):   # one prompt may not take the whole cache (nor double it in flight)
            return
        key = tuple(ids)
        want = np.asarray(ids, dtype=np.int64)
        for tokens in [t for t in self._entries if _common(want, t) == len(t) and not self.whole]:
            self._drop(tokens)
        self._entries[key] = kv
        self.bytes += size
        while self.bytes > self.limit_bytes:
            self._drop(next(iter(self._entries)))

    def _drop(self, tokens: tuple[int, ...]) -> None:
        kv = self._entries.pop(tokens)
        self._uses.pop(tokens, None)
        self.bytes -= len(kv)


def _common(want: np.ndarray, tokens: tuple[int, ...]) -> int:
    """Length of the common prefix of `want` and `tokens`."""
    n = min(len(want), len(tokens))
    if n == 0:
        return 0
    differ = np.flatnonzero(want[:n] != np.asarray(tokens[:n], dtype=np.int64))
    return int(differ[0]) if len(differ) else n
