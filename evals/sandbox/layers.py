"""How a sandboxed program is started: the bubblewrap command line (the required layer) or, only when the user
opts out with --allow-weak-sandbox, the older in-process layers (network namespace, Landlock, rlimits).

Why bubblewrap: it is Debian's packaged, audited sandbox (Flatpak's), it needs no daemon and no setuid bit when
run as root or with user namespaces, and one command line gives every kernel layer the sandbox needs:
- PID namespace (`--unshare-pid`, `--die-with-parent`): killing bwrap kills the namespace's init, and the
  kernel then kills every process in it, including ones that called setsid or daemonized;
- mount namespace: an empty root with only system directories and the Python installation bound read-only,
  a fresh /proc of the new PID namespace, a minimal /dev, and a private tmpfs /tmp whose total size is
  bounded by `--size` (ENOSPC past it, whatever the number of files), so home, the working tree and the
  results are not there to read, and no AF_UNIX socket path outside is reachable;
- network namespace (`--unshare-net`): no interface but a down loopback, and no abstract-socket listener of
  the host (abstract AF_UNIX names belong to the network namespace); IPC and UTS namespaces too;
- `--new-session`: the program cannot push input into the caller's terminal.
Processes: RLIMIT_NPROC does not bind uid 0, so as root the program runs as a dedicated unprivileged uid
(setpriv, after bwrap has set the namespaces up, with every capability dropped and no_new_privs); as a normal
user bwrap runs it in a new user namespace, where the limit counts the sandbox's own tasks. Memory, CPU, file
size and open files are rlimits set before bwrap starts, which the program cannot raise.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from functools import lru_cache

from . import landlock

SANDBOX_UID_BASE = 2_000_000  # + the evaluator's pid: a uid no account uses, one per evaluator process


def sandbox_uid(evaluator_pid: int | None = None) -> int:
    """The uid programs of this evaluator run as (as root): RLIMIT_NPROC then counts only their tasks, and two
    evaluators running at once do not share the bound."""
    return SANDBOX_UID_BASE + (os.getpid() if evaluator_pid is None else evaluator_pid)
_CLONE_NEWNET, _CLONE_NEWUSER = 0x40000000, 0x10000000


def python_roots() -> list[str]:
    """The Python installation: the only thing of the user's file system the program can see."""
    exe = os.path.realpath(sys.executable)
    roots = {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, sys.exec_prefix)}
    if not any(exe.startswith(r + "/") for r in roots):
        roots.add(os.path.dirname(exe))
    return sorted(roots)


def _system_binds() -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for f in ("/etc/ld.so.cache", "/etc/localtime"):
        args += ["--ro-bind-try", f, f]
    return args


def bwrap_command(python_args: list[str], tmp_bytes: int) -> list[str]:
    """argv that runs `python -I ...python_args` inside a fresh bubblewrap sandbox."""
    exe = os.path.realpath(sys.executable)
    cmd = [shutil.which("bwrap") or "bwrap", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
           "--unshare-cgroup-try", "--die-with-parent", "--new-session", *_system_binds()]
    for root in python_roots():
        cmd += ["--ro-bind", root, root]
    cmd += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", str(tmp_bytes), "--tmpfs", "/tmp",
            "--chdir", "/tmp", "--clearenv"]
    if os.geteuid() == 0:
        uid = sandbox_uid()
        cmd += ["--", shutil.which("setpriv") or "/usr/bin/setpriv", f"--reuid={uid}", f"--regid={uid}",
                "--clear-groups", "--inh-caps=-all", "--bounding-set=-all",
                "--no-new-privs"]
    else:
        cmd += ["--unshare-user", "--disable-userns", "--cap-drop", "ALL", "--"]
    return [*cmd, exe, "-I", *python_args]


def within_hard_limit(kind: int, soft: int, hard: int) -> tuple[int, int]:
    """(soft, hard) lowered to the hard limit this process already runs under (an operator's `ulimit -f`): a
    limit cannot be raised past it, and asking to would fail every program's start."""
    ceiling = resource.getrlimit(kind)[1]
    if ceiling == resource.RLIM_INFINITY:
        return soft, hard
    return min(soft, ceiling), min(hard, ceiling)


