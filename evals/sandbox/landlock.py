"""Kernel-enforced filesystem confinement (Linux Landlock) for sandboxed programs.

Called in the child between fork and exec: after `confine()` the process and everything it starts can read
and execute only the Python installation and system libraries, and can write only beneath its own working
folder. Landlock binds root too (unlike file permissions, which root bypasses), needs no privileges and
cannot be undone by the confined process. Where the ABI allows it, signals to processes outside the
sandbox are blocked as well. Without Landlock (old kernels) `available()` is 0 and callers fall back to
the in-process audit hook alone.
"""

from __future__ import annotations

import ctypes
import os
import platform
from functools import lru_cache

# Syscall numbers are shared by x86_64 and the generic table (aarch64, riscv64).
_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38

EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_FS_BITS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 5: (1 << 16) - 1}
_FILE_ONLY_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | (1 << 14) | (1 << 15)  # truncate, ioctl_dev
_SCOPE_SIGNAL_AND_UNIX = (1 << 0) | (1 << 1)  # ABI 6: abstract unix sockets, signals


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


@lru_cache(maxsize=1)
def available() -> int:
    """The kernel's Landlock ABI version (0 when Landlock is missing or disabled)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "aarch64", "riscv64"):
        return 0
    abi = _libc.syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    return max(int(abi), 0)


def _handled_fs(abi: int) -> int:
    return _FS_BITS_BY_ABI[max(k for k in _FS_BITS_BY_ABI if k <= abi)]


def _add_rule(ruleset_fd: int, path: str, rights: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return  # a read-only root that does not exist on this system is simply not granted
    try:
        if not os.path.isdir(path):
            rights &= _FILE_ONLY_RIGHTS
        attr = _PathBeneathAttr(rights, fd)
        if _libc.syscall(_SYS_ADD_RULE, ruleset_fd, _RULE_PATH_BENEATH, ctypes.byref(attr), 0) != 0:
            raise OSError(ctypes.get_errno(), f"landlock_add_rule({path})")
    finally:
        os.close(fd)


def confine(read_only: list[str], read_write: list[str], abi: int | None = None) -> None:
    """Restrict this process (and its future children) to the given file hierarchies. Raises OSError."""
    abi = available() if abi is None else abi
    if abi < 1:
        raise OSError("landlock is not available")
    handled = _handled_fs(abi)
    attr = _RulesetAttr(handled, 0, _SCOPE_SIGNAL_AND_UNIX if abi >= 6 else 0)
    size = ctypes.sizeof(_RulesetAttr) if abi >= 6 else 16 if abi >= 4 else 8
    ruleset_fd = _libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), 0)
    if ruleset_fd < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    try:
        for path in read_only:
            _add_rule(ruleset_fd, path, EXECUTE | READ_FILE | READ_DIR)
        for path in read_write:
            _add_rule(ruleset_fd, path, handled)
        if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        if _libc.syscall(_SYS_RESTRICT_SELF, ruleset_fd, 0) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    finally:
        os.close(ruleset_fd)
