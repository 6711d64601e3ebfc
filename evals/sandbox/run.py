"""Run untrusted, model-written Python programs, each in its own kernel-enforced sandbox.

A pass is a positive signal: the in-sandbox runner (evals/sandbox/runner.py) writes a random token to a
result pipe only after every part of the program, the tests included, has returned. An exit code, printed
text or an early exit of any kind is never read as a pass.

Isolation (evals/sandbox/layers.py): bubblewrap gives each program its own PID, mount, network, IPC and UTS
namespaces, a bounded private /tmp, an unprivileged uid and rlimits set from outside. It is required: where it
cannot run, `require()` refuses with a one-line error naming what is missing, unless the user opted out
(--allow-weak-sandbox), in which case the older layers run (a network namespace, Landlock, rlimits and the
in-process audit hook) and the isolation recorded says so.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass

from qtoolkit.errors import QToolError

from . import layers as sandbox_layers
from .pipes import collect
from .runner import FAILED, RUNNER

_OUTPUT_KEEP = 4000  # bytes of stdout/stderr kept per program (the tail, where a traceback ends)
EXITED_EARLY = "exited before the tests ran"


class SandboxUnavailable(QToolError):
    """A required isolation layer is missing on this machine."""


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0
    cpu_s: int = 10
    memory_bytes: int = 1 << 30  # address space per process
    file_bytes: int = 16 << 20
    tmp_bytes: int = 64 << 20  # the private /tmp, all files together
    open_files: int = 64
    processes: int = 16  # tasks (processes and threads) of the sandbox uid
    output_bytes: int = 1 << 20  # stdout + stderr; past it the program is killed


@dataclass
class Result:
    passed: bool
    status: str  # "passed" | "failed" | EXITED_EARLY | "timeout" | "killed" | "output limit"
    returncode: int | None
    seconds: float
    stdout: str
    stderr: str


@dataclass(frozen=True)
class Isolation:
    mode: str  # "bubblewrap" | "weak"
    layers: tuple[str, ...]
    missing: tuple[str, ...] = ()

    def describe(self) -> dict:
        return asdict(self)


def isolation() -> dict:
    """Which layers this machine grants (probed once)."""
    return sandbox_layers.probe()


def require(allow_weak: bool = False) -> Isolation:
    """The isolation model code will run under; raises SandboxUnavailable when bubblewrap cannot run."""
    found = isolation()
    if found["bubblewrap"]:
        return Isolation("bubblewrap", ("pid namespace", "mount namespace", "network namespace",
                                        "ipc namespace", "bounded tmpfs", "unprivileged uid", "rlimits",
                                        "audit hook"))
    if not allow_weak:
        raise SandboxUnavailable(f"cannot run model-written code safely: missing {'; '.join(found['missing'])}; "
                                 "install it, or pass --allow-weak-sandbox to run with weaker isolation")
    layers = [n for n in ("network_namespace", "landlock") if found[n]]
    return Isolation("weak", (*layers, "rlimits", "audit hook"), tuple(found["missing"]))


def run_program(source: str | list[str], limits: Limits = Limits(), audit_hook: bool = True,
                mode: str | None = None) -> Result:
    """Execute the program (its parts in order, one namespace); never raises for anything the program does.

    `mode` is "bubblewrap" or "weak" (default: bubblewrap where it runs, else weak). `audit_hook=False`
    leaves only the kernel and process layers (tests use it to check them alone).
    """
    parts = [source] if isinstance(source, str) else list(source)
    mode = mode or ("bubblewrap" if isolation()["bubblewrap"] else "weak")
    token = secrets.token_hex(16)
    read_end, write_end = os.pipe()
    payload = json.dumps({"parts": parts, "token": token, "fd": write_end, "audit_hook": audit_hook,
                          "nproc": limits.processes if os.geteuid() != 0 or mode == "weak" else None})
    workdir = None
    as_root = os.geteuid() == 0 and mode == "bubblewrap"
    rlimits = sandbox_layers.rlimit_pairs(limits.cpu_s, limits.memory_bytes, limits.file_bytes,
                                          limits.open_files, limits.processes if as_root else None)
    try:
        if mode == "bubblewrap":  # no preexec_fn: the child starts by vfork (layers.with_limits says why)
            argv = sandbox_layers.with_limits(sandbox_layers.bwrap_command(["-c", RUNNER], limits.tmp_bytes), rlimits)
            cwd, setup = None, None
        else:
            workdir = os.path.realpath(tempfile.mkdtemp(prefix="qtool-sandbox-"))
            os.chmod(workdir, 0o700)
            argv, cwd = [os.path.realpath(sys.executable), "-I", "-c", RUNNER], workdir
            setup = sandbox_layers.weak_setup(workdir, sandbox_layers.rlimits(rlimits), isolation())
        try:
            proc = subprocess.Popen(argv, cwd=cwd, env={}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True, pass_fds=(write_end,),
                                    preexec_fn=setup)
        finally:
            os.close(write_end)
        got = collect(proc, payload.encode("ascii"), read_end, wall_s=limits.wall_s, keep=_OUTPUT_KEEP,
                      output_limit=limits.output_bytes)
    except OSError as e:  # the sandbox itself could not start: the item fails, the run goes on
        os.close(read_end)
        return Result(False, "failed", None, 0.0, "", f"sandbox did not start: {e}")
    finally:
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    passed = got.result == token.encode() and got.returncode == 0 and not (got.timed_out or got.output_exceeded)
    return Result(passed, _status(passed, got.returncode, got.timed_out, got.output_exceeded), got.returncode,
                  got.seconds, got.stdout.decode(errors="replace"), got.stderr.decode(errors="replace"))


def _status(passed: bool, rc: int | None, timed_out: bool, exceeded: bool) -> str:
    if passed:
        return "passed"
    if timed_out:
        return "timeout"
    if exceeded:
        return "output limit"
    if rc is None or rc < 0 or rc > 128:  # a signal (bwrap reports a signalled child as 128 + n)
        return "killed"
    return "failed" if rc == FAILED else EXITED_EARLY  # any other exit without the token left early
