"""The KV-prefix cache of an LLM instance: the keys and values of recent prompts, reused by later prompts that
begin the same way (a chat's system prompt, a few-shot header).

Attention is causal, so the KV of a prompt's first n tokens depends on those n tokens only: any cached prompt
serves every later prompt that shares a prefix with it, up to their longest common prefix (as SGLang's radix
cache does, with a list instead of a tree: an instance holds tens of prompts, not thousands). Entries are
evicted least recently used first, by bytes. An entry is the engine's own bytes of a sequence's KV
(`Context.save`): restored whole into a sequence, then cut to the matching prefix. Snapshots of entries go to
the weight store (ember.runtimes.llm_snapshot).

Every entry belongs to a scope (the tenant whose request made it, `ember.runtimes.llm.LLMModel.scope_of`), and a
prompt is served only by its own scope's entries and the SHARED ones (the contract's declared prefixes, which
no request made): what one tenant's prompts left in the cache changes neither the tokens, the timings nor the
`cached_tokens` another tenant's requests see. The bytes are one budget: when it is full, the scope holding the
most gives way first (its least recently used entry), so a scope holding no more than any other loses nothing
to another's prompts.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TypeAlias

import numpy as np

MIN_PREFIX = 16   # tokens: shorter matches cost more to copy in than they save
Scope: TypeAlias = str | None   # a tenant's name; None: requests without a tenant
SHARED: Scope = "\x00shared"    # entries every scope may use (no tenant name holds a NUL)

_Key: TypeAlias = tuple[Scope, tuple[int, ...]]


class PrefixCache:
    def __init__(self, limit_bytes: int, *, whole: bool = False) -> None:
        """`whole`: for an engine that cannot cut a sequence back (sliding windows), an entry serves only prompts
        it is a prefix of, so a longer entry neither serves nor replaces a shorter one."""
        self.limit_bytes, self.whole = limit_bytes, whole
        self._entries: OrderedDict[_Key, bytes] = OrderedDict()
        self._uses: dict[_Key, int] = {}
        self._held: dict[Scope, int] = {}   # bytes per scope
        self.bytes = 0
        self.hits = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def items(self) -> list[tuple[tuple[int, ...], bytes]]:
        """Entries of every scope, most recently used first."""
        return [(tokens, kv) for (_, tokens), kv in reversed(self._entries.items())]

    def _visible(self, scope: Scope) -> list[_Key]:
        return [k for k in self._entries if k[0] == scope or k[0] == SHARED]

    def lookup(self, ids: list[int], scope: Scope = None, align: int = 1) -> tuple[int, bytes | None]:
        """The longest prefix of `ids` cached in `scope` or SHARED (at most all but the last token, whose logits
        are needed): (its length, the entry's bytes, which may hold more), or (0, None) under MIN_PREFIX tokens.
        `align`: the length is cut down to a multiple of it (a whole entry must be one already)."""
        want = np.asarray(ids[:-1], dtype=np.int64)
        best, found = 0, None
        for key in self._visible(scope):
            n = _common(want, key[1])
            if self.whole and n != len(key[1]):
                continue
            if n % align and self.whole:
                continue
            n -= n % align
            if n > best:
                best, found = n, key
        if found is None or best < MIN_PREFIX:
            return 0, None
        self._entries.move_to_end(found)
        self._uses[found] = self._uses.get(found, 0) + 1
        self.hits += 1
        self.hit_tokens += best
        return best, self._entries[found]

    def hottest(self, n: int, scope: Scope = None) -> list[tuple[tuple[int, ...], bytes]]:
        """Up to `n` of `scope`'s own entries that served at least one hit, most hits first."""
        used = sorted((k for k in self._entries if k[0] == scope and self._uses.get(k)), key=lambda k: -self._uses[k])
        return [(k[1], self._entries[k]) for k in used[:n]]

    def get(self, ids: list[int], scope: Scope = None) -> bytes | None:
        return self._entries.get((scope, tuple(ids)))

    def wants(self, ids: list[int], scope: Scope = None) -> bool:
        """Whether inserting `ids` into `scope` would keep anything new for it."""
        if self.limit_bytes <= 0 or len(ids) < MIN_PREFIX:
            return False
        if self.whole:
            return not any(k[1] == tuple(ids) for k in self._visible(scope))
        return not self.covers(ids, scope)

    def fits(self, size: int) -> bool:
        """Whether an entry of `size` bytes would be kept (checked before the engine copies it out)."""
        return size <= self.limit_bytes // 2

    def covers(self, ids: list[int], scope: Scope = None) -> bool:
        """Whether an entry `scope` may use already holds all of `ids`."""
        want = np.asarray(ids, dtype=np.int64)
        return any(_common(want, k[1]) == len(ids) for k in self._visible(scope))

    def insert(self, ids: list[int], kv: bytes, scope: Scope = None) -> None:
        """Keep `kv`, the KV of `ids`, in `scope`; that scope's entries that are prefixes of `ids` go (it serves
        what they served)."""
        if self.limit_bytes <= 0 or len(ids) < MIN_PREFIX:
            return
        size = len(kv)
        if not self.fits(size):   # one prompt may not take the whole cache (nor double it in flight)
            return
        key = (scope, tuple(ids))
        want = np.asarray(ids, dtype=np.int64)
        if not self.whole:
            for old in [k for k in self._entries if k[0] == scope and _common(want, k[1]) == len(k[1])]:
                self._drop(old)
        self._drop(key)
        self._entries[key] = kv
        self._held[scope] = self._held.get(scope, 0) + size
        self.bytes += size
        while self.bytes > self.limit_bytes:
            self._drop(self._victim(key))

    def _victim(self, kept: _Key) -> _Key:
        """The least recently used entry of the scope holding the most bytes (SHARED last), never `kept`."""
        def weight(scope: Scope) -> tuple[bool, int]:
            return scope != SHARED, self._held.get(scope, 0) - (len(self._entries[kept]) if scope == kept[0] else 0)

        candidates = [k for k in self._entries if k != kept]
        heaviest = max({k[0] for k in candidates}, key=weight)
        return next(k for k in candidates if k[0] == heaviest)

    def _drop(self, key: _Key) -> None:
        kv = self._entries.pop(key, None)
        if kv is None:
            return
        self._uses.pop(key, None)
        self.bytes -= len(kv)
        self._held[key[0]] -= len(kv)
        if not self._held[key[0]]:
            del self._held[key[0]]


def _common(want: np.ndarray, tokens: tuple[int, ...]) -> int:
    """Length of the common prefix of `want` and `tokens`."""
    n = min(len(want), len(tokens))
    if n == 0:
        return 0
    differ = np.flatnonzero(want[:n] != np.asarray(tokens[:n], dtype=np.int64))
    return int(differ[0]) if len(differ) else n
