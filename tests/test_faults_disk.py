"""Outputs under faults: a full disk or a file-size limit mid-write is one line naming the path (exit 2) with the
previous results intact; a kill -9 at any moment of a write leaves the old version or the new one, never a part;
what a killed writer leaves beside its output is cleared (or put back) by the next write.

The file-size limit is RLIMIT_FSIZE set in the child (preexec_fn), so no root-only mount is needed; `qtool`
ignores SIGXFSZ, so the write fails with EFBIG instead of the process dying of the signal."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from qtoolkit.cli import main
from qtoolkit.errors import OutputWriteError
from qtoolkit.io import _renameat2, atomic_dir, previous_path, read_results_json, remove_stale, write_json

QTOOL = [sys.executable, "-m", "qtoolkit"]


def file_size_limit(limit: int):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def tree_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def leftovers(folder: Path, name: str) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(f".{name}.") and not p.name.endswith(".lock"))


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.slow  # two `qtool eval` runs: tens of seconds on a loaded 2-core machine
def test_a_results_write_past_the_file_size_limit_is_one_line_and_keeps_the_results(tmp_path):
    """`qtool eval` (scoring a completions file: no model to load) rerun with --overwrite under `ulimit -f`."""
    rows = tmp_path / "c.jsonl"
    rows.write_text('{"task_id": "HumanEval/0", "completion": "    return True\\n"}\n'
                    '{"task_id": "HumanEval/1", "completion": "    return []\\n"}\n')
    out = tmp_path / "eval.json"
    args = ["eval", "--completions", str(rows), "--allow-weak-sandbox", "-o", str(out)]
    assert main(args) == 0
    before = out.read_bytes()
    proc = subprocess.run([*QTOOL, *args, "--overwrite"], capture_output=True, text=True, timeout=300,
                          preexec_fn=file_size_limit(len(before) // 2))
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("qtool:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr
    assert f"cannot write {out}" in errors[0] and "file-size limit" in errors[0] and "Traceback" not in proc.stderr
    assert out.read_bytes() == before and leftovers(tmp_path, "eval.json") == []


def test_no_room_in_an_output_folder_keeps_the_old_folder_and_names_it(tmp_path):
    target = tmp_path / "ckpt"
    with atomic_dir(target) as tmp:
        (tmp / "weights").write_bytes(b"old" * 1000)
    before = tree_digest(target)
    for failure in (OSError(errno.ENOSPC, "No space left on device"),
                    RuntimeError("Error while serializing: I/O error: File too large (os error 27)")):  # safetensors
        with pytest.raises(OutputWriteError, match=f"cannot write {target}: "), atomic_dir(target, True) as tmp:
            (tmp / "weights").write_bytes(b"new")
            raise failure
        assert tree_digest(target) == before and leftovers(tmp_path, "ckpt") == []


def test_a_folder_is_swapped_in_atomically_and_a_dead_writers_leftovers_are_cleared(tmp_path):
    target = tmp_path / "ckpt"
    with atomic_dir(target) as tmp:
        (tmp / "a").write_text("1")
    pid = dead_pid()
    (tmp_path / f".ckpt.tmp-{pid}-x1y2").mkdir()  # a writer killed mid-write
    (tmp_path / f".eval.json.{pid}-abcd.tmp").write_text("{")
    (tmp_path / f".ckpt.tmp-{os.getpid()}-live").mkdir()  # a live writer's (ours): kept
    with atomic_dir(target, overwrite=True) as tmp:
        (tmp / "a").write_text("2")
    assert (target / "a").read_text() == "2"
    assert leftovers(tmp_path, "ckpt") == [f".ckpt.tmp-{os.getpid()}-live"]
    write_json(tmp_path / "eval.json", {"ok": 1})
    assert leftovers(tmp_path, "eval.json") == []
    if sys.platform.startswith("linux"):
        assert _renameat2() is not None  # the swap is one renameat2(RENAME_EXCHANGE), with no gap


def test_an_old_folder_moved_aside_by_a_killed_writer_is_put_back(tmp_path):
    """Where RENAME_EXCHANGE is not available, the swap is two renames; a kill between them is repaired."""
    target = tmp_path / "ckpt"
    aside = tmp_path / f".ckpt.old-{dead_pid()}"
    aside.mkdir()
    (aside / "a").write_text("complete")
    remove_stale(target)
    assert (target / "a").read_text() == "complete" and not aside.exists()


def test_a_write_after_a_kill_between_the_two_renames_leaves_nothing_beside(tmp_path):
    """A writer killed after moving the old version to .prev but before moving the new one in leaves .prev and the
    file as one inode; renaming onto a name of the same file does nothing, so the next write drops its extra name."""
    path = tmp_path / "eval.json"
    write_json(path, {"version": 0})
    os.link(path, previous_path(path))  # what that kill leaves: both names, one file
    write_json(path, {"version": 1})
    assert leftovers(tmp_path, "eval.json") == []
    assert json.loads(path.read_text())["version"] == 1
    assert json.loads(previous_path(path).read_text())["version"] == 0


def test_a_temp_file_whose_pid_was_reused_is_cleared(tmp_path):
    """A killed writer's pid can belong to a newer process by the time of the next write (pids wrap at 32768):
    a temp file older than the live process bearing its pid is still a dead writer's, and goes."""
    path = tmp_path / "eval.json"
    write_json(path, {"version": 0})
    newer = subprocess.Popen(["sleep", "30"])
    try:
        stale = tmp_path / f".eval.json.{newer.pid}-0123abcd.prev.tmp"
        stale.write_text("{}")
        os.utime(stale, (time.time() - 600, time.time() - 600))  # written before `newer` started
        live = tmp_path / f".eval.json.{newer.pid}-4567cdef.tmp"
        live.write_text("{}")  # written while `newer` runs: it may be writing it
        write_json(path, {"version": 1})
        assert not stale.exists() and live.exists()
    finally:
        newer.kill()
        newer.wait()


