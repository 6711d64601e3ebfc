"""A tiny target trains a head in seconds through `qtool train-draft`: its held-out acceptance beats a random
head's, the folder loads back for that target, nothing in its corpus is an eval item, and a second run resumes."""

from __future__ import annotations

import json

import pytest
import torch
from qtoolkit.evals.data import aclsum_items
from transformers import AutoTokenizer

from qtoolkit.cli import main
from qtoolkit.draft.batches import featurize
from qtoolkit.draft.corpus import Corpus
from qtoolkit.draft.data import check_clean
from qtoolkit.draft.format import load_head
from qtoolkit.draft.head import Eagle3Head
from qtoolkit.draft.target import Teacher
from qtoolkit.draft.train import evaluate
from qtoolkit.model.llama import ModelConfig

FLAGS = ["--stdlib-tokens", "600", "--aclsum-docs", "2", "--code-prompts", "3", "--summary-prompts", "3",
         "--gen-tokens", "24", "--heldout-prompts", "3", "--epochs", "6", "--batch-size", "4",
         "--draft-vocab", "128", "--seq-len", "48", "--eval-every", "1000", "--device", "cpu"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_dir):
    out = tmp_path_factory.mktemp("draft") / "head"
    assert main(["train-draft", "--model", str(tiny_model_dir), "--output", str(out), *FLAGS]) == 0
    return out


def test_trained_head_beats_a_random_head_on_held_out_text(trained, tiny_model_dir):
    report = json.loads((trained / "train_report.json").read_text())
    target = ModelConfig.from_hf(json.loads((tiny_model_dir / "config.json").read_text()))
    head = load_head(trained, target)
    assert head.config.draft_vocab_size == 128 == report["draft_vocab_size"]
    corpus = Corpus.from_json(json.loads((trained / "corpus.json").read_text())["corpus"])
    teacher = Teacher(str(tiny_model_dir), head.config.aux_layer_ids, torch.device("cpu"))
    held = {k: featurize(teacher, v, k, greedy=True) for k, v in corpus.heldout.items()}
    torch.manual_seed(0)
    random_head = Eagle3Head(head.config)
    random_head.set_vocab(head.to_target(torch.arange(128)))
    mine = evaluate(head, teacher.embed_weight, held, torch.device("cpu"))
    theirs = evaluate(random_head, teacher.embed_weight, held, torch.device("cpu"))
    for kind in ("code", "summarization"):
        assert mine[kind]["rows"] > 0
        assert mine[kind]["acceptance_length"] == pytest.approx(report["heldout"][kind]["acceptance_length"])
    mean = lambda acc: sum(a["acceptance_length"] for a in acc.values()) / 2  # noqa: E731
    print(mine, theirs)
    assert mean(mine) > mean(theirs) + 0.2, (mine, theirs)


def test_corpus_holds_no_eval_item_and_held_out_is_never_trained_on(trained, tiny_model_dir):
    corpus = Corpus.from_json(json.loads((trained / "corpus.json").read_text())["corpus"])
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    check_clean(corpus.train, tok)
    test_ids = {d["id"] for d in aclsum_items("test")} | {d["id"] for d in aclsum_items("val")}
    assert not any(s.source.split(":", 1)[1] in test_ids for s in corpus.train if s.source.startswith("aclsum"))
    train_text = "\n".join(tok.decode(s.token_ids) for s in corpus.train)
    for kind, samples in corpus.heldout.items():
        for s in samples:
            assert tok.decode(s.token_ids[:s.prompt_len]).strip() not in train_text, kind


def test_a_second_run_resumes_and_overwrite_starts_again(trained, tiny_model_dir):
    state = json.loads((trained / "train_state.json").read_text())
    corpus_written = (trained / "corpus.json").stat().st_mtime_ns
    more = [*FLAGS[:FLAGS.index("--epochs")], "--epochs", "7", *FLAGS[FLAGS.index("--epochs") + 2:]]
    assert main(["train-draft", "--model", str(tiny_model_dir), "--output", str(trained), *more]) == 0
    again = json.loads((trained / "train_state.json").read_text())
    assert again["epoch"] == 7 and again["step"] > state["step"]
    assert (trained / "corpus.json").stat().st_mtime_ns == corpus_written  # the corpus is reused, not rebuilt
    one = [*FLAGS[:FLAGS.index("--epochs")], "--epochs", "1", *FLAGS[FLAGS.index("--epochs") + 2:]]
    assert main(["train-draft", "--model", str(tiny_model_dir), "--output", str(trained), "--overwrite", *one]) == 0
    fresh = json.loads((trained / "train_state.json").read_text())
    assert fresh["epoch"] == 1 and fresh["step"] < again["step"]
