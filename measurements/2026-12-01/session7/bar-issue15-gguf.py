"""Issue #15 point 6's bar: GGUF files of each engine family in each block type, loaded as a user loads one.

Per family (tiny random llama3-rope, qwen2, qwen3, mistral window 16, gemma3_text, qwen3_moe as llama.cpp's
format expresses them; mixtral) and block type (F32, F16, Q8_0 from gguf-py; Q4_K_M from llama.cpp's
llama-quantize, i.e. Q4_K and Q6_K blocks), tests/gguf_files.py writes the file as llama.cpp's converter would,
then `qtool generate --model FILE.gguf --temperature 0 --max-tokens 8` (the CLI's entry point, in-process) on a
short (4-token) and a long (44-token, past every window) prompt is compared with transformers' greedy `generate`
on the original model's config holding the weights the file's blocks dequantize to (for F32: the original weights,
checked). Outcome per cell: equal / differs / refused (exit 2, its one-line message) / error.
Writes bar-issue15-gguf.json beside this file: every figure measured, nothing hard-coded.

Run from the repository root: QTOOLKIT_SRC=$PWD OMP_NUM_THREADS=1 python3 measurements/2026-12-01/session7/bar-issue15-gguf.py
"""

import contextlib
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests"))

from gguf_files import BLOCKS, FAMILIES, build_model, write_case, write_gguf  # noqa: E402
from test_gguf_families import LONG, NEW, SHORT, f32_weights_equal, reference_texts  # noqa: E402

from qtoolkit.cli import main  # noqa: E402
from qtoolkit.model.sources import resolve_model  # noqa: E402

ONLY = [f for f in os.environ.get("FAMILIES", "").split(",") if f]  # a subset: FAMILIES=gemma3_text


def cli(path: Path) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["generate", "--model", str(path), "--prompt", SHORT, "--prompt", LONG, "--temperature", "0",
                   "--max-tokens", str(NEW), "--kv-cache-memory", "8MiB", "-q"])
    return rc, out.getvalue(), err.getvalue().strip()


def texts_of(out: str) -> list[str]:
    import re

    return [t.removesuffix("\n") for t in re.split(r"^=== \[\d+\] \(.*\)\n", out, flags=re.M)[1:]]


def cell(family: str, block: str, folder: Path, tok_dir: Path) -> dict:
    t0 = time.time()
    model, path, kinds = write_case(family, block, folder, tok_dir)
    row = {"family": family, "block": block, "file_block_types": sorted(kinds)}
    rc, out, err = cli(path)
    row["exit"] = rc
    if rc != 0:
        row.update(outcome="refused" if rc == 2 else "error", message=err.splitlines()[-1] if err else "")
        return row
    src = resolve_model(path)
    want, ref = reference_texts(model, src)
    got = texts_of(out)
    if block == "F32":
        row["f32_weights_equal_original"] = f32_weights_equal(model, ref)
    row.update(outcome="equal" if got == want else "differs", qtool=got, transformers=want,
               converted_model_type=src.config["model_type"], seconds=round(time.time() - t0, 1))
    return row


def main_() -> None:
    tok_dir = resolve_model("default").path
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["QTOOLKIT_CACHE"] = str(Path(tmp) / "cache")  # every file converted by today's code
        for family in [f for f in FAMILIES if not ONLY or f in ONLY]:
            for block in BLOCKS:
                try:
                    rows.append(cell(family, block, Path(tmp), tok_dir))
                except Exception as e:  # a cell that cannot even be written or compared is recorded, not hidden
                    rows.append({"family": family, "block": block, "outcome": "error",
                                 "message": f"{type(e).__name__}: {e}"[:400]})
                print(json.dumps({k: rows[-1].get(k) for k in ("family", "block", "outcome", "message")}),
                      flush=True)
        model, _ = build_model("mixtral", tok_dir)
        path = write_gguf(model, Path(tmp) / "mixtral-f32.gguf")
        rc, _, err = cli(path)
        rows.append({"family": "mixtral", "block": "F32", "exit": rc, "outcome": "refused" if rc == 2 else "error",
                     "message": err.splitlines()[-1] if err else ""})
        print(json.dumps(rows[-1]), flush=True)
    out = Path(__file__).with_suffix(".json")
    if ONLY:  # a subset's cells replace the same cells of the full run's file
        old = json.loads(out.read_text())["cells"] if out.exists() else []
        keep = {(r["family"], r["block"]) for r in rows}
        rows = [r for r in old if (r["family"], r["block"]) not in keep] + rows
    summary = {f"{r['family']} {r['block']}": r["outcome"] for r in rows}
    out.write_text(json.dumps({"summary": summary, "cells": rows}, indent=1) + "\n")
    print(out)


if __name__ == "__main__":
    main_()
