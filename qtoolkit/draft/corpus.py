"""Assemble a draft head's corpus: natural text (stdlib source, ACLSum train documents), the target's own
continuations of prompts built from them, and the held-out continuations acceptance is measured on."""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..engine.params import SamplingParams
from ..io import write_json
from .data import (
    CODE,
    HELDOUT_ACLSUM_SPLIT,
    SUMMARIZATION,
    TRAIN_ACLSUM_SPLIT,
    Sample,
    aclsum_texts,
    check_clean,
    code_chunks,
    function_stubs,
    stdlib_files,
    summary_prompts,
)


@dataclass
class CorpusSpec:
    seq_len: int = 256
    stdlib_tokens: int = 40_000
    aclsum_docs: int = 100  # ACLSum train documents as plain text (the split has 100)
    code_prompts: int = 200  # stdlib function stubs the target continues
    summary_prompts: int = 400  # ACLSum train prompts the target continues (4 per document)
    gen_tokens: int = 96
    sampled_share: float = 0.25  # of self-written samples drawn at temperature 0.8 instead of greedy
    heldout_prompts: int = 24  # per workload
    heldout_tokens: int = 96
    seed: int = 0


@dataclass
class Corpus:
    train: list[Sample]
    heldout: dict[str, list[Sample]]

    def to_json(self) -> dict:
        return {"train": [asdict(s) for s in self.train],
                "heldout": {k: [asdict(s) for s in v] for k, v in self.heldout.items()}}

    @classmethod
    def from_json(cls, data: dict) -> Corpus:
        return cls([Sample(**s) for s in data["train"]],
                   {k: [Sample(**s) for s in v] for k, v in data["heldout"].items()})


@dataclass
class Ask:
    """One prompt for the target to continue."""

    kind: str
    prompt: str
    heldout: bool
    sampled: bool = False


def continue_prompts(engine: Any, asks: list[Ask], spec: CorpusSpec) -> list[Sample]:
    """The target's continuations of every prompt in one engine batch (greedy, or sampled where asked)."""
    ids = [engine.tokenizer(a.prompt).input_ids for a in asks]
    params = [SamplingParams(max_tokens=spec.heldout_tokens if a.heldout else spec.gen_tokens,
                             temperature=0.8 if a.sampled else 0.0, seed=spec.seed + i if a.sampled else None)
              for i, a in enumerate(asks)]
    outs = engine.generate(ids, params)
    return [Sample(a.kind, f"self-{'sampled' if a.sampled else 'greedy'}:{a.kind}:{i}", p + o.token_ids, len(p))
            for i, (a, p, o) in enumerate(zip(asks, ids, outs, strict=True))]


def build_corpus(engine: Any, spec: CorpusSpec) -> Corpus:
    tok = engine.tokenizer
    rng = random.Random(spec.seed)
    train_files, held_files = stdlib_files("train"), stdlib_files("heldout")
    train = code_chunks(train_files, tok, spec.stdlib_tokens, spec.seq_len, spec.seed)
    train += aclsum_texts(tok)[:spec.aclsum_docs]
    code = function_stubs(train_files, spec.code_prompts, spec.seed + 1)
    summ = summary_prompts(TRAIN_ACLSUM_SPLIT, tok)
    summ = rng.sample(summ, min(spec.summary_prompts, len(summ)))
    asks = []
    for kind, prompts in ((CODE, code), (SUMMARIZATION, summ)):
        sampled = set(rng.sample(range(len(prompts)), int(spec.sampled_share * len(prompts))))
        asks += [Ask(kind, p, False, i in sampled) for i, p in enumerate(prompts)]
    held_summ = summary_prompts(HELDOUT_ACLSUM_SPLIT, tok)
    held_summ = random.Random(spec.seed + 3).sample(held_summ, min(spec.heldout_prompts, len(held_summ)))
    asks += [Ask(CODE, p, True) for p in function_stubs(held_files, spec.heldout_prompts, spec.seed + 2)]
    asks += [Ask(SUMMARIZATION, p, True) for p in held_summ]
    samples = continue_prompts(engine, asks, spec)
    train += [s for s, a in zip(samples, asks, strict=True) if not a.heldout]
    heldout = {kind: [s for s, a in zip(samples, asks, strict=True) if a.heldout and a.kind == kind]
               for kind in (CODE, SUMMARIZATION)}
    check_clean(train, tok)
    return Corpus(train, heldout)


def load_or_build(path: Path, engine_factory: Any, spec: CorpusSpec) -> Corpus:
    """The corpus saved in the output folder (a resumed run regenerates nothing), or a new one saved there."""
    if path.is_file():
        data = json.loads(path.read_text())
        if data.get("spec") == asdict(spec):
            return Corpus.from_json(data["corpus"])
    corpus = build_corpus(engine_factory(), spec)
    write_json(path, {"spec": asdict(spec), "corpus": corpus.to_json()})
    return corpus
