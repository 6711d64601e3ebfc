"""`qtool quantize`: a recipe turns a model into a compressed-tensors checkpoint."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from qtoolkit.errors import QToolError

HELP = "quantize a model with a recipe (recipes/*.yaml) into a compressed-tensors checkpoint"


EXAMPLES = """\
examples:
  qtool quantize --model default --recipe int4-rtn --output out/int4
  qtool quantize --model ./my-hf-model --recipe int4-gptq --num-samples 128 --output out/gptq
  qtool quantize --model default --recipe ./recipe.yaml --output out/q   # an llm-compressor recipe file too
  qtool quantize --recipe int4-rtn-asym-head8 --print-recipe > recipe.yaml   # for oneshot(recipe=...)
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="`default`, a Hugging Face folder or a .gguf file")
    p.add_argument("--recipe", required=True,
                   help="a recipe name in recipes/ (e.g. int4-rtn) or a YAML path: qtoolkit's schema or an "
                        "llm-compressor recipe file as `oneshot(recipe=...)` reads it")
    p.add_argument("--output", help="output folder (written atomically); required unless --print-recipe")
    p.add_argument("--print-recipe", action="store_true",
                   help="print the llm-compressor recipe the --recipe stands for and exit (nothing is quantized)")
    p.add_argument("--calibration", choices=["code", "summarization", "mixed"],
                   help="calibration text for GPTQ recipes (overrides the recipe)")
    p.add_argument("--num-samples", type=int, help="number of calibration samples (overrides the recipe)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.add_argument("--no-verify", action="store_true", help="skip reloading the output with transformers")


def run(args: argparse.Namespace) -> int:
    if args.print_recipe:
        from qtoolkit.quantize.llmc_writer import dump_llmc
        from qtoolkit.quantize.recipe import load_recipe

        with contextlib.redirect_stdout(sys.stderr):  # llm-compressor's import-time log lines stay off stdout
            recipe = load_recipe(args.recipe)
        sys.stdout.write(dump_llmc(recipe))
        return 0
    if not args.output:
        raise QToolError("--output is required to quantize: pass --output DIR (or --print-recipe to only print "
                         "the llm-compressor recipe)")
    # stdout carries only the JSON summary. llm-compressor binds its log sink to the sys.stdout of the moment, on
    # import (which logs already) and again mid-run, so both happen while sys.stdout is stderr
    with contextlib.redirect_stdout(sys.stderr):
        from qtoolkit.quantize.run import quantize

        res = quantize(args.model, args.recipe, args.output, calibration=args.calibration,
                       num_samples=args.num_samples, overwrite=args.overwrite, verify=not args.no_verify)
    rep, t = res.report, res.report.totals
    print(json.dumps({"output": str(res.output), "recipe": rep.recipe.name,
                      "linear_ratio_vs_bf16": t.linear_ratio_vs_bf16,
                      "linear_quantized_bytes": t.linear_quantized_bytes,
                      "checkpoint_bytes": t.checkpoint_bytes, "seconds": rep.timings.total_s,
                      "smoke_test": rep.smoke_test.completion if rep.smoke_test else None}, indent=2))
    return 0
