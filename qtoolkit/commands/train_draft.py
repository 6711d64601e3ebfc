"""`qtool train-draft`: train an EAGLE-3 draft head for a model, written in vLLM's EAGLE-3 format."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HELP = "train an EAGLE-3 draft head for a model (self-distilled, reduced vocabulary, vLLM's format)"

EXAMPLES = """\
examples:
  qtool train-draft --model default --output runs/eagle3-default
  qtool train-draft --model default --output runs/eagle3-default --time-budget 30   # resumes the same folder
  qtool serve --model default --speculative eagle3:runs/eagle3-default
"""


def _vocab(value: str) -> int | None:
    if value == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a token count or auto") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="`default`, a Hugging Face folder or a .gguf file: the target")
    p.add_argument("--output", required=True, type=Path, help="folder for the head (config.json, "
                   "model.safetensors) and its resumable training state; an existing run there is resumed")
    p.add_argument("--overwrite", action="store_true", help="start again in an existing --output")
    p.add_argument("--draft-vocab", type=_vocab, default=None, metavar="N|auto",
                   help="draft vocabulary size; auto = the measured size (coverage of the target's held-out "
                        "greedy tokens against LM-head cost) with the highest modeled speedup (default)")
    p.add_argument("--time-budget", type=float, default=50.0, metavar="MIN",
                   help="minutes for the whole run, corpus and features included; it then stops and saves")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: cuda when present")
    p.add_argument("--ttt-steps", type=int, default=4, help="training-time-test unroll (draft positions trained)")
    p.add_argument("--epochs", type=int, default=3, help="passes over the training samples (the time budget may stop first)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--eval-every", type=int, default=100, help="steps between held-out acceptance checks")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per stdlib training window")
    p.add_argument("--stdlib-tokens", type=int, default=40_000, help="stdlib source tokens trained on")
    p.add_argument("--aclsum-docs", type=int, default=100, help="ACLSum train documents read as plain text")
    p.add_argument("--code-prompts", type=int, default=200, help="stdlib function stubs the target continues")
    p.add_argument("--summary-prompts", type=int, default=400, help="ACLSum train prompts the target continues")
    p.add_argument("--gen-tokens", type=int, default=96, help="tokens per self-written continuation")
    p.add_argument("--heldout-prompts", type=int, default=24, help="held-out prompts per workload")
    p.add_argument("--seed", type=int, default=0, help="seeds the data draw, the sampled continuations and the batch order")


def run(args: argparse.Namespace) -> int:
    from ..draft.corpus import CorpusSpec
    from ..draft.pipeline import TrainDraftArgs, train_draft
    from ..draft.train import LoopArgs

    a = TrainDraftArgs(
        model=args.model, output=args.output, draft_vocab=args.draft_vocab, device=args.device,
        overwrite=args.overwrite,
        corpus=CorpusSpec(seq_len=args.seq_len, stdlib_tokens=args.stdlib_tokens, aclsum_docs=args.aclsum_docs,
                          code_prompts=args.code_prompts,
                          summary_prompts=args.summary_prompts, gen_tokens=args.gen_tokens,
                          heldout_prompts=args.heldout_prompts, seed=args.seed),
        loop=LoopArgs(ttt_steps=args.ttt_steps, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                      time_budget_s=args.time_budget * 60, eval_every=args.eval_every, seed=args.seed))
    report = train_draft(a)
    summary = {k: {"per_position": [round(x, 3) for x in v.get("per_position", [])],
                   "acceptance_length": round(v.get("acceptance_length", float("nan")), 3)}
               for k, v in report["heldout"].items()}
    print(json.dumps({"output": report["output"], "draft_vocab_size": report["draft_vocab_size"],
                      "steps": report["steps"], "heldout_k4": summary}, indent=2), file=sys.stdout)
    return 0
