"""The hostile battery as a user meets it: `qtool eval --task code --completions FILE`, one escape per line.

Every item must be scored failed, the listeners outside must receive nothing, the marker files must stay
unread and unwritten, no process may be left, and the evaluator must finish in bounded time and memory
without a traceback.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from qtoolkit.evals.data import humaneval_problems
from qtoolkit.evals.sandbox.layers import sandbox_uid
from qtoolkit.evals.sandbox.run import isolation
from test_sandbox import SPAWN, _alive

pytestmark = pytest.mark.skipif(not isolation()["bubblewrap"], reason=f"no bubblewrap: {isolation()['missing']}")

# Runs the CLI like the `qtool` script and reports the evaluator's own peak RSS (KiB) on stderr's last line.
# VmHWM is this process's own peak (a fresh address space after exec); ru_maxrss would carry over the peak of
# the forking pytest process, which grows to gigabytes over the whole suite
_WRAP = ("import sys\nfrom qtoolkit.cli import main\nrc = main(sys.argv[1:])\n"
         "hwm = next(x for x in open('/proc/self/status') if x.startswith('VmHWM:')).split()[1]\n"
         "print('maxrss', hwm, file=sys.stderr)\nsys.exit(rc)\n")


class Listener:
    """AF_UNIX listeners at a file path and at an abstract name, and TCP on 127.0.0.1, recording what reaches them."""

    def __init__(self, path: Path):
        self.received: list[bytes] = []
        self.abstract = f"\0qtool-test-{os.getpid()}"
        self.socks = []
        for family, addr in ((socket.AF_UNIX, str(path)), (socket.AF_UNIX, self.abstract),
                             (socket.AF_INET, ("127.0.0.1", 0))):
            s = socket.socket(family, socket.SOCK_STREAM)
            s.bind(addr)
            s.listen(4)
            s.settimeout(0.2)
            self.socks.append(s)
        self.tcp = self.socks[2].getsockname()
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
                self.received.append(b"connected:" + conn.recv(100))
                conn.close()

    def close(self) -> None:
        self.stop = True
        self.thread.join(timeout=5)
        for s in self.socks:
            s.close()


def battery(tmp: Path, results: Path, sock: Path, listener: Listener, markers: list[Path]) -> dict[str, str]:
    """name -> completion of HumanEval/0's body; top-level code follows a `return` where the escape needs it.
    Reading the results file comes after the first batch of 16, once the file exists."""
    unix = (f"import socket\nfor f, a in ((1, {str(sock)!r}), (1, {listener.abstract!r}), (2, {listener.tcp!r})):\n"
            "    try:\n        s = socket.socket(f)\n        s.settimeout(1)\n        s.connect(a)\n"
            "        s.sendall(b'PWNED')\n    except OSError:\n        pass\n")
    home_marker, tree_marker = markers
    return {
        "sys_exit": "    import sys; sys.exit(0)\n",
        "os_exit": "    import os; os._exit(0)\n",
        "raise_systemexit": "    raise SystemExit\n",
        "exit_builtin": "    exit()\n",
        "atexit_os_exit": "    return 42\nimport atexit, os\natexit.register(os._exit, 0)\n",
        "excepthook": "    return 42\nimport sys, os\nsys.excepthook = lambda *a: os._exit(0)\n",
        "fork_exec": "    return 42\n" + SPAWN + f"spawn(['/bin/sh', '-c', 'echo PWNED > {tmp}/outside.txt'])\n"
                     "import time; time.sleep(0.5)\n",
        "gc_closure_rewrite": "    return 42\nimport gc\nfor o in gc.get_objects():\n"
                              "    if callable(o) and getattr(o, '__name__', '') == 'hook' and o.__closure__:\n"
                              "        for c in o.__closure__:\n"
                              "            if isinstance(c.cell_contents, tuple):\n"
                              "                c.cell_contents = ()\n" + unix,
        "unix_connect": "    return 42\n" + unix,
        "dir_fd_environ": f"    import os\n    d = os.open('/proc/{os.getpid()}', os.O_RDONLY)\n"
                          "    raise ValueError(os.read(os.open('environ', os.O_RDONLY, dir_fd=d), 9999))\n",
        "proc_dotdot_environ": f"    raise ValueError(open('/proc/self/../{os.getpid()}/environ').read())\n",
        "read_home": f"    raise ValueError(open({str(home_marker)!r}).read())\n",
        "read_working_tree": f"    raise ValueError(open({str(tree_marker)!r}).read())\n",
        "setsid_sleep": "    return 42\n" + SPAWN + "spawn(['/bin/sh', '-c', 'sleep infinity; echo QTOOLMARK'], True)\n",
        "fork_bomb": "    return 42\n" + SPAWN + "spawn(['/bin/sh', '-c', 'b() { b | b & }; b'])\n"
                     "import time; time.sleep(2)\n",
        "output_flood": "    import os\n    while True:\n        os.write(1, b'x' * 65536)\n",
        "disk_fill": "    n = 0\n    for i in range(1000):\n        with open(f'/tmp/f{i}', 'wb') as f:\n"
                     "            n += f.write(b'x' * (8 << 20))\n",
        "memory_hog": "    x = bytearray(8 << 30)\n",
        "kill_all": "    return 42\nimport os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError:\n    pass\n",
        "lone_surrogate": "    return '\ud83d'\n",
        "print_passed": "    print('passed'); import os; os._exit(0)\n",
        "read_results": f"    raise ValueError(open({str(results)!r}).read())\n",
    }


def _sandbox_tasks(uid: int) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        if f"Uid:\t{uid}\t" in status:
            found.append(pid)
    return found


def test_hostile_battery_through_the_cli(tmp_path):
    problem = humaneval_problems()[0]
    results, sock = tmp_path / "eval.json", tmp_path / "listener.sock"
    markers = [Path.home() / f".qtool-cli-marker-{os.getpid()}", Path.cwd() / f".qtool-cli-marker-{os.getpid()}"]
    for m in markers:
        m.write_text("SECRET-MARKER")
    listener = Listener(sock)
    try:
        programs = battery(tmp_path, results, sock, listener, markers)
        rows = [{"task_id": problem["task_id"], "completion": c} for c in programs.values()]
        rows.append({"task_id": problem["task_id"], "completion": problem["canonical_solution"]})
        path = tmp_path / "samples.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        env = {**os.environ, "QTOOL_SECRET": "SECRET-ENV"}
        start = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-c", _WRAP, "eval", "--task", "code", "--completions", str(path),
                                 "--output", str(results)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env=env)
        _, err = proc.communicate(timeout=300)
        elapsed = time.monotonic() - start
    finally:
        listener.close()
        for m in markers:
            m.unlink()
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    rss_mib = int(err.strip().splitlines()[-1].split()[1]) / 1024
    assert rss_mib < 1024, rss_mib  # output is read with a cap: a flood does not grow the evaluator
    assert elapsed < 12 * len(rows), elapsed
    data = json.loads(results.read_text())
    records = data["tasks"]["code_completions"]["records"]
    by_name = {name: records[str(i + 1)] for i, name in enumerate(programs)}
    assert {n: r["status"] for n, r in by_name.items() if r["passed"]} == {}
    assert records[str(len(rows))]["passed"], records[str(len(rows))]  # the correct solution still passes
    for name in ("sys_exit", "os_exit", "raise_systemexit", "exit_builtin", "print_passed"):
        assert by_name[name]["status"] == "exited before the tests ran", (name, by_name[name])
    assert listener.received == []
    assert list(programs).index("read_results") >= 16  # a batch of 16 was written: the file exists outside
    for name in ("read_home", "read_working_tree", "read_results", "proc_dotdot_environ"):
        assert by_name[name]["error"].strip().splitlines()[-1].startswith(("FileNotFoundError", "PermissionError")), \
            (name, by_name[name]["error"])
    text = results.read_text()
    assert "SECRET" not in text
    assert not (tmp_path / "outside.txt").exists()
    assert not _alive("QTOOLMARK") and _sandbox_tasks(sandbox_uid(proc.pid)) == []
    assert data["tasks"]["code_completions"]["summary"]["isolation"]["mode"] == "bubblewrap"
