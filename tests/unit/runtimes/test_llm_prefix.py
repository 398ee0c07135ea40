"""The prefix cache's bookkeeping and the INT8 snapshot encoding, on small tensors (no model)."""

from __future__ import annotations

import pytest
import torch

from ember.runtimes.llm_prefix import MIN_PREFIX, PrefixCache
from ember.runtimes.llm_snapshot import dequantise, quantise, snapshot_name

LAYERS, HEADS, DIM = 2, 3, 4


def kv(ids: list[int]) -> torch.Tensor:
    """A KV entry whose every value encodes its token position, so a slice can be checked."""
    t = torch.arange(len(ids), dtype=torch.float32)[None, None, None, :, None]
    return t.expand(LAYERS, 2, HEADS, len(ids), DIM).clone()


def entry_bytes(n: int) -> int:
    return LAYERS * 2 * HEADS * n * DIM * 4


def test_the_longest_common_prefix_is_found_but_never_the_whole_prompt() -> None:
    cache = PrefixCache(1 << 20)
    system = list(range(100, 140))
    cache.insert([*system, 1, 2, 3], kv([*system, 1, 2, 3]))
    n, found = cache.lookup([*system, 7, 8])
    assert n == len(system) and found is not None and found.shape[3] == n
    assert torch.equal(found[0, 0, 0, :, 0], torch.arange(n, dtype=torch.float32))
    n, _ = cache.lookup([*system, 1, 2, 3])   # the last token's logits are needed: it is prefilled again
    assert n == len(system) + 2
    assert cache.lookup([*list(range(MIN_PREFIX - 1)), 5])[0] == 0
    assert cache.hits == 2


def test_short_prefixes_are_not_worth_a_lookup_or_an_entry() -> None:
    cache = PrefixCache(1 << 20)
    cache.insert([1, 2, 3], kv([1, 2, 3]))
    assert len(cache) == 0
    short = list(range(MIN_PREFIX + 1))
    cache.insert(short, kv(short))
    assert cache.lookup([*short[:MIN_PREFIX - 2], 999, 998, 997]) == (0, None)


def test_an_entry_that_extends_another_replaces_it_and_bytes_are_bounded_lru() -> None:
    a = list(range(20))
    cache = PrefixCache(entry_bytes(60))
    cache.insert(a, kv(a))
    cache.insert([*a, 50, 51], kv([*a, 50, 51]))   # serves all that `a` served
    assert len(cache) == 1 and cache.covers(a) and cache.bytes == entry_bytes(22)
    b = list(range(200, 230))
    cache.insert(b, kv(b))
    assert cache.lookup([*a, 50, 9])[0] == 21        # `a…` is now the most recently used
    c = list(range(400, 420))
    cache.insert(c, kv(c))                            # 22 + 30 + 20 > 60 tokens: `b` (least recent) goes
    assert cache.covers(a) and cache.covers(c) and not cache.covers(b)
    assert cache.bytes == entry_bytes(42)
    assert [ids for ids, _ in cache.hottest(4)] == [tuple([*a, 50, 51])]


def test_a_zero_budget_keeps_nothing() -> None:
    cache = PrefixCache(0)
    ids = list(range(40))
    cache.insert(ids, kv(ids))
    assert len(cache) == 0 and cache.lookup([*ids, 1]) == (0, None)


def test_int8_is_a_quarter_of_the_bytes_and_close_per_channel() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(LAYERS, 2, HEADS, 64, DIM, generator=gen) * torch.linspace(0.1, 10, DIM)
    q, scale = quantise(x)
    assert q.dtype == torch.int8 and scale.shape == (LAYERS, 2, HEADS, 1, DIM)
    back = dequantise(q, scale, torch.float32)
    assert torch.all((back - x).abs() <= scale / 2 + 1e-6)   # half a step per channel, at most
    assert q.numel() * q.element_size() == x.numel() * x.element_size() // 4


@pytest.mark.parametrize("other", [([1, 2, 4], "int8"), ([1, 2, 3], "float32")])
def test_snapshot_names_depend_on_the_tokens_and_the_encoding(other: tuple[list[int], str]) -> None:
    name = snapshot_name("model-abc", [1, 2, 3], "int8")
    assert name == snapshot_name("model-abc", [1, 2, 3], "int8") and name.startswith("kv-") and name.endswith(":1")
    assert name != snapshot_name("model-abc", other[0], other[1])  # type: ignore[arg-type]
    assert name != snapshot_name("model-xyz", [1, 2, 3], "int8")
