"""The sandbox contains hostile programs: each is scored failed, nothing escapes, evaluation goes on."""

from __future__ import annotations

import json
import os
import socket
import textwrap
from pathlib import Path

import pytest
from qtoolkit.evals.completions import score_completions
from qtoolkit.evals.data import humaneval_problems
from qtoolkit.evals.sandbox import landlock
from qtoolkit.evals.sandbox.run import (
    EXITED_EARLY,
    Limits,
    SandboxUnavailable,
    isolation,
    require,
    run_program,
)

FAST = Limits(wall_s=5.0, cpu_s=3, memory_bytes=512 << 20)
needs_bwrap = pytest.mark.skipif(not isolation()["bubblewrap"], reason=f"no bubblewrap: {isolation()['missing']}")

# Starts a program with no audit event and no hook (the in-process guard's known hole); CPython 3.11's signature.
SPAWN = """
def spawn(argv, setsid=False):
    import _posixsubprocess, os
    r, w = os.pipe()
    return _posixsubprocess.fork_exec([a.encode() for a in argv], [argv[0].encode()], True, (), None, None,
        -1, -1, -1, -1, -1, -1, r, w, True, setsid, -1, None, None, None, -1, None, False)
"""


def test_plain_program_passes_with_empty_environment():
    r = run_program("import os, sys\nassert os.environ == {} or set(os.environ) <= {'LC_CTYPE', 'PWD'}, dict(os.environ)\n"
                    "assert sys.flags.isolated\nprint('ok')\n", FAST)
    assert r.passed and r.stdout.strip() == "ok", r.stderr


def test_failing_assertion_is_scored_failed():
    r = run_program("assert 1 == 2\n", FAST)
    assert not r.passed and r.status == "failed" and "AssertionError" in r.stderr


@pytest.mark.parametrize("body", [
    "import sys; sys.exit(0)", "import os; os._exit(0)", "raise SystemExit", "exit()", "quit()",
    "import atexit, os; atexit.register(os._exit, 0)",
    "import sys, os; sys.excepthook = lambda *a: os._exit(0)",
    "import sys, os; sys.excepthook = lambda *a: os._exit(0); raise ValueError",
    "import os; os.write(1, b'passed\\n'); os._exit(0)", "import os; os._exit(1)",
])
def test_early_exit_is_never_a_pass(body):
    """The tests (the last part) never finish: whatever the exit code, the item fails."""
    r = run_program([body, "raise AssertionError"], FAST)
    assert not r.passed, (body, r.status)
    # a hook set for later never runs: the tests fail and the runner leaves before atexit or excepthook
    assert r.status == ("failed" if "hook" in body or "atexit" in body else EXITED_EARLY), r.status


def test_parts_cannot_swallow_the_tests():
    """An unclosed string in the completion stays a syntax error of its own part, not a skipped test."""
    r = run_program(["def f():\n    return 1\nx = '''", "assert f() == 2"], FAST)
    assert not r.passed and "SyntaxError" in r.stderr


def test_lone_surrogate_is_scored_failed():
    r = run_program("x = '\ud83d'\n", FAST)
    assert not r.passed and r.status == "failed"


@needs_bwrap
def test_hook_free_spawn_really_runs_inside():
    """The hostile battery's spawn helper works (so the kernel layers, not a broken helper, contain it)."""
    r = run_program(SPAWN + "import os, time\npid = spawn(['/bin/sh', '-c', 'echo hi > /tmp/x'])\n"
                    "os.waitpid(pid, 0)\nprint(open('/tmp/x').read().strip())\n", FAST)
    assert r.passed and r.stdout.strip() == "hi", r.stderr


