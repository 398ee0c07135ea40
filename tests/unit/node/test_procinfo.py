"""/proc parsing on fixtures, and on this very process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ember.node import procinfo

ROLLUP = """\
55cb9c591000-7ffe80cc4000 ---p 00000000 00:00 0                          [rollup]
Rss:              412340 kB
Pss:              210004 kB
Pss_Dirty:          1200 kB
Shared_Clean:     400000 kB
Shared_Dirty:       2000 kB
Private_Clean:       340 kB
Private_Dirty:     10000 kB
Swap:                  0 kB
"""


def test_smaps_rollup_gives_rss_pss_uss_in_bytes() -> None:
    usage = procinfo.parse_smaps_rollup(ROLLUP)
    assert usage.rss_bytes == 412340 * 1024
    assert usage.pss_bytes == 210004 * 1024
    assert usage.uss_bytes == (340 + 10000) * 1024


def test_smaps_rollup_without_rss_is_an_error() -> None:
    with pytest.raises(ValueError, match="Rss/Pss"):
        procinfo.parse_smaps_rollup("Swap: 0 kB\n")


def test_stat_state_survives_odd_process_names() -> None:
    assert procinfo.parse_stat_state("1234 (py thon) x) T 1 1234 1234 0") == "T"
    assert procinfo.parse_stat_state("77 (sleep) Z 1 77") == "Z"
    with pytest.raises(ValueError):
        procinfo.parse_stat_state("garbage")


def test_fake_proc_tree(tmp_path: Path) -> None:
    (tmp_path / "42" / "task" / "42").mkdir(parents=True)
    (tmp_path / "42" / "task" / "43").mkdir()
    (tmp_path / "42" / "stat").write_text("42 (model) S 1 42")
    (tmp_path / "42" / "smaps_rollup").write_text(ROLLUP)
    (tmp_path / "43").mkdir()
    (tmp_path / "43" / "stat").write_text("43 (gone) Z 1 43")
    assert procinfo.memory_of(42, tmp_path).pss_bytes == 210004 * 1024
    assert procinfo.thread_count(42, tmp_path) == 2
    assert procinfo.is_alive(42, tmp_path)
    assert not procinfo.is_alive(43, tmp_path)   # a zombie is dead
    assert not procinfo.is_alive(44, tmp_path)
    with pytest.raises(ProcessLookupError):
        procinfo.memory_of(44, tmp_path)


def test_this_process() -> None:
    usage = procinfo.memory_of(os.getpid())
    assert 0 < usage.uss_bytes <= usage.pss_bytes <= usage.rss_bytes
    assert procinfo.state_of(os.getpid()) in ("R", "S")
    assert procinfo.thread_count() >= 1


def test_maps_lists_file_mappings_only() -> None:
    text = (
        "7f00a0000000-7f00a5000000 r--s 00000000 08:01 1234   /models/minilm/model.safetensors\n"
        "7f00b0000000-7f00b0021000 rw-p 00000000 00:00 0 \n"
        "7ffd1000-7ffd2000 rw-p 00000000 00:00 0                  [stack]\n"
        "7f00c0000000-7f00c0001000 r-xp 00000000 08:01 99     /usr/lib/lib with space.so (deleted)\n"
    )
    assert procinfo.parse_maps(text) == [
        (0x7F00A0000000, 0x7F00A5000000, "/models/minilm/model.safetensors"),
        (0x7F00C0000000, 0x7F00C0001000, "/usr/lib/lib with space.so"),
    ]
    assert any(path.endswith(".so") or "python" in path for _, _, path in procinfo.file_mappings())
