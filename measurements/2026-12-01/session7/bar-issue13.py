"""Issue 13's bar, tried as a new user would, through the `qtool` command (observed outcomes -> bar-issue13.json).

Part 1: a hostile battery of HumanEval/0 completions through `qtool eval --task code --completions FILE`.
Every program must be scored failed; the listeners outside (AF_UNIX at a file path, abstract AF_UNIX, TCP on
127.0.0.1) must receive nothing; the marker files (home, the working tree, an earlier results file, the live
results file, the evaluator's /proc environ) must stay unread and unwritten; no process may be left; the
evaluator must finish in bounded time and memory, without a traceback. Two deliberate in-process forgeries
(reading the runner's token through a frame walk; an answer whose __eq__ is always True) are run apart and
recorded as what they are: gaming the tests from inside, which no in-process harness can exclude.

Part 2: each verdict path through `qtool signoff --rejudge` on fabricated step outputs: PASS 0, FAIL 1,
error 2 (a corrupt steps.json), INCONCLUSIVE 3.

Run from the repository root: QTOOLKIT_SRC=$PWD python3 measurements/2026-12-01/session7/bar-issue13.py
"""
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from qtoolkit.evals.data import humaneval_problems
from qtoolkit.evals.sandbox.layers import SANDBOX_UID_BASE
from qtoolkit.evals.stats.paired import paired_delta

HERE = Path(__file__).resolve().parent
SECRET = "QTOOL-BAR-SECRET"
SPAWN = """
def spawn(argv, setsid=False):
    import _posixsubprocess, os
    r, w = os.pipe()
    return _posixsubprocess.fork_exec([a.encode() for a in argv], [argv[0].encode()], True, (), None, None,
        -1, -1, -1, -1, -1, -1, r, w, True, setsid, -1, None, None, None, -1, None, False)
"""


class Listeners:
    """AF_UNIX at a file path, abstract AF_UNIX, TCP on 127.0.0.1: everything that reaches them is recorded."""

    def __init__(self, path: Path):
        self.received: list[str] = []
        self.abstract = f"\0qtool-bar-{os.getpid()}"
        self.socks = []
        for family, addr in ((socket.AF_UNIX, str(path)), (socket.AF_UNIX, self.abstract),
                             (socket.AF_INET, ("127.0.0.1", 0))):
            s = socket.socket(family, socket.SOCK_STREAM)
            s.bind(addr)
            s.listen(8)
            s.settimeout(0.1)
            self.socks.append(s)
        self.tcp_port = self.socks[2].getsockname()[1]
        self.stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop:
            for s in self.socks:
                try:
                    conn, _ = s.accept()
                except OSError:
                    continue
                conn.settimeout(1)
                try:
                    self.received.append(f"{s.family.name}:" + conn.recv(100).decode(errors="replace"))
                except OSError:
                    self.received.append(f"{s.family.name}:connected")
                conn.close()

    def close(self) -> None:
        self.stop = True
        self.thread.join(timeout=5)
        for s in self.socks:
            s.close()


