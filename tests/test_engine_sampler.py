"""Sampler: greedy, top-k / top-p filtering, seeded reproducibility regardless of batch composition."""

from __future__ import annotations

import pytest
import torch

from qtoolkit.engine.params import EngineInputError, SamplingParams
from qtoolkit.engine.sampler import apply_top_k_top_p, sample


def gen(seed):
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax():
    logits = torch.randn(4, 50, generator=gen(0))
    assert sample(logits, [SamplingParams()] * 4, [None] * 4) == logits.argmax(-1).tolist()


def test_top_k_and_top_p_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    out = apply_top_k_top_p(logits, torch.tensor([2, 0]), torch.tensor([1.0, 0.7]))
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]  # top-2
    assert torch.isfinite(out[1]).tolist() == [True, True, False, False]  # 0.5 < 0.7, 0.5 + 0.3 reaches it
    tiny_p = apply_top_k_top_p(logits[:1], torch.tensor([0]), torch.tensor([0.01]))
    assert torch.isfinite(tiny_p).sum() == 1  # the top token always survives


def test_seeded_sampling_ignores_batch_composition():
    logits = torch.randn(6, 200, generator=gen(1))
    p = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=7)
    alone = [sample(logits[2:3], [p], [gen(7)])[0] for _ in range(1)]
    g = gen(7)
    others = [SamplingParams(temperature=1.3, seed=i) for i in range(6)]
    mixed = sample(logits, others[:2] + [p] + others[3:], [gen(i) for i in range(2)] + [g] +
                   [gen(i) for i in range(3, 6)])
    assert mixed[2] == alone[0]
    # a stream of draws from one seed is the same whatever else runs
    g1, g2 = gen(7), gen(7)
    s1 = [sample(logits[2:3], [p], [g1])[0] for _ in range(20)]
    s2 = [sample(logits, [SamplingParams()] * 2 + [p] + [SamplingParams()] * 3,
                 [None, None, g2, None, None, None])[2] for _ in range(20)]
    assert s1 == s2 and len(set(s1)) > 1


def test_temperature_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    g = gen(3)
    draws = [sample(logits, [SamplingParams(temperature=1.0)], [g])[0] for _ in range(2000)]
    freq = torch.bincount(torch.tensor(draws), minlength=3).float() / len(draws)
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.04)


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(max_tokens=-3), dict(temperature=-1.0),
                                 dict(top_p=0.0), dict(top_k=-1), dict(stop=[""])])
def test_bad_sampling_params_are_rejected(bad):
    with pytest.raises(EngineInputError):
        SamplingParams(**bad).validate()