RlimitPairs = list[tuple[int, int, int]]  # (resource.RLIMIT_*, soft, hard)

# Sets the rlimits, then execs the sandbox (bwrap): started with vfork, the evaluator's own pages are never
# copied into a child, where a forked child that ran a Python `preexec_fn` counted its parent's whole
# resident heap a second time until exec (a 5 GiB eval forked a 5 GiB child for each HumanEval program).
SET_LIMITS_AND_EXEC = ("import json, os, resource, sys\n"
                       "for kind, soft, hard in json.loads(sys.argv[1]):\n"
                       "    resource.setrlimit(kind, (soft, hard))\n"
                       "os.execv(sys.argv[2], sys.argv[2:])\n")


def rlimit_pairs(cpu_s: int, memory_bytes: int, file_bytes: int, open_files: int,
                 processes: int | None) -> RlimitPairs:
    """The sandbox's rlimits, each lowered to the hard limit this process already runs under."""
    wanted = [(resource.RLIMIT_CPU, cpu_s, cpu_s + 1), (resource.RLIMIT_AS, memory_bytes, memory_bytes),
              (resource.RLIMIT_FSIZE, file_bytes, file_bytes), (resource.RLIMIT_NOFILE, open_files, open_files),
              (resource.RLIMIT_CORE, 0, 0)]
    if processes is not None:
        wanted.append((resource.RLIMIT_NPROC, processes, processes))
    return [(kind, *within_hard_limit(kind, soft, hard)) for kind, soft, hard in wanted]


def with_limits(argv: list[str], limits: RlimitPairs) -> list[str]:
    """argv run under `limits`: a small Python (no site, no qtoolkit) sets them and execs argv, so the sandbox
    starts with the limits it cannot raise, and the evaluator needs no code between fork and exec."""
    return [os.path.realpath(sys.executable), "-I", "-S", "-c", SET_LIMITS_AND_EXEC,
            json.dumps([list(p) for p in limits]), *argv]


def rlimits(limits: RlimitPairs):
    """The same limits as a `preexec_fn` (the weak sandbox's setup runs in the forked child anyway)."""
    def setup() -> None:  # runs between fork and exec: no Python-level locks, no imports
        for kind, soft, hard in limits:
            resource.setrlimit(kind, (soft, hard))
    return setup


def weak_setup(workdir: str, limits_setup, layers: dict[str, bool]):
    """The opt-out path: rlimits, a network namespace and Landlock where the kernel grants them."""
    def setup() -> None:
        if layers["network_namespace"]:
            _new_netns()
        limits_setup()
        if layers["landlock"]:
            landlock.confine(python_roots() + ["/usr", "/lib", "/lib64", "/bin", "/etc/ld.so.cache"],
                             [workdir, "/dev/null"])
    return setup


def _new_netns() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNET) != 0 and libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET)")


def _probe(fn) -> bool:
    pid = os.fork()
    if pid == 0:
        try:
            fn()
            os._exit(0)
        except BaseException:
            os._exit(1)
    deadline = time.monotonic() + 10.0  # every wait is bounded, even this one
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status) == 0
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return False


@lru_cache(maxsize=1)
def probe() -> dict:
    """Which layers this machine grants, probed once: bubblewrap is tried for real on a trivial program."""
    missing = []
    if shutil.which("bwrap") is None:
        missing.append("bubblewrap (bwrap not found: apt-get install bubblewrap)")
    elif os.geteuid() == 0 and shutil.which("setpriv") is None:
        missing.append("setpriv (util-linux) to drop root inside the sandbox")
    else:
        try:
            p = subprocess.run(bwrap_command(["-c", "pass"], 1 << 20), capture_output=True, timeout=30,
                               stdin=subprocess.DEVNULL)
            if p.returncode != 0:
                why = p.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit {p.returncode}"]
                missing.append(f"user/PID/mount namespaces for bubblewrap ({why[0]})")
        except (OSError, subprocess.TimeoutExpired) as e:
            missing.append(f"a working bubblewrap ({type(e).__name__}: {e})")
    return {"bubblewrap": not missing, "missing": missing,
            "network_namespace": _probe(_new_netns), "landlock": landlock.available() > 0}
