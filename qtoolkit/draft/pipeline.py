"""`qtool train-draft` as a function: model + output folder -> a trained EAGLE-3 head in vLLM's format, its
coverage table, its held-out acceptance, and the state a later run resumes from."""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import OutputExistsError, QToolError
from ..io import OutputLock, read_results_json, write_json
from ..model.llama import ModelConfig
from ..model.sources import resolve_model
from ..progress import status
from .batches import featurize
from .corpus import CorpusSpec, load_or_build
from .format import CONFIG, load_head
from .head import Eagle3Config, Eagle3Head, default_aux_layer_ids
from .state import STATE_JSON, load_state, save_state
from .target import Teacher
from .train import EVAL_K, LoopArgs, LoopState, evaluate, init_head, train_loop
from .vocab import choose_size, coverage_table, table_json, token_counts, top_tokens


class TrainDraftError(QToolError):
    """Bad train-draft arguments."""


@dataclass
class TrainDraftArgs:
    model: str
    output: Path
    draft_vocab: int | None = None  # None: the measured size with the highest modeled speedup (vocab.py)
    device: str = "auto"
    overwrite: bool = False
    corpus: CorpusSpec = field(default_factory=CorpusSpec)
    loop: LoopArgs = field(default_factory=LoopArgs)


def validate(a: TrainDraftArgs) -> None:
    positive = {"--ttt-steps": a.loop.ttt_steps, "--epochs": a.loop.epochs, "--batch-size": a.loop.batch_size,
                "--seq-len": a.corpus.seq_len, "--gen-tokens": a.corpus.gen_tokens,
                "--heldout-prompts": a.corpus.heldout_prompts, "--eval-every": a.loop.eval_every}
    for flag, value in positive.items():
        if value <= 0:
            raise TrainDraftError(f"{flag} must be a positive integer, got {value}")
    if a.loop.ttt_steps > 8:
        raise TrainDraftError(f"--ttt-steps {a.loop.ttt_steps} is more than 8: EAGLE-3 unrolls 3 to 7 steps")
    if not a.loop.lr > 0 or not a.loop.time_budget_s > 0:
        raise TrainDraftError("--lr and --time-budget must be positive")
    if a.draft_vocab is not None and a.draft_vocab <= 0:
        raise TrainDraftError(f"--draft-vocab must be positive or auto, got {a.draft_vocab}")
    if a.device not in ("auto", "cpu", "cuda") or (a.device == "cuda" and not torch.cuda.is_available()):
        raise TrainDraftError(f"--device {a.device} is not available here: use auto, cpu or (with a GPU) cuda")


def prepare_output(folder: Path, overwrite: bool) -> bool:
    """True when the folder holds a run to resume; refuses a folder that is something else."""
    if folder.exists() and not folder.is_dir():
        raise OutputExistsError(f"output {folder} is a file: choose a folder for the draft head")
    if (folder / STATE_JSON).is_file() and not overwrite:
        read_results_json(folder / STATE_JSON)  # an empty or corrupt state is refused with the way back
        return True
    if (folder / "corpus.json").is_file() and not overwrite:
        return False  # a run that ended before training began: its corpus is reused
    if folder.exists() and any(folder.iterdir()):
        if not overwrite:
            raise OutputExistsError(f"output {folder} exists and is not a train-draft run: choose another "
                                    "--output or pass --overwrite")
        shutil.rmtree(folder)
    return False


