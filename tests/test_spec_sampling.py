"""Rejection sampling is lossless: with a toy 16-token LlamaModel as target and another as draft (or a random
EAGLE-3 head over 12 of the 16 tokens, drafting through its proposer), the tokens speculative verification emits
follow the target's distribution (chi-square), while the draft's own tokens do not (so the test can tell a broken
verifier apart)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from torch import nn

from qtoolkit.draft.head import Eagle3Config, Eagle3Head
from qtoolkit.engine.model_runner import Chunk, ModelRunner
from qtoolkit.engine.params import SamplingParams
from qtoolkit.engine.sampler import warped_probs
from qtoolkit.engine.sequence import Sequence
from qtoolkit.engine.speculative.eagle3 import Eagle3Proposer
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


def eagle3_drafter(params: SamplingParams):
    """Two-token drafts of a random EAGLE-3 head on toy_model(0), through the proposer: the target's features of
    CONTEXT come from a capturing forward, as in the engine; each proposal starts from them again."""
    target = toy_model(0)
    torch.manual_seed(5)
    head = Eagle3Head(Eagle3Config.from_target(target.config, draft_vocab_size=12))
    with torch.no_grad():
        for w in head.parameters():
            w.normal_(0, 0.5)
    head.set_vocab(torch.randperm(VOCAB)[:12])
    proposer = Eagle3Proposer(head.eval(), target, "eagle3:toy")
    seq = Sequence("e", CONTEXT, SamplingParams(temperature=params.temperature, top_k=params.top_k, seed=99))
    ran = ModelRunner(target, num_blocks=2, block_size=4).step([Chunk(CONTEXT[:-1], 0, [0, 1])], proposer.aux_layers)
    proposer.observe([(seq.request_id, 0, ran.aux[0])])

    def draw(gen: torch.Generator) -> tuple[int, int, torch.Tensor | None]:
        proposal = proposer.propose([(seq, 2)])[0]
        return *proposal.tokens, proposal.draft_probs
    return draw


@pytest.mark.parametrize("drafter,top_k", [("draft-model", 12), ("point-mass", 0), ("eagle3", 12)],
                         ids=["draft-model", "point-mass", "eagle3"])
def test_rejection_sampling_emits_the_target_distribution(toy_logits, drafter, top_k):
    target, draft = toy_logits
    params = SamplingParams(temperature=0.8, top_k=top_k)
    p0 = warped_probs(target[0, 0, :1], [params])[0]
    q = warped_probs(draft.reshape(-1, VOCAB), [params] * VOCAB * VOCAB * 3).view(VOCAB, VOCAB, 3, VOCAB)

    def draft_model(gen: torch.Generator) -> tuple[int, int, torch.Tensor | None]:
        a = int(torch.multinomial(q[0, 0, 0], 1, generator=gen))
        b = int(torch.multinomial(q[a, 0, 1], 1, generator=gen))
        return a, b, torch.stack([q[0, 0, 0], q[a, 0, 1]])

    def point_mass(gen: torch.Generator) -> tuple[int, int, torch.Tensor | None]:
        draft_model(gen)  # the same draws of randomness as before; a deterministic proposer's guesses are fixed
        return 2, 7, None

    draw = {"draft-model": draft_model, "point-mass": point_mass}.get(drafter) or eagle3_drafter(params)
    gen = torch.Generator().manual_seed(1234)
    trials = 3000 if drafter == "eagle3" else 6000  # a proposal through the head costs ~3 ms here
    firsts, drafted, seconds = torch.zeros(VOCAB), torch.zeros(VOCAB), {}
    for _ in range(trials):
        a, b, draft_probs = draw(gen)
        out = verify(target[a, b], [a, b], draft_probs, params, gen)
        firsts[out[0]] += 1
        drafted[a] += 1
        if len(out) >= 2:
            seconds.setdefault(out[0], torch.zeros(VOCAB))[out[1]] += 1
    support = p0 > 0  # top-k cut the rest: those tokens must never appear
    assert firsts[~support].sum() == 0
    assert chisquare(firsts[support], p0[support] * trials).pvalue > 1e-3
    if drafter != "point-mass":  # the draft alone is measurably different: a verifier that kept it would fail
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
