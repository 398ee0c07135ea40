"""What /proc says about a process: memory (RSS, PSS, USS), state, threads.

PSS splits each shared page among the processes mapping it, so the PSS of a template
plus its replicas adds up to what they really cost together; USS (private pages) is
what one replica adds on its own.
"""

from __future__ import annotations

from pathlib import Path

from ember.node.api import MemoryUsage

PROC = Path("/proc")


def parse_smaps_rollup(text: str) -> MemoryUsage:
    """RSS, PSS and USS from the text of /proc/PID/smaps_rollup (values there are in kB)."""
    kb: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        fields = rest.split()
        if sep and len(fields) == 2 and fields[1] == "kB" and fields[0].isdigit():
            kb[key.strip()] = int(fields[0])
    if "Rss" not in kb or "Pss" not in kb:
        raise ValueError("smaps_rollup: no Rss/Pss lines")
    private = kb.get("Private_Clean", 0) + kb.get("Private_Dirty", 0)
    return MemoryUsage(rss_bytes=kb["Rss"] * 1024, pss_bytes=kb["Pss"] * 1024, uss_bytes=private * 1024)


def memory_of(pid: int, proc: Path = PROC) -> MemoryUsage:
    """The process's memory; raises ProcessLookupError when it is gone."""
    try:
        return parse_smaps_rollup((proc / str(pid) / "smaps_rollup").read_text())
    except (FileNotFoundError, ProcessLookupError):
        raise ProcessLookupError(pid) from None


def parse_stat_state(text: str) -> str:
    """The one-letter state (R, S, T, Z, ...) from /proc/PID/stat; the name may hold spaces and ')'."""
    _, sep, rest = text.rpartition(")")
    if not sep or not rest.split():
        raise ValueError("stat: no state field")
    return rest.split()[0]


def state_of(pid: int, proc: Path = PROC) -> str | None:
    """The process's state letter, or None when it does not exist."""
    try:
        return parse_stat_state((proc / str(pid) / "stat").read_text())
    except (FileNotFoundError, ProcessLookupError):
        return None


def is_alive(pid: int, proc: Path = PROC) -> bool:
    """True unless the process is gone or a zombie (dead, not yet reaped)."""
    return state_of(pid, proc) not in (None, "Z", "X")


def thread_count(pid: int | str = "self", proc: Path = PROC) -> int:
    """Threads of the process (forking is only safe with exactly one)."""
    try:
        return sum(1 for _ in (proc / str(pid) / "task").iterdir())
    except (FileNotFoundError, ProcessLookupError):
        return 0


def child_in_namespace(parent: int, ns_pid: int, proc: Path = PROC) -> int:
    """The pid (as this process sees it) of `parent`'s child whose pid in its own pid namespace is `ns_pid`: a
    fork server in a pid namespace of its own (a restored template) reports its children's pids there. 0: none."""
    try:
        tasks = list((proc / str(parent) / "task").iterdir())
    except (FileNotFoundError, ProcessLookupError):
        return 0
    for task in tasks:
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in children:
            try:
                status = (proc / child / "status").read_text()
            except OSError:
                continue
            line = next((x for x in status.splitlines() if x.startswith("NSpid:")), "")
            if line.split()[-1:] == [str(ns_pid)]:
                return int(child)
    return 0


def parse_maps(text: str) -> list[tuple[int, int, str]]:
    """(start, end, path) of each file-backed mapping in the text of /proc/PID/maps."""
    out = []
    for line in text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            start, _, end = fields[0].partition("-")
            out.append((int(start, 16), int(end, 16), fields[5].removesuffix(" (deleted)")))
    return out


def file_mappings(pid: int | str = "self", proc: Path = PROC) -> list[tuple[int, int, str]]:
    return parse_maps((proc / str(pid) / "maps").read_text())
