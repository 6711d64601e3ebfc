"""A process tree's memory, two ways, and `qtool bench memory`: a command run with its tree sampled into JSON.

Summed RSS counts a page once per process that maps it, so a child forked from a large parent (before it execs)
or two processes mapping the same libraries count those pages twice. Summed PSS (proportional set size, from
/proc/PID/smaps_rollup) splits each shared page between the processes that share it, so the sum over the tree
is what the tree holds: the figure to compare two runs by. RSS is kept beside it (what `ps` and top show).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from ..errors import QToolError
from ..io import write_json

GIB = 1 << 30


def pss_bytes(pid: int) -> int | None:
    """A process's PSS from /proc/PID/smaps_rollup (Linux 4.14+), or None where it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024  # the kernel writes kB
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass(frozen=True)
class TreeSample:
    """One reading of a process tree: summed RSS and (when asked for) summed PSS, and how many processes."""

    rss_bytes: int
    pss_bytes: int | None
    processes: int
    servers: int  # `qtool serve` processes among them
    root_pss_bytes: int | None = None  # the root's own PSS: what a long-lived parent keeps between its steps


def tree_sample(root: psutil.Process, *, pss: bool = False, include_root: bool = True) -> TreeSample:
    """Sum over `root` (unless left out) and every descendant alive now; a process that exits midway counts 0."""
    try:
        procs = ([root] if include_root else []) + root.children(recursive=True)
    except psutil.Error:
        procs = []
    rss, pss_sum, servers, seen, root_pss = 0, 0 if pss else None, 0, 0, None
    for p in procs:
        with contextlib.suppress(psutil.Error):
            rss += p.memory_info().rss
            seen += 1
            servers += " serve " in " ".join(p.cmdline()) + " "
            if pss_sum is not None:
                own = pss_bytes(p.pid) or 0
                pss_sum += own
                root_pss = own if p.pid == root.pid else root_pss
    return TreeSample(rss, pss_sum, seen, servers, root_pss)


@dataclass
class Peak:
    """The largest reading of one figure: bytes, when (seconds from the start) and over how many processes."""

    bytes: int = 0
    at_s: float = 0.0
    processes: int = 0

    def offer(self, value: int | None, at_s: float, processes: int) -> None:
        if value is not None and value > self.bytes:
            self.bytes, self.at_s, self.processes = value, at_s, processes

    def to_json(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "gib": round(self.bytes / GIB, 3), "at_s": round(self.at_s, 2),
                "processes": self.processes}


@dataclass
class MemoryRun:
    """`qtool bench memory`'s result: the command, its exit status, its peaks and a once-a-second timeline."""

    command: list[str]
    every_s: float
    rc: int | None = None
    interrupted: bool = False  # stopped (Ctrl-C, SIGTERM) before the command ended: its peaks so far
    wall_s: float = 0.0
    rss: Peak = field(default_factory=Peak)
    pss: Peak = field(default_factory=Peak)
    root_pss: Peak = field(default_factory=Peak)  # the command's own process, apart from its children
    # [seconds, max summed RSS GiB, max summed PSS GiB, processes, the root's max PSS GiB] per second of the run
    timeline: list[list[float]] = field(default_factory=list)
    status_lines: list[tuple[float, str]] = field(default_factory=list)  # the command's `qtool:` lines, timed

    def to_json(self) -> dict[str, Any]:
        return {"command": self.command, "rc": self.rc, "interrupted": self.interrupted,
                "wall_s": round(self.wall_s, 1),
                "what": f"the command's process tree (it and every descendant, not the sampler), every "
                        f"{self.every_s} s: summed PSS (/proc/PID/smaps_rollup; a page shared by n processes "
                        "counts 1/n in each, so the sum is what the tree holds) and summed RSS (a shared page "
                        "counts in every process: a forked child counts its parent's pages again)",
                "peak_pss": self.pss.to_json(), "peak_rss": self.rss.to_json(),
                "peak_root_pss": self.root_pss.to_json(),
                "timeline_s_rss_pss_gib_processes_root_pss_gib": self.timeline,
                "status_lines": [[round(t, 1), s] for t, s in self.status_lines]}


class _Timeline:
    """Readings folded into one row a second (each figure's largest), so a long run stays a small file."""

    def __init__(self, run: MemoryRun):
        self.run, self.second, self.row = run, -1, [0.0, 0.0, 0.0, 0.0, 0.0]

    def add(self, t: float, s: TreeSample) -> None:
        if int(t) != self.second:
            self.flush()
            self.second, self.row = int(t), [round(t, 1), 0.0, 0.0, 0.0, 0.0]
        self.row[1] = max(self.row[1], round(s.rss_bytes / GIB, 3))
        self.row[2] = max(self.row[2], round((s.pss_bytes or 0) / GIB, 3))
        self.row[3] = max(self.row[3], s.processes)
        self.row[4] = max(self.row[4], round((s.root_pss_bytes or 0) / GIB, 3))

    def flush(self) -> None:
        if self.second >= 0:
            self.run.timeline.append(self.row)


def _relay_stderr(proc: subprocess.Popen, run: MemoryRun, start: float) -> None:
    """Pass the command's stderr through, keeping its `qtool:` status lines with their time."""
    assert proc.stderr is not None
    for raw in proc.stderr:
        sys.stderr.buffer.write(raw)
        sys.stderr.buffer.flush()
        line = raw.decode(errors="replace").strip()
        if line.startswith("qtool:"):
            run.status_lines.append((time.monotonic() - start, line[:200]))


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_sampled(command: list[str], every_s: float = 0.5) -> MemoryRun:
    """Run `command` to its end with its process tree sampled every `every_s` seconds."""
    if not command:
        raise QToolError("no command to measure: give it after --, e.g. qtool bench memory --output m.json -- "
                         "qtool signoff --model default")
    if every_s <= 0:
        raise QToolError(f"--every must be a positive number of seconds, got {every_s}")
    run = MemoryRun(list(command), every_s)
    start = time.monotonic()
    try:
        proc = subprocess.Popen(command, stderr=subprocess.PIPE)
    except OSError as e:
        raise QToolError(f"cannot start {command[0]!r} ({e.strerror}): give a command on PATH or its path") from None
    relay = threading.Thread(target=_relay_stderr, args=(proc, run, start), daemon=True)
    relay.start()
    root, timeline = psutil.Process(proc.pid), _Timeline(run)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        while proc.poll() is None:
            t = time.monotonic() - start
            s = tree_sample(root, pss=True)
            run.rss.offer(s.rss_bytes, t, s.processes)
            run.pss.offer(s.pss_bytes, t, s.processes)
            run.root_pss.offer(s.root_pss_bytes, t, 1)
            timeline.add(t, s)
            time.sleep(every_s)
    except KeyboardInterrupt:  # the peaks so far are still written; the command does not outlive them
        run.interrupted = True
        proc.terminate()
    finally:
        signal.signal(signal.SIGTERM, previous)
        run.rc = proc.wait()
        relay.join(timeout=5)
        run.wall_s = time.monotonic() - start
        timeline.flush()
    return run


def measure_command(command: list[str], output: str | os.PathLike[str], every_s: float = 0.5) -> MemoryRun:
    """run_sampled, written to `output` as JSON (atomically)."""
    out = Path(output)
    if out.is_dir():
        raise QToolError(f"--output {out} is a folder: give a file name, e.g. {out / 'memory.json'}")
    run = run_sampled(command, every_s)
    write_json(out, run.to_json())
    return run
