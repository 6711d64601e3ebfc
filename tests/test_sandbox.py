"""The sandbox contains hostile programs: each is scored failed, nothing escapes, evaluation goes on."""

from __future__ import annotations

import json
import os
import socket
import textwrap
from pathlib import Path

import pytest
from qtoolkit.evals import landlock
from qtoolkit.evals.completions import score_completions
from qtoolkit.evals.data import humaneval_problems
from qtoolkit.evals.sandbox import Limits, isolation, run_program

FAST = Limits(wall_s=5.0, cpu_s=3, memory_bytes=512 << 20)


def test_plain_program_passes_with_empty_environment():
    r = run_program("import os, sys\nassert os.environ == {} or set(os.environ) <= {'LC_CTYPE'}, dict(os.environ)\n"
                    "assert sys.flags.isolated\nprint('ok')\n", FAST)
    assert r.passed and r.stdout.strip() == "ok", r.stderr


def test_failing_assertion_is_scored_failed():
    r = run_program("assert 1 == 2\n", FAST)
    assert not r.passed and r.status == "failed" and "AssertionError" in r.stderr


def hostile_battery(tmp: Path) -> dict[str, str]:
    """name -> program body; every program would print PWNED if it escaped."""
    outside = tmp / "outside.txt"
    victim = tmp / "victim.txt"
    return {
        "fork_bomb": "import os\nwhile True:\n    os.fork()\n",
        "subprocess_bomb": "import subprocess\nwhile True:\n    subprocess.Popen(['/bin/sh', '-c', 'sleep 100'])\n",
        "infinite_loop": "while True:\n    pass\n",
        "huge_allocation": "x = bytearray(8 << 30)\nprint('PWNED')\n",
        "write_outside": f"open({str(outside)!r}, 'w').write('PWNED')\n",
        "write_outside_os_open": f"import os\nfd = os.open({str(outside)!r}, os.O_WRONLY | os.O_CREAT)\nos.write(fd, b'PWNED')\n",
        "socket": "import socket\ns = socket.create_connection(('1.1.1.1', 80), timeout=2)\nprint('PWNED')\n",
        "parent_environment": "import os\nprint(os.environ['QTOOL_SECRET'])\n",
        "parent_proc_environ": f"print(open('/proc/{os.getpid()}/environ').read())\n",
        "delete_files": f"import os\nos.remove({str(victim)!r})\n",
        "rmtree": f"import shutil\nshutil.rmtree({str(tmp)!r})\n",
        "ctypes_escape": "import ctypes\nlibc = ctypes.CDLL(None)\nlibc.socket(2, 1, 0)\nprint('PWNED')\n",
        "kill_parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n",
    }


def test_hostile_battery_is_contained(tmp_path, monkeypatch):
    monkeypatch.setenv("QTOOL_SECRET", "PWNED")
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    for name, body in hostile_battery(tmp_path).items():
        r = run_program(body, FAST)
        assert not r.passed, name
        assert r.status in ("failed", "timeout", "killed"), (name, r.status)
        assert "PWNED" not in r.stdout, name
        assert r.seconds < FAST.wall_s + 3, name
    assert victim.read_text() == "keep me"
    assert not (tmp_path / "outside.txt").exists()


def test_kernel_layers_alone_contain_writes_and_network(tmp_path):
    """Without the in-process audit hook, Landlock and the network namespace still hold."""
    layers = isolation()
    if not layers["landlock"] or not layers["network_namespace"]:
        pytest.skip(f"kernel isolation not available here: {layers}")
    outside = tmp_path / "outside.txt"
    r = run_program(f"open({str(outside)!r}, 'w').write('PWNED')\n", FAST, audit_hook=False)
    assert not r.passed and "PermissionError" in r.stderr and not outside.exists()
    r = run_program("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)\n", FAST, audit_hook=False)
    assert not r.passed and ("unreachable" in r.stderr.lower() or "OSError" in r.stderr)
    r = run_program("print(open('/proc/1/environ').read())\n", FAST, audit_hook=False)
    assert not r.passed
    r = run_program("open('scratch.txt', 'w').write('fine')\nprint(open('scratch.txt').read())\n", FAST,
                    audit_hook=False)
    assert r.passed and r.stdout.strip() == "fine", r.stderr


def test_landlock_probe_reports_an_abi():
    assert landlock.available() >= 0


def test_evaluation_continues_after_hostile_completions(tmp_path, monkeypatch):
    """A completions file mixing hostile and correct programs: every item is scored, in order."""
    monkeypatch.setenv("QTOOL_SECRET", "PWNED")
    problem = humaneval_problems()[0]
    good = problem["canonical_solution"]
    rows = [{"task_id": problem["task_id"], "completion": textwrap.indent(body, "    ")}
            for body in hostile_battery(tmp_path).values()]
    rows.append({"task_id": problem["task_id"], "completion": good})
    path = tmp_path / "samples.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "res.json"
    summary = score_completions(path, out)["summary"]
    records = json.loads(out.read_text())["tasks"]["code_completions"]["records"]
    passed = [records[str(i + 1)]["passed"] for i in range(len(rows))]
    assert passed == [False] * (len(rows) - 1) + [True]
    assert summary["samples"] == len(rows) and summary["problems"] == 1
    assert socket.gethostname()  # the parent process is untouched
