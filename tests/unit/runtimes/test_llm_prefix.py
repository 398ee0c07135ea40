"""The prefix cache's bookkeeping over the engine's state bytes, and snapshot names and lists (no model)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ember.runtimes import llm_snapshot as snap
from ember.runtimes.llm_prefix import MIN_PREFIX, SHARED, PrefixCache
from ember.runtimes.llm_snapshot import snapshot_name

PER_TOKEN = 10   # fake state bytes per token


def kv(ids: list[int]) -> bytes:
    """Fake engine state: its size grows with the tokens, and it names them, so an entry can be told apart."""
    return b",".join(str(i).encode() for i in ids).ljust(len(ids) * PER_TOKEN, b".")


def test_the_longest_common_prefix_is_found_but_never_the_whole_prompt() -> None:
    cache = PrefixCache(1 << 20)
    system = list(range(100, 140))
    cache.insert([*system, 1, 2, 3], kv([*system, 1, 2, 3]))
    n, found = cache.lookup([*system, 7, 8])
    assert n == len(system) and found == kv([*system, 1, 2, 3])   # the whole entry: the caller cuts it to n
    n, _ = cache.lookup([*system, 1, 2, 3])   # the last token's logits are needed: it is prefilled again
    assert n == len(system) + 2
    n, _ = cache.lookup([*system, 1, 2, 3, 4, 5])   # a longer prompt uses all of the entry
    assert n == len(system) + 3
    assert cache.lookup([*list(range(MIN_PREFIX - 1)), 5])[0] == 0
    assert (cache.hits, cache.hit_tokens) == (3, 3 * len(system) + 5)


def test_short_prefixes_are_not_worth_a_lookup_or_an_entry() -> None:
    cache = PrefixCache(1 << 20)
    cache.insert([1, 2, 3], kv([1, 2, 3]))
    assert len(cache) == 0 and not cache.wants([1, 2, 3])
    short = list(range(MIN_PREFIX + 1))
    cache.insert(short, kv(short))
    assert cache.lookup([*short[:MIN_PREFIX - 2], 999, 998, 997]) == (0, None)
    assert cache.lookup([*short[:MIN_PREFIX], 999])[0] == MIN_PREFIX
    assert cache.hits == 1


def test_an_entry_that_extends_another_replaces_it_and_bytes_are_bounded_lru() -> None:
    a = list(range(20))
    cache = PrefixCache(60 * PER_TOKEN)
    cache.insert(a, kv(a))
    assert not cache.wants(a) and cache.wants([*a, 50])
    cache.insert([*a, 50, 51], kv([*a, 50, 51]))   # serves all that `a` served
    assert len(cache) == 1 and cache.covers(a) and cache.bytes == 22 * PER_TOKEN
    assert cache.get(a) is None and cache.get([*a, 50, 51]) == kv([*a, 50, 51])
    b = list(range(200, 230))
    cache.insert(b, kv(b))
    assert cache.lookup([*a, 50, 9])[0] == 21        # `a…` is now the most recently used
    assert [ids for ids, _ in cache.items()] == [tuple([*a, 50, 51]), tuple(b)]
    c = list(range(400, 420))
    cache.insert(c, kv(c))                            # 22 + 30 + 20 > 60 tokens: `b` (least recent) goes
    assert cache.covers(a) and cache.covers(c) and not cache.covers(b)
    assert cache.bytes == 42 * PER_TOKEN == sum(len(v) for _, v in cache.items())
    assert [ids for ids, _ in cache.hottest(4)] == [tuple([*a, 50, 51])]


def test_an_entry_larger_than_half_the_budget_is_not_kept() -> None:
    cache = PrefixCache(60 * PER_TOKEN)   # one prompt may not take the whole cache
    big = list(range(31))
    cache.insert(big, kv(big))
    assert len(cache) == 0 and cache.bytes == 0
    half = list(range(30))
    cache.insert(half, kv(half))
    assert len(cache) == 1 and cache.bytes == 30 * PER_TOKEN


def test_the_hottest_entries_are_those_with_the_most_hits() -> None:
    cache = PrefixCache(1 << 20)
    prompts = [list(range(k * 100, k * 100 + 30)) for k in range(4)]
    for ids in prompts:
        cache.insert(ids, kv(ids))
    for k, uses in enumerate([1, 3, 0, 2]):
        for _ in range(uses):
            assert cache.lookup([*prompts[k], 7])[0] == 30
    assert [list(ids) for ids, _ in cache.hottest(2)] == [prompts[1], prompts[3]]
    assert [list(ids) for ids, _ in cache.hottest(9)] == [prompts[1], prompts[3], prompts[0]]   # unused: never
    longer = [*prompts[1], 5, 6]
    cache.insert(longer, kv(longer))   # replaces prompts[1]: its hits go with it
    assert [list(ids) for ids, _ in cache.hottest(9)] == [prompts[3], prompts[0]]


def test_one_tenants_entries_never_serve_anothers_prompt() -> None:
    """A prompt tenant acme sent, sent again by beta (or by a caller without a tenant): no hit, so no cached tokens
    and the whole prefill; beta's own copy is kept apart and serves beta."""
    cache = PrefixCache(1 << 20)
    secret = list(range(100, 140))
    cache.insert(secret, kv(secret), "acme")
    assert cache.lookup([*secret, 1], "acme")[0] == len(secret)
    for other in ("beta", None):
        assert cache.lookup([*secret, 1], other) == (0, None) and cache.lookup(secret[:-3], other) == (0, None)
        assert cache.wants(secret, other) and not cache.covers(secret, other) and cache.get(secret, other) is None
    assert (cache.hits, cache.hit_tokens) == (1, len(secret))   # the misses touched nothing
    cache.insert(secret, kv(secret), "beta")
    assert len(cache) == 2 and cache.lookup([*secret, 2], "beta")[0] == len(secret)
    longer = [*secret, 7, 8]
    cache.insert(longer, kv(longer), "beta")   # replaces beta's own prefix entry only
    assert cache.get(secret, "acme") == kv(secret) and cache.get(secret, "beta") is None
    assert [ids for ids, _ in cache.hottest(4, "acme")] == [tuple(secret)]
    assert [ids for ids, _ in cache.hottest(4, "beta")] == [] and cache.hottest(4) == []   # longer: no hit yet