@needs_bwrap
def test_kernel_layers_alone(tmp_path):
    """Without the audit hook: no network, no files outside, a bounded /tmp, bounded processes, no leftovers."""
    outside = tmp_path / "outside.txt"
    home_marker = Path.home() / f".qtool-sandbox-marker-{os.getpid()}"
    home_marker.write_text("SECRET")
    try:
        cases = {
            "write": f"open({str(outside)!r}, 'w').write('PWNED')",
            "read_home": f"print(open({str(home_marker)!r}).read())",
            "list_home": "print(os.listdir('/root'))",
            "net": "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)",
            "host_environ": f"print(open('/proc/self/../{os.getpid()}/environ').read())",
            "dir_fd": f"print(os.read(os.open('environ', os.O_RDONLY, dir_fd=os.open('/proc/{os.getpid()}', 0)), 99))",
        }
        for name, body in cases.items():
            r = run_program("import os\n" + body + "\n", FAST, audit_hook=False)
            assert not r.passed and "SECRET" not in r.stdout and "PWNED" not in r.stdout, (name, r.stdout)
        assert not outside.exists()
        fill = run_program("n = 0\ntry:\n    for i in range(64):\n        with open(f'/tmp/f{i}', 'wb') as f:\n"
                           "            for _ in range(16):\n                n += f.write(b'x' * (1 << 20))\n"
                           "except OSError as e:\n    print(n, e.errno)\n", FAST, audit_hook=False)
        written, errno = map(int, fill.stdout.split())
        assert written <= FAST.tmp_bytes and errno in (27, 28), fill.stdout  # EFBIG or ENOSPC
        bomb = run_program("import os\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
                           "            import time; time.sleep(30)\n        n += 1\nexcept OSError:\n    print(n)\n",
                           FAST, audit_hook=False)
        assert bomb.passed and int(bomb.stdout) < FAST.processes, bomb.stdout
        r = run_program(SPAWN + "spawn(['/bin/sh', '-c', 'sleep 1000; echo QTOOLMARK'], setsid=True)\n", FAST,
                        audit_hook=False)
        assert r.seconds < 3 and not _alive("QTOOLMARK")
    finally:
        home_marker.unlink()


def _alive(marker: str) -> bool:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                return True
        except OSError:
            pass
    return False


def test_fail_closed_without_bubblewrap(monkeypatch, tmp_path, capsys):
    from qtoolkit.evals.sandbox import layers as sandbox_layers

    from qtoolkit.cli import main

    monkeypatch.setattr(sandbox_layers, "probe", lambda: {"bubblewrap": False, "missing": ["bubblewrap (test)"],
                                                          "network_namespace": False, "landlock": False})
    with pytest.raises(SandboxUnavailable, match="missing bubblewrap.*--allow-weak-sandbox"):
        require()
    assert require(allow_weak=True).mode == "weak"
    problem = humaneval_problems()[0]
    samples = tmp_path / "s.jsonl"
    samples.write_text(json.dumps({"task_id": problem["task_id"], "completion": problem["canonical_solution"]}))
    for argv in (["eval", "--task", "code", "--completions", str(samples), "--output", str(tmp_path / "e.json")],
                 ["signoff", "--model", "default", "--recipe", "fp8-dynamic", "--output", str(tmp_path / "so")]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "missing bubblewrap (test)" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.jsonl"]  # nothing written, nothing run
    assert main(["eval", "--task", "code", "--completions", str(samples), "--output", str(tmp_path / "e.json"),
                 "--allow-weak-sandbox"]) == 0
    summary = json.loads((tmp_path / "e.json").read_text())["tasks"]["code_completions"]["summary"]
    assert summary["isolation"]["mode"] == "weak" and summary["pass@k"]["pass@1"] == 1.0


def test_weak_mode_still_scores_by_token():
    assert run_program("assert True\n", FAST, mode="weak").passed
    assert not run_program("import os; os._exit(0)\n", FAST, mode="weak").passed


def test_landlock_probe_reports_an_abi():
    assert landlock.available() >= 0


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
        assert r.status in ("failed", "timeout", "killed", EXITED_EARLY), (name, r.status)
        assert "PWNED" not in r.stdout, name
        assert r.seconds < FAST.wall_s + 3, name
    assert victim.read_text() == "keep me"
    assert not (tmp_path / "outside.txt").exists()


def test_evaluation_continues_after_hostile_completions(tmp_path, monkeypatch):
    """A completions file mixing hostile and correct programs: every item is scored, in order."""
    monkeypatch.setenv("QTOOL_SECRET", "PWNED")
    problem = humaneval_problems()[0]
    good = problem["canonical_solution"]
    rows = [{"task_id": problem["task_id"], "completion": textwrap.indent(body, "    ")}
            for body in hostile_battery(tmp_path).values() if "loop" not in body]
    rows.append({"task_id": problem["task_id"], "completion": good})
    path = tmp_path / "samples.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "res.json"
    summary = score_completions(path, out)["summary"]
    records = json.loads(out.read_text())["tasks"]["code_completions"]["records"]
    passed = [records[str(i + 1)]["passed"] for i in range(len(rows))]
    assert passed == [False] * (len(rows) - 1) + [True]
    assert summary["samples"] == len(rows) and summary["problems"] == 1
    assert summary["isolation"]["mode"] == ("bubblewrap" if isolation()["bubblewrap"] else "weak")
    assert socket.gethostname()  # the parent process is untouched