def battery(d: Path, sock: Path, abstract: str, port: int, marks: dict[str, Path], results: Path) -> dict:
    """name -> completion of HumanEval/0's body (top-level code after a `return` where the escape needs one)."""
    connect = (f"import socket\nfor fam, a in ((socket.AF_UNIX, {str(sock)!r}), (socket.AF_UNIX, {abstract!r}), "
               f"(socket.AF_INET, ('127.0.0.1', {port}))):\n    try:\n        s = socket.socket(fam)\n"
               "        s.settimeout(1)\n        s.connect(a)\n        s.sendall(b'PWNED')\n    except OSError:\n"
               "        pass\n")
    leak = "    raise ValueError(open({!r}).read())\n"
    ev = os.getpid()  # the evaluator is a child of this script; both pids are outside the sandbox
    return {
        "sys_exit": "    import sys; sys.exit(0)\n",
        "os_exit": "    import os; os._exit(0)\n",
        "raise_systemexit": "    raise SystemExit\n",
        "exit_builtin": "    exit()\n",
        "keyboard_interrupt": "    raise KeyboardInterrupt\n",
        "self_sigkill": "    import os, signal; os.kill(os.getpid(), signal.SIGKILL)\n",
        "print_passed_then_exit": "    print('passed'); import os; os._exit(0)\n",
        "atexit_os_exit": "    return 42\nimport atexit, os\natexit.register(os._exit, 0)\n",
        "excepthook_os_exit": "    return 42\nimport sys, os\nsys.excepthook = lambda *a: os._exit(0)\n",
        "rebind_os_exit": "    return 42\nimport os\nos._exit = lambda *a: None\nos.write = lambda *a: 0\n",
        "fork_exec_write_outside": "    return 42\n" + SPAWN +
                                   f"spawn(['/bin/sh', '-c', 'echo PWNED > {d}/outside.txt'])\n"
                                   "import time; time.sleep(0.5)\n",
        "gc_hook_rewrite_then_connect": "    return 42\nimport gc\nfor o in gc.get_objects():\n"
                                        "    if callable(o) and getattr(o, '__name__', '') == 'hook' and "
                                        "o.__closure__:\n        for c in o.__closure__:\n"
                                        "            if isinstance(c.cell_contents, tuple):\n"
                                        "                c.cell_contents = ()\n" + connect,
        "unix_and_tcp_connect": "    return 42\n" + connect,
        "fork_exec_connect": "    return 42\n" + SPAWN + "spawn(['" + sys.executable + "', '-c', " +
                             repr(connect) + "])\nimport time; time.sleep(1)\n",
        "dir_fd_environ": f"    import os\n    d = os.open('/proc/{ev}', os.O_RDONLY)\n"
                          "    raise ValueError(os.read(os.open('environ', os.O_RDONLY, dir_fd=d), 9999))\n",
        "proc_dotdot_environ": f"    raise ValueError(open('/proc/self/../{ev}/environ').read())\n",
        "read_home": leak.format(str(marks["home"])),
        "read_working_tree": leak.format(str(marks["tree"])),
        "read_earlier_results": leak.format(str(marks["results"])),
        "read_live_results": leak.format(str(results)),
        "list_home": "    import os\n    raise ValueError(os.listdir(os.path.expanduser('~')))\n",
        "write_dev_shm_and_root": "    for p in ('/dev/shm/x', '/x', '/proc/x'):\n        open(p, 'w').write('x')\n",
        "setsid_sleep_infinity": "    return 42\n" + SPAWN + "spawn(['/bin/sh', '-c', 'sleep infinity; echo QTOOLMARK'], True)\n",
        "ignore_sigterm_sleep": "    import signal, time\n    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                                "    time.sleep(10 ** 6)\n",
        "shell_fork_bomb": "    return 42\n" + SPAWN + "spawn(['/bin/sh', '-c', 'b() { b | b & }; b'])\n"
                           "import time; time.sleep(2)\n",
        "python_fork_bomb": "    import os\n    while True:\n        os.fork()\n",
        "thread_bomb": "    import threading, time\n    while True:\n"
                       "        threading.Thread(target=time.sleep, args=(100,)).start()\n",
        "stdout_flood": "    import os\n    while True:\n        os.write(1, b'x' * 65536)\n",
        "stderr_flood_no_newline": "    import sys\n    while True:\n        sys.stderr.write('y' * 65536)\n",
        "disk_fill_tmp": "    for i in range(1000):\n        with open(f'/tmp/f{i}', 'wb') as f:\n"
                         "            f.write(b'x' * (8 << 20))\n",
        "memory_hog": "    x = bytearray(8 << 30)\n",
        "raise_rlimit_then_hog": "    import resource\n    inf = resource.RLIM_INFINITY\n"
                                 "    resource.setrlimit(resource.RLIMIT_AS, (inf, inf))\n    x = bytearray(8 << 30)\n",
        "cpu_spin_in_c": "    sum(range(10 ** 12))\n",
        "kill_all": "    return 42\nimport os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError:\n    pass\n",
        "lone_surrogate": "    return '\ud83d'\n",
        "nul_byte": "    return 1\x00\n",
        "unclosed_string_swallows_tests": "    return True\nx = '''\n",
    }


