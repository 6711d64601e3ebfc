"""signoff/apart.py: a function run in a spawned process gives its memory back when it ends, and what it raised
comes back as the same kind of error (a user error stays exit 2, a full disk stays a full disk, a bug is no FAIL);
a child that dies without an answer is an error naming its exit, and nothing it prints reaches stdout."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from qtoolkit.errors import OutputWriteError, QToolError
from qtoolkit.signoff.apart import run_apart


def write_pid(path: str) -> None:
    print("chatter that must not reach stdout")
    Path(path).write_text(str(os.getpid()))


def raise_kind(kind: str) -> None:
    if kind == "user":
        raise QToolError("bad recipe: fix it")
    if kind == "disk":
        raise OutputWriteError("no space left: free some")
    raise ZeroDivisionError("a bug")


def die() -> None:
    os._exit(9)


def test_runs_in_another_process_and_keeps_stdout_clean(tmp_path, capfd):
    run_apart("writing", write_pid, str(tmp_path / "pid"))
    assert int((tmp_path / "pid").read_text()) != os.getpid()
    out, err = capfd.readouterr()
    assert "chatter" not in out and "chatter" in err


@pytest.mark.parametrize(("kind", "error", "words"), [
    ("user", QToolError, "bad recipe: fix it"), ("disk", OutputWriteError, "no space left"),
    ("bug", RuntimeError, "ZeroDivisionError: a bug")])
def test_the_childs_error_comes_back_as_its_kind(kind, error, words):
    with pytest.raises(error, match=words) as caught:
        run_apart("raising", raise_kind, kind)
    assert kind == "disk" or not isinstance(caught.value, OutputWriteError)


def test_a_child_that_dies_is_an_error_naming_its_exit():
    with pytest.raises(RuntimeError, match="dying: its process ended with exit code 9"):
        run_apart("dying", die)


def test_a_replaying_runner_takes_up_what_the_child_did_and_tells_ran_from_reused(tmp_path):
    """The sweep's parent after its child (sweep._start): a step the child ran is no reused step in the report,
    one it found done is; a step the child never finished is an error saying so; nothing runs in the parent."""
    from qtoolkit.signoff.steps import StepRunner, recorded

    out = tmp_path / "x.json"

    def write() -> None:
        out.write_text("{}")

    child = StepRunner(tmp_path)
    assert child.run("quantize", {"a": 1}, out, write).ok
    child.lock.release()
    before = recorded(tmp_path)  # the parent's snapshot: quantize done, eval not yet
    child = StepRunner(tmp_path)  # the child: quantize found done, eval run now
    assert child.run("quantize", {"a": 1}, out, write).reused
    assert child.run("eval", {"b": 2}, out, write).ok
    child.lock.release()

    def must_not_run() -> None:
        raise AssertionError("a replaying runner ran a step")

    parent = StepRunner(tmp_path, replay=before)
    assert parent.run("quantize", {"a": 1}, out, must_not_run).reused
    ran = parent.run("eval", {"b": 2}, out, must_not_run)
    assert ran.ok and not ran.reused
    lost = parent.run("bench", {"c": 3}, out, must_not_run)
    assert not lost.ok and "ended before the step finished" in lost.error
