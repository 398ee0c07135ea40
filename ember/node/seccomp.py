"""A small seccomp-BPF filter, built by hand: the system calls a model never needs answer EPERM.

No libseccomp: the program is a dozen instructions per architecture, assembled here and installed
with seccomp(SECCOMP_SET_MODE_FILTER, TSYNC) so that it covers every thread of the process (a
forked instance may already run a thread pool). It

- kills the process on a foreign architecture (a 32-bit `int 0x80` call would use other numbers);
- answers EPERM to the x32 ABI and to the denied calls: ptrace and process_vm_{read,write}v (reading
  another process's memory), mount and the new mount API, namespaces (unshare, setns, clone with
  CLONE_NEWUSER), kernel modules, kexec, reboot, swap, bpf, perf_event_open, keyrings, the clock,
  chroot, open_by_handle_at and userfaultfd;
- answers ENOSYS to clone3, whose flags live in memory a filter cannot read: glibc then falls back
  to clone, whose flags it can check (what container runtimes do);
- allows everything else.

`build_filter` is pure (a list of instructions), so tests check the program without installing it.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import platform
import struct

# Classic BPF opcodes (linux/filter.h).
_LD_W_ABS = 0x20       # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15          # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x35          # BPF_JMP | BPF_JGE | BPF_K
_JSET_K = 0x45         # BPF_JMP | BPF_JSET | BPF_K
_RET_K = 0x06          # BPF_RET | BPF_K

RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
RET_ALLOW = 0x7FFF0000

_NR, _ARCH, _ARG0_LOW = 0, 4, 16   # offsets in struct seccomp_data (args[0]'s low half: little-endian)
_X32_BIT = 0x40000000
CLONE_NEWUSER = 0x10000000

_SECCOMP_SET_MODE_FILTER = 1
_SECCOMP_FILTER_FLAG_TSYNC = 1
_PR_SET_NO_NEW_PRIVS = 38

DENIED = ("ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2", "pivot_root", "chroot",
          "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
          "unshare", "setns", "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
          "reboot", "swapon", "swapoff", "bpf", "perf_event_open", "keyctl", "add_key", "request_key",
          "acct", "settimeofday", "clock_settime", "sethostname", "setdomainname", "open_by_handle_at",
          "userfaultfd", "quotactl")


class Arch:
    def __init__(self, audit: int, seccomp_nr: int, numbers: dict[str, int], *, x32: bool = False) -> None:
        self.audit, self.seccomp_nr, self.numbers, self.x32 = audit, seccomp_nr, numbers, x32


# The new mount API (428-433), mount_setattr (442) and clone3 (435) share their numbers on every architecture.
_COMMON = {"open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
           "mount_setattr": 442, "clone3": 435}

ARCHES = {
    "x86_64": Arch(0xC000003E, 317, {
        **_COMMON, "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "mount": 165, "umount2": 166,
        "pivot_root": 155, "chroot": 161, "unshare": 272, "setns": 308, "init_module": 175, "finit_module": 313,
        "delete_module": 176, "kexec_load": 246, "kexec_file_load": 320, "reboot": 169, "swapon": 167,
        "swapoff": 168, "bpf": 321, "perf_event_open": 298, "keyctl": 250, "add_key": 248, "request_key": 249,
        "acct": 163, "settimeofday": 164, "clock_settime": 227, "sethostname": 170, "setdomainname": 171,
        "open_by_handle_at": 304, "userfaultfd": 323, "quotactl": 179, "clone": 56}, x32=True),
    "aarch64": Arch(0xC00000B7, 277, {
        **_COMMON, "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "mount": 40, "umount2": 39,
        "pivot_root": 41, "chroot": 51, "unshare": 97, "setns": 268, "init_module": 105, "finit_module": 273,
        "delete_module": 106, "kexec_load": 104, "kexec_file_load": 294, "reboot": 142, "swapon": 224,
        "swapoff": 225, "bpf": 280, "perf_event_open": 241, "keyctl": 219, "add_key": 217, "request_key": 218,
        "acct": 89, "settimeofday": 170, "clock_settime": 112, "sethostname": 161, "setdomainname": 162,
        "open_by_handle_at": 265, "userfaultfd": 282, "quotactl": 60, "clone": 220}),
}

Insn = tuple[int, int, int, int]   # (code, jt, jf, k)


def build_filter(arch: Arch, denied: tuple[str, ...] = DENIED) -> list[Insn]:
    """The filter program for `arch` (see the module docstring)."""
    eperm = RET_ERRNO | errno.EPERM
    prog: list[Insn] = [(_LD_W_ABS, 0, 0, _ARCH), (_JEQ_K, 1, 0, arch.audit), (_RET_K, 0, 0, RET_KILL_PROCESS),
                        (_LD_W_ABS, 0, 0, _NR)]
    if arch.x32:
        prog += [(_JGE_K, 0, 1, _X32_BIT), (_RET_K, 0, 0, eperm)]
    for name in denied:
        prog += [(_JEQ_K, 0, 1, arch.numbers[name]), (_RET_K, 0, 0, eperm)]
    prog += [(_JEQ_K, 0, 1, arch.numbers["clone3"]), (_RET_K, 0, 0, RET_ERRNO | errno.ENOSYS),
             # clone: a new user namespace is the one namespace an unprivileged process may still create.
             (_JEQ_K, 0, 3, arch.numbers["clone"]), (_LD_W_ABS, 0, 0, _ARG0_LOW),
             (_JSET_K, 0, 1, CLONE_NEWUSER), (_RET_K, 0, 0, eperm),
             (_RET_K, 0, 0, RET_ALLOW)]
    return prog


@functools.cache
def program(arch: Arch) -> bytes:
    """The filter as the kernel reads it (struct sock_filter[]), assembled once per process."""
    return b"".join(struct.pack("=HBBI", *insn) for insn in build_filter(arch))


def this_arch() -> Arch | None:
    return ARCHES.get(platform.machine())


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install(arch: Arch) -> None:
    """Set no_new_privs and install the filter on every thread of this process (OSError on failure)."""
    libc = _libc()
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_NO_NEW_PRIVS): {errno.errorcode.get(err, err)}")
    code = program(arch)
    raw = ctypes.create_string_buffer(code, len(code))
    fprog = _SockFprog(len(code) // 8, ctypes.cast(raw, ctypes.c_void_p))
    libc.syscall.restype = ctypes.c_long
    if libc.syscall(ctypes.c_long(arch.seccomp_nr), ctypes.c_long(_SECCOMP_SET_MODE_FILTER),
                    ctypes.c_long(_SECCOMP_FILTER_FLAG_TSYNC), ctypes.byref(fprog)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"seccomp(SET_MODE_FILTER): {errno.errorcode.get(err, err)}")
