"""Checking the job database's write-ahead log before SQLite replays it.

SQLite replays a WAL up to its first frame whose checksum or salt does not match and silently drops the rest;
a WAL whose header is bad is ignored whole, and deleted when the last connection closes. Jobs acknowledged
(202) in the dropped frames are gone without a word, and the server used to report `job_store: ok`. So before
the database is opened its WAL (left behind by a server that did not close cleanly) is read here:

- the header: magic, version, page size, checksum;
- each frame: its salts and the running checksum (SQLite's algorithm, either byte order), up to the first frame
  that fails; frames after it that carry this WAL's salts were written in this generation and are lost, and a
  frame cut short at the end too;
- the wal-index (`-shm`), when its header matches the WAL's salts, says how many frames were committed
  (`mxFrame`): a WAL shorter than that was truncated, even at a frame boundary, or to zero bytes.

Damage found: a copy of the WAL (and -shm) is kept beside the database (`jobs.sqlite3-wal.damaged-<UTC>`),
one ERROR line gives the counts (frames and commits past the last good one), and SQLite then replays what can
be: the valid prefix. Frames from an earlier generation (other salts, after the valid ones) are normal reuse,
not damage.
"""

from __future__ import annotations

import shutil
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path

WAL_MAGIC = {0x377F0682: "<", 0x377F0683: ">"}   # the checksums' byte order
WAL_VERSION = 3007000
HEADER, FRAME_HEADER = 32, 24


@dataclass(frozen=True)
class WalDamage:
    reason: str
    lost_frames: int
    lost_commits: int | None   # None: not known (frames counted from the wal-index only)
    kept: Path | None = None   # where the copy went
    good_frames: int = 0       # what SQLite can still replay

    def describe(self) -> str:
        commits = "" if self.lost_commits is None else f", {self.lost_commits} committed transaction(s)"
        return (f"{self.reason}: {self.lost_frames} frame(s){commits} cannot be replayed; jobs acknowledged, "
                f"claimed or finished in them are lost")


def _checksum(data: bytes, order: str, s0: int, s1: int) -> tuple[int, int]:
    words = struct.unpack(f"{order}{len(data) // 4}I", data)
    for i in range(0, len(words), 2):
        s0 = (s0 + words[i] + s1) & 0xFFFFFFFF
        s1 = (s1 + words[i + 1] + s0) & 0xFFFFFFFF
    return s0, s1


def _db_page_size(db: Path) -> int:
    try:
        with db.open("rb") as f:
            head = f.read(18)
        size = struct.unpack(">H", head[16:18])[0] if len(head) >= 18 else 4096
    except OSError:
        return 4096
    return 65536 if size == 1 else (size or 4096)


def _shm_frames(shm: Path, salts: bytes | None) -> int | None:
    """The wal-index's mxFrame, if its header is consistent and names this WAL's salts (None: a WAL without a
    header, whose salts are gone)."""
    try:
        with shm.open("rb") as f:
            head = f.read(96)
    except OSError:
        return None
    if len(head) < 96 or head[:48] != head[48:96]:
        return None   # being written, or not a wal-index: say nothing
    order = "<" if sys.byteorder == "little" else ">"
    mx_frame = struct.unpack_from(f"{order}I", head, 16)[0]
    if salts is not None and head[32:40] != salts:   # SQLite copies the WAL header's salt bytes as they are
        return None
    return int(mx_frame)


def check_wal(db: Path) -> WalDamage | None:
    """The damage in `db`'s WAL (None: no WAL, or a sound one). Reads only."""
    wal = db.with_name(db.name + "-wal")
    try:
        data = wal.read_bytes()
    except FileNotFoundError:
        return None
    if not data:   # as SQLite leaves it after a checkpoint that truncates (the index then says 0 frames)
        committed = _shm_frames(wal.with_name(db.name + "-shm"), None)
        if not committed:
            return None
        return WalDamage(f"the WAL is empty (zero bytes), yet its index says {committed} frame(s) were committed "
                         "(truncated)", committed, None)
    head = data[:HEADER]
    if len(head) < HEADER:
        frame = FRAME_HEADER + _db_page_size(db)
        return WalDamage("the WAL header is cut short", (len(data) + frame - 1) // frame, None)
    magic, version, page_size, _seq, salt1, salt2, c1, c2 = struct.unpack(">8I", head)
    order = WAL_MAGIC.get(magic)
    valid_size = page_size >= 512 and page_size <= 65536 and page_size & (page_size - 1) == 0
    if order is None or version != WAL_VERSION or not valid_size or _checksum(head[:24], order, 0, 0) != (c1, c2):
        frame = FRAME_HEADER + (page_size if valid_size else _db_page_size(db))
        return WalDamage("the WAL header is damaged (SQLite would ignore, then delete, the whole WAL)",
                         (len(data) - HEADER) // frame, None)
    frame_size = FRAME_HEADER + page_size
    s0, s1 = c1, c2
    valid = 0
    offset = HEADER
    while offset + frame_size <= len(data):
        fh = data[offset:offset + FRAME_HEADER]
        _page, _commit, f_salt1, f_salt2, f1, f2 = struct.unpack(">6I", fh)
        if (f_salt1, f_salt2) != (salt1, salt2):
            break
        n0, n1 = _checksum(fh[:8], order, s0, s1)
        n0, n1 = _checksum(data[offset + FRAME_HEADER:offset + frame_size], order, n0, n1)
        if (n0, n1) != (f1, f2):
            break
        s0, s1, valid, offset = n0, n1, valid + 1, offset + frame_size
    # Past the last good frame: frames of this generation (its salts) are lost work; others are stale reuse.
    lost = lost_commits = 0
    first_bad = offset
    while offset + FRAME_HEADER <= len(data):
        _page, commit, f_salt1, f_salt2, _f1, _f2 = struct.unpack(">6I", data[offset:offset + FRAME_HEADER])
        if (f_salt1, f_salt2) == (salt1, salt2):
            lost += 1
            lost_commits += commit != 0
        offset += frame_size
    committed = _shm_frames(wal.with_name(db.name + "-shm"), head[16:24])
    missing = committed - valid if committed is not None and committed > valid else 0
    if not lost and not missing:
        return None
    cut = (len(data) - HEADER) % frame_size != 0
    if not lost:   # every frame there is good, but fewer than were committed
        where = f"the WAL is shorter than its index says: {committed} frame(s) were committed, {valid} are there " \
                "(truncated)"
    else:
        where = f"the WAL is damaged at byte {first_bad} (frame {valid + 1})"
        if missing:
            where += f"; its index says {committed} frame(s) were committed, {valid} are good"
            where += " (truncated)" if cut else ""
        elif cut:
            where += " (the last one cut short)"
    # The commits are counted where the lost frames can still be read; frames gone (truncated) cannot be.
    return WalDamage(where, max(lost, missing), lost_commits if lost >= missing else None, good_frames=valid)


def keep_copy(db: Path, now: float) -> Path:
    """Copy the WAL (and -shm) aside, beside the database, before SQLite replays (and later deletes) it."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    wal = db.with_name(db.name + "-wal")
    dest, n = wal.with_name(f"{wal.name}.damaged-{stamp}"), 1
    while dest.exists():
        n += 1
        dest = wal.with_name(f"{wal.name}.damaged-{stamp}-{n}")
    shutil.copy2(wal, dest)
    dest.chmod(0o600)
    shm = db.with_name(db.name + "-shm")
    if shm.exists():
        shm_dest = dest.with_name(dest.name.replace("-wal.", "-shm.", 1))
        shutil.copy2(shm, shm_dest)
        shm_dest.chmod(0o600)
    return dest
