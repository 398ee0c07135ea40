"""A tier's sqlite index: last-use updates for many chunks at once."""

from __future__ import annotations

from pathlib import Path

from ember.store.tiers.index import ChunkIndex, Stamp


def test_touch_marks_every_chunk_used_past_the_statement_limit(tmp_path: Path) -> None:
    index = ChunkIndex(tmp_path / "index.db")
    digests = [f"{i:064x}" for i in range(1000)]
    for digest in digests:
        index.put(digest, Stamp(1, 2, 3, 4), now=1.0)
    index.touch(iter(digests[:950]), now=5.0)  # more than one statement's worth of digests
    index.touch([], now=9.0)
    used = {d: row.used for d, row in index.rows().items()}
    index.close()
    assert {d for d, t in used.items() if t == 5.0} == set(digests[:950])
    assert {d for d, t in used.items() if t == 1.0} == set(digests[950:])
