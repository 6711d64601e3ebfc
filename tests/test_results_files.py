"""Results files under crashes and concurrent runs, GGUF conversion once, and model identity."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from qtoolkit.evals.results import ResultsFile
from safetensors.torch import save_file

from qtoolkit.errors import ModelSourceError, OutputExistsError
from qtoolkit.io import (
    OutputLockedError,
    atomic_dir,
    lock_output,
    previous_path,
    read_results_json,
    write_json,
)
from qtoolkit.model.sources import _check_folder, convert_once
from qtoolkit.provenance import folder_sha256

REPO = Path(__file__).resolve().parents[1]
HOLDER = textwrap.dedent("""
    import sys, time
    from qtoolkit.evals.results import ResultsFile
    store = ResultsFile(sys.argv[1], inputs={})
    store.begin("t", {"k": 1})
    for i in range(5):
        store.add("t", [{"id": f"a{i}", "v": i}])
    print("ready", flush=True)
    time.sleep(float(sys.argv[2]))
    store.add("t", [{"id": "a5", "v": 5}])
""")


def test_a_second_writer_fails_at_once_naming_the_holder_and_no_record_is_lost(tmp_path):
    out = tmp_path / "eval.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out), "3"], stdout=subprocess.PIPE, text=True,
                              env=env)
    try:
        assert holder.stdout.readline().strip() == "ready"
        t = time.monotonic()
        with pytest.raises(OutputLockedError, match=f"pid {holder.pid}"):
            ResultsFile(out, inputs={})
        assert time.monotonic() - t < 5  # at once, not after the holder ends
    finally:
        assert holder.wait(60) == 0
    records = json.loads(out.read_text())["tasks"]["t"]["records"]
    assert sorted(records) == [f"a{i}" for i in range(6)]

    store = ResultsFile(out, inputs={})  # the lock went with the holder: the next run resumes
    assert len(store.begin("t", {"k": 1})) == 6


def test_writes_keep_the_previous_version_and_follow_the_umask(tmp_path):
    out = tmp_path / "r.json"
    old = os.umask(0o022)
    try:
        write_json(out, {"n": 1})
        write_json(out, {"n": 2})
    finally:
        os.umask(old)
    assert json.loads(out.read_text()) == {"n": 2}
    assert json.loads(previous_path(out).read_text()) == {"n": 1}
    assert out.stat().st_mode & 0o777 == 0o644
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize(("mask", "folder", "file"), [(0o022, 0o755, 0o644), (0o027, 0o750, 0o640)])
def test_output_folders_follow_the_umask(tmp_path, mask, folder, file):
    old = os.umask(mask)
    try:
        with atomic_dir(tmp_path / "ckpt") as tmp:
            save_file({"w": torch.zeros(2)}, tmp / "model.safetensors")  # written through a 0600 temp file
            (tmp / "sub").mkdir()
            (tmp / "sub" / "config.json").write_text("{}")
    finally:
        os.umask(old)
    out = tmp_path / "ckpt"
    assert out.stat().st_mode & 0o777 == folder and (out / "sub").stat().st_mode & 0o777 == folder
    assert {p.name: p.stat().st_mode & 0o777 for p in out.rglob("*") if p.is_file()} == {
        "model.safetensors": file, "config.json": file}


def test_an_empty_results_file_is_reported_with_the_way_to_resume(tmp_path):
    out = tmp_path / "eval.json"
    write_json(out, {"tasks": {}})
    write_json(out, {"tasks": {"t": {}}})
    out.write_text("")  # what a power loss before the data reached the disk leaves
    with pytest.raises(OutputExistsError, match=r"is empty.*cp .*eval.json.prev"):
        read_results_json(out)
    out.write_text('{"tasks": ')
    with pytest.raises(OutputExistsError, match="not valid JSON"):
        read_results_json(out)


def test_lock_is_released_and_reusable(tmp_path):
    target = tmp_path / "x.json"
    with lock_output(target):
        with pytest.raises(OutputLockedError, match=str(os.getpid())):
            lock_output(target)
    with lock_output(target):
        pass


def test_two_concurrent_conversions_build_once(tmp_path):
    target = tmp_path / "models" / "m-abc"
    builds = []

    def build(tmp):
        builds.append(1)
        time.sleep(0.5)
        (tmp / "config.json").write_text("{}")

    threads = [threading.Thread(target=convert_once, args=(target, build)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(builds) == 1 and (target / "config.json").is_file()


def test_identity_covers_tokenizer_template_and_generation_config(tiny_model_dir, tmp_path):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dir, folder)
    seen = {folder_sha256(folder)}
    for name, change in [("generation_config.json", lambda t: t.replace("}", ', "eos_token_id": 7}', 1)),
                         ("tokenizer_config.json", lambda t: t.replace("{", '{"model_max_length": 9, ', 1)),
                         ("tokenizer.json", lambda t: t + " "),
                         ("chat_template.jinja", lambda t: t + "{# changed #}")]:
        path = folder / name
        path.write_text(change(path.read_text()))
        digest = folder_sha256(folder)
        assert digest not in seen, name
        seen.add(digest)
    (folder / "eval.json").write_text("{}")  # a results file beside the model is not part of it
    assert folder_sha256(folder) in seen


def test_pickle_only_folders_are_refused_with_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    (tmp_path / "extra.pth").write_bytes(b"\x80\x04pickle")
    with pytest.raises(ModelSourceError, match="pickle weights are refused") as e:
        _check_folder(tmp_path)
    assert "pytorch_model.bin" in str(e.value) and "\n" not in str(e.value)


def test_every_transformers_model_load_passes_use_safetensors():
    """A folder holding both formats must never be read through its pickle files; a GGUF file is the exception
    (transformers' GGUF reader takes `gguf_file`, not safetensors)."""
    missing = []
    for path in sorted(p for d in ("qtoolkit", "evals", "kernels") for p in (REPO / d).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "from_pretrained" and isinstance(node.func.value, ast.Name)
                    and node.func.value.id.startswith("AutoModel")):
                continue
            kw = {k.arg: k.value for k in node.keywords}
            if "gguf_file" in kw:
                continue
            if not (isinstance(kw.get("use_safetensors"), ast.Constant) and kw["use_safetensors"].value is True):
                missing.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not missing


def test_cli_runs_into_a_locked_output_fail_at_once_with_one_line(tiny_model_dir, tmp_path, capsys):
    from qtoolkit.cli import main

    out = tmp_path / "eval.json"
    with lock_output(out):  # another run holds it (flock conflicts between two opens, even in one process)
        rc = main(["eval", "--model", str(tiny_model_dir), "--baseline", str(tiny_model_dir), "--task", "code",
                   "--limit", "1", "--output", str(out)])
        assert rc == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"pid {os.getpid()}" in err[0] and "eval.json" in err[0]
        rc = main(["serve", "--model", str(tiny_model_dir), "--metrics-need-key"])
        assert rc == 2 and "--api-key" in capsys.readouterr().err
    assert not out.exists()