FORGERIES = {  # deliberate in-process gaming of the tests: recorded, not part of the must-fail battery
    "frame_walk_token": "    return 42\nimport sys, os\nf = sys._getframe()\nwhile f and 'token' not in f.f_locals:\n"
                        "    f = f.f_back\nos.write(f.f_locals['fd'], f.f_locals['token'])\nos._exit(0)\n",
    "always_equal_answer": "    return type('AlwaysEqual', (), {'__eq__': lambda s, o: True})()\n",
}


def sandbox_tasks() -> list[int]:
    """Live processes running as a sandbox uid (any evaluator's)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            uid = int(Path(f"/proc/{pid}/status").read_text().split("Uid:")[1].split()[0])
        except (OSError, IndexError, ValueError):
            continue
        if uid >= SANDBOX_UID_BASE:
            found.append(int(pid))
    return found


def marker_alive(marker: bytes) -> bool:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes():
                return True
        except OSError:
            pass
    return False


def run_eval(rows: list[dict], d: Path, out: Path) -> dict:
    path = d / "samples.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {**os.environ, "QTOOL_SECRET": SECRET}
    start = time.monotonic()
    proc = subprocess.Popen(["qtool", "eval", "--task", "code", "--completions", str(path), "--output", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    hwm_kib, peak_tasks = 0, 0
    reader = threading.Thread(target=lambda: setattr(proc, "captured", proc.communicate(timeout=900)))
    reader.start()
    while reader.is_alive():  # the evaluator's own peak RSS (VmHWM), read while it runs
        try:
            line = next(x for x in open(f"/proc/{proc.pid}/status") if x.startswith("VmHWM:"))
            hwm_kib = max(hwm_kib, int(line.split()[1]))
        except (OSError, StopIteration):
            pass
        peak_tasks = max(peak_tasks, len(sandbox_tasks()))
        time.sleep(0.2)
    reader.join()
    elapsed = time.monotonic() - start
    _, err = proc.captured
    time.sleep(1.0)  # anything that outlived the run has had time to show up
    return {"exit_code": proc.returncode, "seconds": round(elapsed, 1), "traceback_in_stderr": "Traceback" in err,
            "stderr_tail": err.strip().splitlines()[-3:], "evaluator_peak_rss_mib": round(hwm_kib / 1024, 1),
            "children_max_rss_mib": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1),
            "peak_sandbox_tasks_seen": peak_tasks, "sandbox_tasks_left": len(sandbox_tasks()),
            "marker_process_left": marker_alive(b"QTOOLMARK")}


def hostile(d: Path) -> dict:
    problem = humaneval_problems()[0]
    marks = {"home": Path.home() / f".qtool-bar-marker-{os.getpid()}", "tree": Path.cwd() / f".qtool-bar-{os.getpid()}",
             "results": d / "earlier-eval.json"}
    for p in marks.values():
        p.write_text(SECRET)
    results, sock = d / "eval.json", d / "listener.sock"
    alone = run_eval([{"task_id": problem["task_id"], "completion": problem["canonical_solution"]}], d,
                     d / "alone.json")  # the evaluator's own footprint, for scale
    listeners = Listeners(sock)
    try:
        programs = battery(d, sock, listeners.abstract, listeners.tcp_port, marks, results)
        names = list(programs) + list(FORGERIES) + ["canonical_solution"]
        bodies = list(programs.values()) + list(FORGERIES.values()) + [problem["canonical_solution"]]
        run = run_eval([{"task_id": problem["task_id"], "completion": b} for b in bodies], d, results)
    finally:
        listeners.close()
        for p in (marks["home"], marks["tree"]):
            p.unlink()
    data = json.loads(results.read_text())
    records = data["tasks"]["code_completions"]["records"]
    by_name = {n: records[str(i + 1)] for i, n in enumerate(names)}
    text = results.read_text()
    return {
        "battery_programs": len(programs),
        "battery_passed": sorted(n for n in programs if by_name[n]["passed"]),
        "statuses": {n: by_name[n]["status"] for n in programs},
        "read_errors": {n: by_name[n]["error"].strip().splitlines()[-1:] for n in programs if n.startswith(
            ("read_", "list_home", "dir_fd", "proc_dotdot", "write_dev"))},
        "forgeries_passed": {n: by_name[n]["passed"] for n in FORGERIES},
        "canonical_solution_passed": by_name["canonical_solution"]["passed"],
        "listener_received": listeners.received,
        "secret_in_results_file": SECRET in text,
        "outside_file_written": (d / "outside.txt").exists(),
        "earlier_results_intact": marks["results"].read_text() == SECRET,
        "isolation": data["tasks"]["code_completions"]["summary"]["isolation"],
        "summary_statuses": data["tasks"]["code_completions"]["summary"]["statuses"],
        "one_correct_program_alone": {k: alone[k] for k in ("exit_code", "seconds", "evaluator_peak_rss_mib")},
        **run,
    }


POLICY = ("version: 1\nname: bar\ntasks:\n  code:\n    kld_mean: {max: 0.10}\n"
          "    pass_at_1_drop: {max: 0.15, min_baseline_share: 0.25}\n")


def verdict_paths(d: Path) -> dict:
    policy = d / "policy.yaml"
    policy.write_text(POLICY)
    iso = {"mode": "bubblewrap", "layers": ["pid namespace"], "missing": []}
    out = {}
    for name, (lo, hi), corrupt in (("PASS", (0.01, 0.02), False), ("FAIL", (0.3, 0.4), False),
                                    ("INCONCLUSIVE", (0.05, 0.15), False), ("error", (0.01, 0.02), True)):
        folder = d / f"run-{name}"
        folder.mkdir()
        steps = {n: {"status": "ok", "seconds": 1.0} for n in ("quantize", "eval", "bench", "diagnose")}
        (folder / "steps.json").write_text("{not json" if corrupt else json.dumps(steps))
        summary = {"pass@1": paired_delta([0] * 8, [0] * 8, seed=0), "isolation": iso,
                   "text_stats": {"kld": {"mean_pm": [(lo + hi) / 2, (hi - lo) / 4], "ci95": [lo, hi]}}}
        (folder / "eval.json").write_text(json.dumps({"tasks": {"code": {"items": 8, "summary": summary}}}))
        p = subprocess.run(["qtool", "signoff", "--model", "default", "--recipe", "fp8-dynamic", "--policy",
                            str(policy), "--rejudge", "--output", str(folder)], capture_output=True, text=True,
                           timeout=300)
        report = folder / "report.json"
        out[name] = {"kld_ci": [lo, hi], "exit_code": p.returncode,
                     "printed_verdict": next((x for x in p.stdout.splitlines() if "verdict:" in x), None),
                     "report_verdict": json.loads(report.read_text())["verdict"] if report.exists() else None,
                     "stderr_lines": len(p.stderr.strip().splitlines()), "stderr": p.stderr.strip()[-300:]}
    return out


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="bar13-") as tmp:
        d = Path(tmp)
        result = {"command": "qtool eval --task code --completions FILE --output FILE", "hostile": hostile(d)}
        result["verdict_paths"] = verdict_paths(d)
    h = result["hostile"]
    result["bar_met"] = (h["battery_programs"] >= 12 and not h["battery_passed"] and not h["listener_received"]
                         and not h["secret_in_results_file"] and not h["outside_file_written"]
                         and h["earlier_results_intact"] and h["sandbox_tasks_left"] == 0
                         and not h["marker_process_left"] and h["exit_code"] == 0
                         and not h["traceback_in_stderr"] and h["canonical_solution_passed"]
                         and [v["exit_code"] for v in result["verdict_paths"].values()] == [0, 1, 3, 2])
    (HERE / "bar-issue13.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in h.items() if k not in ("statuses", "read_errors")}, indent=1))
    print({k: v["exit_code"] for k, v in result["verdict_paths"].items()}, "bar_met", result["bar_met"])


if __name__ == "__main__":
    main()
