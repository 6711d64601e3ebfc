"""Rejection sampling is lossless: with a toy 16-token LlamaModel as target and another as draft, the tokens
speculative verification emits follow the target's distribution (chi-square), while the draft's own tokens do
not (so the test can tell a broken verifier apart)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from torch import nn

from qtoolkit.engine.model_runner import ModelRunner
from qtoolkit.engine.params import SamplingParams
from qtoolkit.engine.sampler import warped_probs
from qtoolkit.engine.sequence import Sequence
from qtoolkit.engine.speculative.verify import verify
from qtoolkit.model.llama import LlamaModel, ModelConfig

VOCAB = 16
CONTEXT = [3, 1, 4, 1, 5]


def toy_model(seed: int, sharpness: float = 3.0) -> LlamaModel:
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64,
                      tie_word_embeddings=False, qkv_bias=False, mlp_bias=False)
    g = torch.Generator().manual_seed(seed)

    def linear(out_features: int, in_features: int, scale: float = 1.0) -> nn.Linear:
        lin = nn.Linear(in_features, out_features, bias=False)
        lin.weight = nn.Parameter(torch.randn(out_features, in_features, generator=g) * scale / in_features ** 0.5,
                                  requires_grad=False)
        return lin

    model = LlamaModel(cfg)
    model.embed_tokens = nn.Parameter(torch.randn(VOCAB, 32, generator=g), requires_grad=False)
    for layer in model.layers:
        layer.attn.qkv_proj = linear((4 + 2 + 2) * 8, 32)
        layer.attn.o_proj = linear(32, 32)
        layer.mlp.gate_up_proj = linear(128, 32)
        layer.mlp.down_proj = linear(32, 64)
    model.lm_head = linear(VOCAB, 32, sharpness)
    model.cast_rope()
    return model.eval()


def logits_for_all_drafts(model: LlamaModel) -> torch.Tensor:
    """[V, V, 3, V]: for each 2-token draft (a, b) the logits after CONTEXT, CONTEXT+a, CONTEXT+a+b."""
    runner = ModelRunner(model, num_blocks=VOCAB * VOCAB * 2 + 1, block_size=4)
    seqs = [Sequence(f"{a}-{b}", CONTEXT + [a, b], SamplingParams()) for a in range(VOCAB) for b in range(VOCAB)]
    for i, s in enumerate(seqs):
        s.block_table = [2 * i, 2 * i + 1]
    logits = runner.run([(s, len(s)) for s in seqs], [3] * len(seqs))
    return logits.view(VOCAB, VOCAB, 3, VOCAB)


@pytest.fixture(autouse=True)
def one_thread():
    # thousands of ops on 16-wide tensors: on a shared 2-core machine, waking a second OpenMP thread for each
    # costs milliseconds (softmax of [3, 16]: 11 ms with 2 threads, 2 us with 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def toy_logits():
    return logits_for_all_drafts(toy_model(0)), logits_for_all_drafts(toy_model(1))


@pytest.mark.parametrize("use_draft_probs,top_k", [(True, 12), (False, 0)], ids=["draft-model", "point-mass"])
def test_rejection_sampling_emits_the_target_distribution(toy_logits, use_draft_probs, top_k):
    target, draft = toy_logits
    params = SamplingParams(temperature=0.8, top_k=top_k)
    p0 = warped_probs(target[0, 0, :1], [params])[0]
    q = warped_probs(draft.reshape(-1, VOCAB), [params] * VOCAB * VOCAB * 3).view(VOCAB, VOCAB, 3, VOCAB)
    gen = torch.Generator().manual_seed(1234)
    trials = 6000
    firsts, drafted, seconds = torch.zeros(VOCAB), torch.zeros(VOCAB), {}
    for _ in range(trials):
        a = int(torch.multinomial(q[0, 0, 0], 1, generator=gen))
        b = int(torch.multinomial(q[a, 0, 1], 1, generator=gen))
        draft_probs = torch.stack([q[0, 0, 0], q[a, 0, 1]]) if use_draft_probs else None
        if not use_draft_probs:  # a deterministic proposer: its guesses are fixed, q is a point mass
            a, b = 2, 7
        out = verify(target[a, b], [a, b], draft_probs, params, gen)
        firsts[out[0]] += 1
        drafted[a] += 1
        if len(out) >= 2:
            seconds.setdefault(out[0], torch.zeros(VOCAB))[out[1]] += 1
    support = p0 > 0  # top-k cut the rest: those tokens must never appear
    assert firsts[~support].sum() == 0
    assert chisquare(firsts[support], p0[support] * trials).pvalue > 1e-3
    if use_draft_probs:  # the draft alone is measurably different: a verifier that kept it would fail
        expected = p0[support] * drafted[support].sum()
        assert drafted[~support].sum() > 0 or chisquare(drafted[support], expected).pvalue < 1e-6
    # the token after an accepted first token follows the target given that token
    x, counts = max(seconds.items(), key=lambda kv: kv[1].sum())
    p1 = warped_probs(target[x, 0, 1:2], [params])[0]
    keep = p1 > 0
    assert counts[~keep].sum() == 0
    assert chisquare(counts[keep], p1[keep] * counts.sum()).pvalue > 1e-3


def test_greedy_verification_keeps_the_matching_prefix_and_adds_the_target_token(toy_logits):
    target, _ = toy_logits
    best = target.argmax(-1)  # [V, V, 3]
    a = int(best[0, 0, 0])
    b = int(best[a, 0, 1])
    assert verify(target[a, b], [a, b], None, SamplingParams(), None) == [a, b, int(best[a, b, 2])]
    wrong = (a + 1) % VOCAB
    assert verify(target[wrong, b], [wrong, b], None, SamplingParams(), None) == [a]