def train_draft(a: TrainDraftArgs) -> dict[str, Any]:
    validate(a)
    source = resolve_model(a.model)  # a bad model fails before anything is written
    target = ModelConfig.from_hf(source.config)
    if target.num_layers < 2:
        raise TrainDraftError(f"{a.model} has {target.num_layers} layer: EAGLE-3 taps three layers of a deeper "
                              "target")
    device = torch.device("cuda" if a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    resume = prepare_output(a.output, a.overwrite)
    with OutputLock(a.output):
        a.output.mkdir(parents=True, exist_ok=True)
        return _run(a, source, target, device, resume)


def _run(a: TrainDraftArgs, source: Any, target: ModelConfig, device: torch.device, resume: bool) -> dict:
    t0 = time.monotonic()
    aux = default_aux_layer_ids(target.num_layers)
    run_file = a.output / "run.json"
    if resume:
        run = read_results_json(run_file) if run_file.is_file() else {}
        if run.get("model_sha256") != source.sha256:
            raise TrainDraftError(f"{a.output} holds a run for another model ({run.get('model')}): pass that "
                                  "--model to resume it, or --overwrite to start again")
        status(f"resuming the run in {a.output} at step {read_results_json(a.output / STATE_JSON)['step']}")

    def engine():
        from ..engine import Engine

        # every prompt runs in one batch: one wave of decode steps instead of several
        n = a.corpus.code_prompts + a.corpus.summary_prompts + 2 * a.corpus.heldout_prompts
        return Engine(source, kv_cache_memory="3GiB", max_num_seqs=max(1, min(n, 160)))

    corpus = load_or_build(a.output / "corpus.json", engine, a.corpus)
    data_s = time.monotonic() - t0
    teacher = Teacher(str(source.path), aux, device)
    train_items = featurize(teacher, corpus.train, "features")
    heldout = {k: featurize(teacher, v, f"features {k}", greedy=True) for k, v in corpus.heldout.items()}
    features_s = time.monotonic() - t0 - data_s
    if not resume:  # what the time budget spent before training, counted once
        write_json(run_file, {"model": source.spec, "model_sha256": source.sha256, "prep_s": data_s + features_s})
    prep_s = read_results_json(run_file)["prep_s"]
    counts = token_counts(corpus.train, target.vocab_size)
    body = sum(p.numel() for n, p in Eagle3Head(Eagle3Config.from_target(target, 1, aux)).named_parameters()
               if not n.startswith("lm_head"))
    target_params = sum(p.numel() for p in teacher.model.parameters())
    table = coverage_table(counts, corpus.heldout, target.hidden_size, body, target_params=target_params)
    write_json(a.output / "vocab_coverage.json", {"rows": table_json(table), "chosen": None})
    if resume:
        head = load_head(a.output, target).to(device)
    else:
        n = a.draft_vocab or choose_size(table)
        head = Eagle3Head(Eagle3Config.from_target(target, min(n, target.vocab_size), aux)).to(device)
        init_head(head, teacher, top_tokens(counts, head.config.draft_vocab_size))
    write_json(a.output / "vocab_coverage.json", {"rows": table_json(table),
                                                  "chosen": head.config.draft_vocab_size})
    opt = torch.optim.AdamW(head.parameters(), lr=a.loop.lr, weight_decay=a.loop.weight_decay)
    state = LoopState()
    if resume:
        c = load_state(a.output, head, opt)
        state = LoopState(c["epoch"], c["batch"], c["step"], c["elapsed_s"], c["history"])
    embed = teacher.embed_weight
    rows = teacher.lm_head_weight[head.to_target(torch.arange(head.config.draft_vocab_size, device=device))]
    loop = LoopArgs(**{**asdict(a.loop), "time_budget_s": max(a.loop.time_budget_s - prep_s, 1.0)})
    state = train_loop(head, opt, embed, rows, train_items, heldout, loop, state, a.output, device)
    final = evaluate(head, embed, heldout, device)
    save_state(a.output, head, opt, {"epoch": state.epoch, "batch": state.batch, "step": state.step,
                                     "elapsed_s": state.elapsed_s, "history": state.history, "loop": vars(loop)})
    report = {"model": source.spec, "model_sha256": source.sha256, "output": str(a.output), "device": str(device),
              "threads": torch.get_num_threads(), "draft_vocab_size": head.config.draft_vocab_size,
              "aux_layer_ids": list(aux), "train_sequences": len(train_items),
              "train_tokens": sum(len(it.sample.token_ids) for it in train_items), "steps": state.step,
              "epochs_done": state.epoch + state.batch / max(1, -(-len(train_items) // a.loop.batch_size)),
              "seconds": {"corpus_and_features_first_run": prep_s, "corpus": data_s, "features": features_s,
                          "training": state.elapsed_s,
                          "wall_this_run": time.monotonic() - t0},
              "heldout_k": EVAL_K, "heldout": final, "head_config": CONFIG, "args": _args_json(a)}
    write_json(a.output / "train_report.json", report)
    return report


def _args_json(a: TrainDraftArgs) -> dict:
    return {"model": a.model, "output": str(a.output), "draft_vocab": a.draft_vocab, "device": a.device,
            "corpus": asdict(a.corpus), "loop": asdict(a.loop)}
