"""`--speculative eagle3:DIR` in the engine (tiny target, heads saved by save_head): greedy output token-identical
to plain decoding alone and in a mixed batch with preemption, for a random head (rejects nearly everything) and a
head that always drafts the target's favourite token (accepts runs); seeded sampling repeats; a head that does not
fit the target fails at start-up with one line, exit 2 through the CLI."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from test_model_llama import build_sharp_tiny_llama
from test_spec_decoding import PROMPTS, greedy_params, make, run

from qtoolkit.cli import main
from qtoolkit.draft.format import save_head
from qtoolkit.draft.head import DraftKV, Eagle3Config, Eagle3Head
from qtoolkit.engine import SamplingParams
from qtoolkit.engine.model_runner import Chunk
from qtoolkit.engine.sequence import Sequence
from qtoolkit.engine.speculative.eagle3 import Eagle3Proposer
from qtoolkit.model.llama import ModelConfig


def target_config(model_dir: Path) -> ModelConfig:
    return ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))


def save_random_head(folder: Path, target: ModelConfig, draft_ids: list[int], seed: int = 0,
                     constant: bool = False) -> Path:
    """A randomly initialised head over `draft_ids`; `constant` zeroes its LM head, so it always drafts
    draft_ids[0] (argmax of equal logits is the first). Unit norms and 1/sqrt(fan-in) weights (fc a quarter of
    that: the tiny target's hidden states have an RMS of ~4) keep the attention over past rows, where the token
    embeddings enter, as large as the fused feature in the residual, so a mispairing changes the logits."""
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.from_target(target, draft_vocab_size=len(draft_ids)))
    with torch.no_grad():
        for name, w in head.named_parameters():
            if w.dim() == 1:
                w.fill_(1.0)
            else:
                w.normal_(0, (0.25 if name == "fc.weight" else 1.0) / w.shape[1] ** 0.5)
        if constant:
            head.lm_head.weight.zero_()
    head.set_vocab(torch.tensor(draft_ids))
    return save_head(head.eval(), folder)


@pytest.fixture(scope="module")
def sharp_dir(tmp_path_factory, tokenizer_dir):
    return build_sharp_tiny_llama(tmp_path_factory.mktemp("sharp-eagle3"), tokenizer_dir)


@pytest.fixture(scope="module")
def reference(sharp_dir):
    return run(make(sharp_dir))


@pytest.fixture(scope="module")
def heads(sharp_dir, reference, tmp_path_factory):
    """(random head, constant head on the token the target emits most)."""
    target = target_config(sharp_dir)
    favourite = Counter(t for ids, _, _ in reference for t in ids).most_common(1)[0][0]
    others = [t for t in torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(1))[:63].tolist()
              if t != favourite]
    root = tmp_path_factory.mktemp("heads")
    return (save_random_head(root / "random", target, [favourite, *others]),
            save_random_head(root / "constant", target, [favourite, *others], constant=True))


def test_greedy_identity_alone_and_in_a_mixed_batch(sharp_dir, reference, heads):
    for head, accepts in zip(heads, (False, True), strict=True):
        engine = make(sharp_dir, speculative=f"eagle3:{head}", num_speculative_tokens=4, max_verify_tokens=64)
        assert isinstance(engine.proposer, Eagle3Proposer)
        assert run(engine, PROMPTS[1:2], greedy_params()[1:2]) == reference[1:2], head
        assert run(engine) == reference, head  # PROMPTS[1] again: its prompt now comes from the prefix cache
        spec = engine.stats().speculative
        assert spec.draft_tokens > 0 and (spec.accepted_tokens > 0) == accepts, (head, spec)
        assert engine.stats().kv_blocks_used == 0 and not engine.proposer.states  # every request released


def test_greedy_identity_with_preemption_and_chunked_prefill(sharp_dir, reference, heads):
    for head in heads:
        engine = make(sharp_dir, blocks=24, max_num_batched_tokens=32, speculative=f"eagle3:{head}",
                      max_verify_tokens=64)
        assert run(engine) == reference, head
        stats = engine.stats()
        assert stats.num_preemptions > 0 and stats.speculative.draft_tokens > 0, head
        assert stats.kv_blocks_used == 0 and not engine.proposer.states


def test_sampled_requests_are_seeded_and_complete(sharp_dir, heads):
    engine = make(sharp_dir, speculative=f"eagle3:{heads[1]}", max_verify_tokens=64)
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7 + i, ignore_eos=True)
              for i in range(4)]
    first = run(engine, PROMPTS[:4], params)
    assert run(engine, PROMPTS[:4], params) == first
    assert all(len(t) == 12 for t, _, _ in first)
    assert engine.stats().speculative.draft_tokens > 0


def test_a_head_that_does_not_fit_fails_with_one_line_through_the_cli(tiny_model_dir, tmp_path, capsys):
    target = target_config(tiny_model_dir)
    args = ["generate", "--model", str(tiny_model_dir), "--prompt", "hello hello hello", "--max-tokens", "6",
            "--kv-cache-memory", "16MiB", "--num-speculative-tokens", "3", "--speculative"]
    good = save_random_head(tmp_path / "good", target, list(range(40)))
    assert main(args + [f"eagle3:{good}"]) == 0
    assert "[speculative eagle3:" in capsys.readouterr().err
    narrow = ModelConfig.from_hf({**json.loads((tiny_model_dir / "config.json").read_text()), "hidden_size": 32})
    small_vocab = ModelConfig.from_hf({**json.loads((tiny_model_dir / "config.json").read_text()), "vocab_size": 500})
    for folder, words in [(save_random_head(tmp_path / "narrow", narrow, list(range(40))), "hidden size 32"),
                          (save_random_head(tmp_path / "vocab", small_vocab, list(range(40))), "vocabulary of 500"),
                          (tmp_path / "missing", "no such folder")]:
        assert main(args + [f"eagle3:{folder}"]) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and str(folder) in err and len(err.splitlines()) == 1, err
    assert main(args + ["eagle3:"]) == 2
    assert "eagle3:DIR" in capsys.readouterr().err


def test_signoff_refuses_a_head_that_does_not_fit_before_any_work(tiny_model_dir, tmp_path, capsys):
    """The sign-off reaches its bench step only after quantizing and evaluating: a head that cannot serve the
    model fails at start-up instead, and nothing is written."""
    narrow = ModelConfig.from_hf({**json.loads((tiny_model_dir / "config.json").read_text()), "hidden_size": 32})
    folder = save_random_head(tmp_path / "narrow", narrow, list(range(40)))
    out = tmp_path / "signoff"
    code = main(["signoff", "--model", str(tiny_model_dir), "--recipe", "int4-rtn", "--speculative",
                 f"eagle3:{folder}", "--output", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "hidden size 32" in err and len(err.splitlines()) == 1, err
    assert not out.exists()


def reference_chain(head: Eagle3Head, target, tokens: list[int], aux: torch.Tensor, k: int):
    """k greedy drafts and the first row's logits by the head's documented convention, in one causal pass over
    every committed position (feature of position i with the embedding of token i+1), then single-row steps."""
    kv = DraftKV.empty(head.config)
    n = len(tokens) - 1
    embed = lambda ids: torch.nn.functional.embedding(torch.tensor(ids), target.embed_tokens)  # noqa: E731
    hidden, logits = head.step(embed(tokens[1:]), head.fuse(aux), torch.arange(n), kv)
    first, drafts = logits[-1], []
    for j in range(k):
        drafts.append(int(head.to_target(logits[-1].argmax())))
        hidden, logits = head.step(embed(drafts[-1:]), hidden[-1:], torch.tensor([n + j]), kv)
    return drafts, first


@torch.inference_mode()
def test_the_head_state_built_step_by_step_equals_one_causal_pass(sharp_dir, heads):
    """After several verification steps (drafts rejected and rolled back each time, prompt features fed at the first
    proposal), the proposer drafts what the head computes in one causal pass over every committed position's
    target feature: each position is paired with the right token and feature, once. Proposing twice gives the
    same again (a proposal leaves the state as it found it)."""
    engine = make(sharp_dir, speculative=f"eagle3:{heads[0]}", num_speculative_tokens=3, max_verify_tokens=64)
    engine.add_request("r", PROMPTS[0], SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step()
    seq, proposer = engine._seqs["r"], engine.proposer
    while seq.num_output_tokens < 12:
        engine.step()
    assert engine.stats().speculative.verify_steps >= 3
    plain = make(sharp_dir)  # a second copy of the target, so the engine's cache stays untouched
    copy = Sequence("copy", seq.token_ids, seq.params)
    plain.block_manager.grow(copy, len(copy))
    # every committed token but the last, as the engine has computed them before the next verification
    aux = plain.runner.step([Chunk(copy.token_ids[:-1], 0, copy.block_table)], proposer.aux_layers).aux[0]
    drafts, first = reference_chain(proposer.head, plain.model, seq.token_ids, aux, 3)
    sampled = Sequence("r", seq.token_ids, SamplingParams(temperature=1.0, seed=3))
    q = torch.zeros(plain.model.config.vocab_size)
    q[proposer.target_ids] = first.softmax(-1)
    for _ in range(2):
        assert proposer.propose([(seq, 3)])[0].tokens == drafts
        torch.testing.assert_close(proposer.propose([(sampled, 1)])[0].draft_probs[0], q, atol=1e-5, rtol=1e-4)