WRITER = textwrap.dedent("""
    import sys
    from qtoolkit.io import write_json
    path, i = sys.argv[1], 0
    print("ready", flush=True)
    while True:
        i += 1
        write_json(path, {"version": i, "records": {str(k): "x" * 64 for k in range(2000 + i % 7)}})
""")


def test_kill_9_at_random_moments_of_a_write_never_leaves_a_partial_file(tmp_path):
    """N seeded SIGKILLs while a results file is rewritten in a loop: it always parses, and whole."""
    path, rng, kills = tmp_path / "eval.json", random.Random(31), 12
    write_json(path, {"version": 0, "records": {}})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    for _ in range(kills):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, env=env)
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(rng.uniform(0.0, 0.15))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        for p in (path, previous_path(path)):
            if not p.exists():  # no .prev before the first version was replaced
                continue
            data = read_results_json(p)
            assert len(data["records"]) in (0, *(2000 + v % 7 for v in range(1, 8))), p
    write_json(path, {"version": -1, "records": {}})  # the next writer clears what the killed ones left
    assert leftovers(tmp_path, "eval.json") == []
    assert json.loads(path.read_text())["version"] == -1


@pytest.mark.slow  # a quantization in-process and one in a subprocess
def test_a_checkpoint_past_the_file_size_limit_is_one_line_and_keeps_the_old_checkpoint(tiny_model_dir, tmp_path):
    out = tmp_path / "int4"
    assert main(["quantize", "--model", str(tiny_model_dir), "--recipe", "int4-rtn", "--output", str(out),
                 "--no-verify"]) == 0
    before = tree_digest(out)
    proc = subprocess.run([*QTOOL, "quantize", "--model", str(tiny_model_dir), "--recipe", "int4-rtn", "--output",
                           str(out), "--no-verify", "--overwrite"], capture_output=True, text=True, timeout=900,
                          preexec_fn=file_size_limit(256 * 1024))  # the weights file is larger
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("qtool:") and "error" in ln]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert f"cannot write {out}: the file-size limit is reached" in errors[0], errors
    assert tree_digest(out) == before and leftovers(tmp_path, "int4") == []
