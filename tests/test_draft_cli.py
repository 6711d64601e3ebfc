"""`qtool train-draft` refuses bad input with one line and exit 2, before anything is written."""

from __future__ import annotations

import pytest

from qtoolkit.cli import main


def run(capsys, *argv: str) -> tuple[int, str]:
    try:
        code = main(["train-draft", *argv])
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize("flags,words", [
    (["--ttt-steps", "0"], "--ttt-steps must be a positive integer"),
    (["--ttt-steps", "12"], "more than 8"),
    (["--epochs", "-1"], "--epochs must be a positive integer"),
    (["--time-budget", "0"], "--time-budget must be positive"),
    (["--draft-vocab", "0"], "--draft-vocab must be positive"),
])
def test_bad_numbers_fail_with_one_line_and_write_nothing(capsys, tmp_path, flags, words):
    out = tmp_path / "head"
    code, err = run(capsys, "--model", "default", "--output", str(out), *flags)
    assert code == 2 and words in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_unknown_model_and_unusable_outputs(capsys, tmp_path, tiny_model_dir):
    code, err = run(capsys, "--model", str(tmp_path / "nope"), "--output", str(tmp_path / "o"))
    assert code == 2 and len(err.splitlines()) == 1 and not (tmp_path / "o").exists()
    (tmp_path / "file").write_text("x")
    code, err = run(capsys, "--model", str(tiny_model_dir), "--output", str(tmp_path / "file"))
    assert code == 2 and "is a file" in err and (tmp_path / "file").read_text() == "x"
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    code, err = run(capsys, "--model", str(tiny_model_dir), "--output", str(tmp_path / "other"))
    assert code == 2 and "--overwrite" in err and (tmp_path / "other" / "notes.txt").read_text() == "mine"


def test_argparse_refuses_a_non_numeric_vocabulary(capsys, tmp_path):
    code, err = run(capsys, "--model", "default", "--output", str(tmp_path / "o"), "--draft-vocab", "lots")
    assert code == 2 and "not a token count or auto" in err