def test_shared_entries_serve_every_tenant() -> None:
    """The contract's declared prefixes (SHARED) serve everyone; a tenant's prompt they cover adds nothing."""
    cache = PrefixCache(1 << 20)
    declared = list(range(30))
    cache.insert(declared, kv(declared), SHARED)
    for tenant in ("acme", "beta", None):
        assert cache.lookup([*declared, 5, 6], tenant)[0] == len(declared)
        assert not cache.wants(declared[:20], tenant)
    assert cache.hottest(4, "acme") == [] and cache.hottest(4, None) == []   # never handed over as learned


def test_a_full_cache_takes_from_the_tenant_holding_the_most() -> None:
    """One budget: a tenant holding no more than another keeps its entries however much the other sends."""
    cache = PrefixCache(100 * PER_TOKEN)
    mine = list(range(20))
    cache.insert(mine, kv(mine), "beta")
    for k in range(8):   # acme fills the cache again and again
        theirs = list(range(1000 * (k + 1), 1000 * (k + 1) + 30))
        cache.insert(theirs, kv(theirs), "acme")
        assert cache.bytes <= cache.limit_bytes
    assert cache.get(mine, "beta") == kv(mine)
    declared = list(range(500, 540))
    cache.insert(declared, kv(declared), SHARED)
    assert cache.get(declared, SHARED) == kv(declared) and cache.get(mine, "beta") == kv(mine)
    assert cache.bytes == sum(len(v) for _, v in cache.items()) <= cache.limit_bytes


def test_a_zero_budget_keeps_nothing() -> None:
    cache = PrefixCache(0)
    ids = list(range(40))
    assert not cache.wants(ids)
    cache.insert(ids, kv(ids))
    assert len(cache) == 0 and cache.lookup([*ids, 1]) == (0, None)


@pytest.mark.parametrize("other", [("model-abc", [1, 2, 4], "f16"), ("model-abc", [1, 2, 3], "q8_0"),
                                   ("model-xyz", [1, 2, 3], "f16"), ("model-abc", [1, 2], "f16")])
def test_snapshot_names_depend_on_the_model_the_tokens_and_the_kv_type(other: tuple[str, list[int], str]) -> None:
    name = snapshot_name("model-abc", [1, 2, 3], "f16")
    assert name == snapshot_name("model-abc", [1, 2, 3], "f16") and name.startswith("kv-") and name.endswith(":1")
    assert name != snapshot_name(*other)


def test_the_learned_list_is_replaced_whole_and_a_damaged_one_reads_as_empty(tmp_path: Path) -> None:
    assert snap.read_learned(tmp_path, "m") == []
    snap.write_learned(tmp_path, "m", ["kv-a:1", "kv-b:1"])
    snap.write_learned(tmp_path, "other", ["kv-c:1"])
    assert snap.read_learned(tmp_path, "m") == ["kv-a:1", "kv-b:1"]
    snap.write_learned(tmp_path, "m", ["kv-b:1"])
    assert snap.read_learned(tmp_path, "m") == ["kv-b:1"] and snap.read_learned(tmp_path, "other") == ["kv-c:1"]
    assert sorted(p.name for p in snap.learned_index(tmp_path, "m").parent.iterdir()) == ["m.json", "other.json"]
    for damaged in ("not json", '{"snapshots": "kv-a:1"}', '["kv-a:1"]', '{"snapshots": ["kv-a:1", 3]}'):
        snap.learned_index(tmp_path, "m").write_text(damaged)
        assert snap.read_learned(tmp_path, "m") == (["kv-a:1"] if damaged.endswith("3]}") else [])


def test_a_snapshot_round_trips_through_a_weight_store_exactly(tmp_path: Path) -> None:
    from ember.runtimes.llm_snapshot import opened as _store
    from ember.store.config import default_memory_dir

    ids = list(range(50))
    state = bytes(range(256)) * 40
    name = snapshot_name("model-abc", ids, "f16")
    try:
        with _store(tmp_path) as store:
            assert snap.restore(store, name) is None   # nothing by that name yet
            assert snap.save(store, name, ids, state) > len(state)
        with _store(tmp_path) as store:   # another process's store, later
            assert snap.restore(store, name) == (ids, state)
    finally:   # the store keeps its memory tier (in /dev/shm) for the instances sharing it
        shm = default_memory_dir(tmp_path)
        if shm is not None:
            shutil.rmtree(shm, ignore_errors=True)


def test_a_whole_entry_cache_serves_only_prompts_the_entry_begins_and_keeps_shorter_entries() -> None:
    """For an engine that cannot cut a sequence back (sliding windows): no entry is cut shorter."""
    cache = PrefixCache(1 << 20, whole=True)
    short, long = list(range(MIN_PREFIX)), list(range(MIN_PREFIX + 8))
    cache.insert(long, b"L" * 10)
    assert cache.lookup([*short, 999]) == (0, None)              # the longer entry would need a cut
    assert cache.wants(short)                                      # so the shorter prompt is new
    cache.insert(short, b"S" * 10)
    assert len(cache) == 2                                         # and the longer one does not replace it
    assert cache.lookup([*short, 999]) == (MIN_PREFIX, b"S" * 10)
    assert cache.lookup([*long, 5]) == (len(long), b"L" * 10)
    assert not cache.wants(long)


def test_an_aligned_lookup_cuts_a_hit_to_whole_steps() -> None:
    cache = PrefixCache(1 << 20)
    prompt = list(range(1000, 1100))
    cache.insert(prompt, kv(prompt))
    assert cache.lookup([*prompt[:70], 5, 6], align=32)[0] == 64          # 70 in common: two whole steps of 32
    assert cache.lookup([*prompt[:40], 5], align=32)[0] == 32
    assert cache.lookup([*prompt[:31], 5], align=32) == (0, None)          # no whole step in common
    assert cache.lookup([*prompt[:70], 5, 6])[0] == 70                     # unaligned: all of it


def test_an_aligned_lookup_skips_a_whole_entry_that_is_not_whole_steps() -> None:
    cache = PrefixCache(1 << 20, whole=True)
    cache.insert(list(range(1000, 1040)), kv(list(range(1000, 1040))))   # 40 tokens: not a multiple of 32
    assert cache.lookup([*range(1000, 1040), 1, 2], align=32) == (0, None)
    assert cache.lookup([*range(1000, 1040), 1, 2], align=8)[0] == 40
