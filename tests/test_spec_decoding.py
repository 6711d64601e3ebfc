"""Speculative decoding in the engine (tiny models): greedy output token-identical to plain decoding for every
proposer, alone and in mixed batches with preemption; stop strings and max_tokens inside accepted runs;
rollback of rejected KV slots; start-up errors."""

from __future__ import annotations

import json

import pytest
import torch
from test_model_llama import build_sharp_tiny_llama
from transformers import LlamaConfig, LlamaForCausalLM

from qtoolkit.engine import Engine, SamplingParams
from qtoolkit.engine.sequence import Sequence
from qtoolkit.engine.speculative import SpeculationPolicy, SpeculativeConfigError
from qtoolkit.engine.speculative.ngram import NgramProposer
from qtoolkit.engine.speculative.policy import PLAIN_REFRESH_STEPS
from qtoolkit.engine.speculative.shared_kv import SharedKVDraftProposer

# repetitive prompts give prompt lookup something to find; the tiny random model also loops on its own
PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return", "one two three one two three one two",
           "The quick brown fox", "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2,", "hello hello hello",
           "Summarize: the rain fell on the plain. The rain fell", "class Stack:\n    def __init__(self):", "a b"]


@pytest.fixture(scope="module")
def sharp_dir(tmp_path_factory, tokenizer_dir):
    return build_sharp_tiny_llama(tmp_path_factory.mktemp("sharp-spec"), tokenizer_dir)


def make(model_dir, blocks: int = 512, block_size: int = 4, adaptive: bool = False, **kw) -> Engine:
    """adaptive=False pins k: the cost model would (rightly) switch off a draft as costly as its target."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    per_block = 2 * cfg["num_hidden_layers"] * block_size * cfg["num_key_value_heads"] * head_dim * 4  # fp32
    engine = Engine(str(model_dir), kv_cache_memory=blocks * per_block, block_size=block_size, **kw)
    if engine.spec_policy is not None:
        engine.spec_policy.adaptive = adaptive
    return engine


def greedy_params(n: int = len(PROMPTS)) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=10 + 5 * (i % 3), ignore_eos=True) for i in range(n)]


def run(engine: Engine, prompts=PROMPTS, params=None):
    outs = engine.generate(prompts, params or greedy_params(len(prompts)), use_tqdm=False)
    return [(o.token_ids, o.text, o.finish_reason) for o in outs]


@pytest.fixture(scope="module")
def reference(sharp_dir):
    return run(make(sharp_dir))


def test_greedy_identity_every_proposer_batch_1_and_mixed_batch(sharp_dir, reference):
    # self-int4 on this random model is mostly rejected, the target drafting for itself always accepted:
    # both ends of the verification path run
    for spec in ["ngram", "self-int4", "self-fp8", "self-skip", "self-skip:1", f"draft:{sharp_dir}",
                 f"self:{sharp_dir}"]:
        engine = make(sharp_dir, speculative=spec, num_speculative_tokens=4, max_verify_tokens=64)
        assert run(engine, PROMPTS[1:2], greedy_params()[1:2]) == reference[1:2], spec
        assert run(engine) == reference, spec
        stats = engine.stats()
        spec_stats = stats.speculative
        assert spec_stats.draft_tokens > 0, spec
        assert stats.kv_blocks_used == 0, spec  # every block, rejected slots included, came back
        if spec.endswith(f":{sharp_dir}"):  # the target drafting for itself: everything is accepted
            assert spec_stats.acceptance_rate == 1.0
            assert spec_stats.mean_accepted_length > 3


def test_greedy_identity_with_preemption_and_chunked_prefill(sharp_dir, reference):
    for spec in ("ngram", f"draft:{sharp_dir}", f"self:{sharp_dir}"):
        engine = make(sharp_dir, blocks=24, max_num_batched_tokens=32, speculative=spec, max_verify_tokens=64)
        assert run(engine) == reference, spec
        stats = engine.stats()
        assert stats.num_preemptions > 0 and stats.speculative.draft_tokens > 0, spec
        if not spec.startswith("ngram"):
            assert stats.speculative.accepted_tokens > 0
        assert stats.kv_blocks_used == 0


def test_stop_strings_and_max_tokens_inside_an_accepted_run(sharp_dir, reference):
    # stops taken from the middle of the plain output: the accepted run must be cut exactly there
    stops = [[text[len(text) // 2:len(text) // 2 + 3]] if len(text) > 8 else [] for _, text, _ in reference]
    params = [SamplingParams(max_tokens=p.max_tokens, ignore_eos=True, stop=s)
              for p, s in zip(greedy_params(), stops, strict=True)]
    plain = run(make(sharp_dir), params=params)
    spec = make(sharp_dir, speculative=f"draft:{sharp_dir}", num_speculative_tokens=8, max_verify_tokens=64)
    assert run(spec, params=params) == plain
    assert sum(r == "stop" for _, _, r in plain) >= 3
    # max_tokens smaller than k: the draft is capped, the output has exactly max_tokens tokens
    out = spec.generate(PROMPTS[:2], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert [len(o.token_ids) for o in out] == [3, 3]
    assert [o.token_ids for o in out] == [r[0][:3] for r in reference[:2]]


def test_per_request_counters_and_policy_turns_speculation_off_for_big_batches(sharp_dir, reference):
    engine = make(sharp_dir, speculative=f"draft:{sharp_dir}", num_speculative_tokens=4, adaptive=True)
    outs = engine.generate(PROMPTS[:1], greedy_params(1), use_tqdm=False)
    usage = outs[0].speculative
    assert usage.draft_tokens > 0 and usage.acceptance_rate == 1.0
    before = engine.stats().speculative.draft_tokens
    # 8 sequences decoding at once fill the verification budget: no proposals, plain decoding
    big = run(engine, PROMPTS, [SamplingParams(max_tokens=6, ignore_eos=True)] * len(PROMPTS))
    assert [t for t, _, _ in big] == [t[:6] for t, _, _ in reference]
    assert engine.stats().speculative.steps_without_speculation > 0
    assert engine.stats().speculative.draft_tokens - before < 6 * len(PROMPTS)


def test_policy_picks_k_from_acceptance_and_draft_cost():
    policy = SpeculationPolicy(8)
    policy.verify_cost = 0.0
    assert policy.best_k(0.9)[0] == 8  # free drafts, free verification: looking further never costs
    policy.draft_cost = 0.1  # a cheap draft model: poor acceptance makes long lookahead a waste
    assert policy.best_k(0.3)[0] < policy.best_k(0.9)[0]
    assert policy.best_k(0.9)[1] > policy.best_k(0.3)[1] > 1
    for _ in range(30):  # a draft step costing as much as verification: never worth it
        policy.observe_cost(proposer_seconds=0.1, draft_steps=1, verify_seconds=0.1)
    assert abs(policy.draft_cost - 1.0) < 0.01 and policy.best_k(0.9)[1] < 1.0
    warm = SpeculationPolicy(4)  # one slow first draft step (one-time costs) does not switch a cheap draft off
    for r in (3.0, 0.3, 0.3):
        warm.observe_cost(proposer_seconds=r, draft_steps=1, verify_seconds=1.0)
    assert warm.draft_cost == 0.3 and warm.best_k(0.9)[1] > 1.05
    seq = policy.state("s")  # the policy's state for request "s"
    assert policy.plan([("s", 8)], step_tokens=1) == [0]  # first a plain step at this batch size, to time it
    assert seq.cooldown == 0
    policy.observe_plain(1, 0.1)
    assert policy.plan([("s", 8)], step_tokens=1) == [0]  # switched off ...
    assert seq.cooldown > 0
    for _ in range(seq.cooldown - 1):
        policy.plan([("s", 8)], step_tokens=1)
    assert policy.plan([("s", 8)], step_tokens=1) == [1]  # ... then probed again with one token
    assert policy.plan([("s", 8)], step_tokens=1) == [0]  # the probe did not change the costs:
    assert seq.cooldown == 2 * policy.cooldown_steps  # the next wait is twice as long
    policy.forget("s")
    assert "s" not in policy.requests
    busy = SpeculationPolicy(4)  # a compute-bound CPU: 5 tokens cost 3.5x a 1-token step
    busy.observe_plain(1, 0.1)
    for _ in range(30):
        busy.observe_cost(proposer_seconds=0.0, draft_steps=4, verify_seconds=0.35, num_seqs=1, extra_tokens=4)
    assert abs(busy.verify_cost - 0.625) < 0.01
    busy.observe_cost(proposer_seconds=0.0, draft_steps=1, verify_seconds=5.0, num_seqs=1, extra_tokens=1)
    assert busy.verify_cost < 0.9  # one descheduled step moves the estimate by a bounded amount
    assert busy.best_k(0.3)[1] < 1.0 < busy.best_k(0.95)[1]  # only near-certain drafts still pay
    cheap = SpeculationPolicy(4)
    seqs = [f"b{i}" for i in range(3)]
    cheap.observe_plain(3, 0.1)
    assert cheap.plan([(s, 4) for s in seqs], step_tokens=3) == [2, 2, 1]  # 5 spare tokens shared
    assert cheap.plan([(s, 4) for s in seqs], step_tokens=8) == [0, 0, 0]  # batch past the budget: off
    cheap.update(seqs[0], proposed=4, accepted=1)
    assert cheap.state(seqs[0]).acceptance < 0.8


def test_verification_cost_is_learnt_per_batch_size():
    policy = SpeculationPolicy(4)
    policy.observe_plain(1, 0.030)
    policy.observe_plain(4, 0.032)
    for _ in range(40):  # this CPU: 1 x 2 tokens cost 1.1x a plain step of 1, 4 x 2 tokens 1.4x a plain step of 4
        policy.observe_cost(0.39 * 0.033, 1, 0.033, num_seqs=1, extra_tokens=1)
        policy.observe_cost(0.39 * 0.045, 1, 0.045, num_seqs=4, extra_tokens=4)
    assert policy.verify_cost_at(1) == pytest.approx(0.1, abs=0.01)
    assert policy.verify_cost_at(4) == pytest.approx(0.406, abs=0.01)
    assert policy.verify_cost_at(8) == policy.verify_cost_at(4) and policy.verify_cost_at(2) == policy.verify_cost_at(1)
    # the same draft (r = 0.39, acceptance 0.9) pays for one sequence and not for four
    assert policy.best_k(0.9, 1)[1] > policy.min_gain > policy.best_k(0.9, 4)[1]
    one, four = "one", [f"f{i}" for i in range(4)]
    for s in [one, *four]:
        policy.state(s).acceptance = 0.9
    assert policy.plan([(one, 4)], step_tokens=1)[0] > 0
    assert policy.plan([(s, 4) for s in four], step_tokens=4) == [0, 0, 0, 0]
    # a batch size never timed plain gets a plain step first; later, one in PLAIN_REFRESH_STEPS refreshes it
    three = four[:3]
    for s in three:
        policy.state(s).cooldown = 0
    assert policy.plan([(s, 4) for s in three], step_tokens=3) == [0, 0, 0]
    policy.observe_plain(3, 0.031)
    plans = [policy.plan([(one, 4)], step_tokens=1) for _ in range(2 * PLAIN_REFRESH_STEPS)]
    assert sum(p == [0] for p in plans) == 2 and all(p[0] > 0 for p in plans[:PLAIN_REFRESH_STEPS - 2])


def test_sampled_requests_with_speculation_are_seeded_and_complete(sharp_dir):
    engine = make(sharp_dir, speculative=f"draft:{sharp_dir}", max_verify_tokens=64)
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7 + i, ignore_eos=True)
              for i in range(4)]
    first = run(engine, PROMPTS[:4], params)
    assert run(engine, PROMPTS[:4], params) == first
    assert all(len(t) == 12 for t, _, _ in first)
    assert engine.stats().speculative.acceptance_rate > 0.5  # p == q: rejection is rare


def test_bad_speculative_settings_fail_at_start_up(sharp_dir, tmp_path):
    for kwargs, words in [({"speculative": "medusa"}, "unknown"),
                          ({"speculative": "ngram", "num_speculative_tokens": 0}, "1 to 16"),
                          ({"speculative": "ngram", "num_speculative_tokens": 17}, "1 to 16"),
                          ({"speculative": f"draft:{tmp_path / 'missing'}"}, "missing")]:
        with pytest.raises(SpeculativeConfigError, match=words):
            make(sharp_dir, **kwargs)


def test_draft_with_a_different_vocabulary_is_refused(sharp_dir, tmp_path):
    cfg = LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "small-vocab", safe_serialization=True)
    with pytest.raises(SpeculativeConfigError, match="vocabulary of 1000 tokens"):
        make(sharp_dir, speculative=f"draft:{tmp_path / 'small-vocab'}")


def test_model_draft_skips_long_context_before_a_short_answer(sharp_dir, reference):
    """A draft model would first have to prefill the whole prompt: for a long prompt and few tokens left that
    costs more than drafting can save, so the engine decodes plainly (prompt lookup has no such cost)."""
    long_prompt = " ".join(["the rain fell on the plain"] * 40)  # > 128 tokens
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    draft = make(sharp_dir, speculative=f"draft:{sharp_dir}", num_speculative_tokens=4)
    out = draft.generate([long_prompt], params, use_tqdm=False)[0]
    assert out.speculative.draft_tokens == 0 and len(out.token_ids) == 8
    assert draft.generate(["def add(a, b):"], params, use_tqdm=False)[0].speculative.draft_tokens > 0  # short: drafts
    assert NgramProposer().catch_up_tokens(Sequence("s", list(range(500)), params)) == 0


def test_self_draft_reads_the_target_cache_and_drafts_from_the_first_step(sharp_dir, reference):
    """A self-draft shares the target's KV cache: no cache of its own, nothing to catch up on, so it drafts for a
    long prompt too. Its K/V writes land in the slots verification overwrites: outputs stay the target's, and a
    sampled run with the target as its own draft (p == q) rejects almost nothing."""
    engine = make(sharp_dir, speculative=f"self:{sharp_dir}", num_speculative_tokens=4, max_verify_tokens=64)
    proposer = engine.proposer
    assert isinstance(proposer, SharedKVDraftProposer) and proposer.runner.kv_cache is engine.runner.kv_cache
    long_prompt = " ".join(["the rain fell on the plain"] * 40)  # > 128 tokens: a draft:PATH model skips it
    out = engine.generate([long_prompt], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert out.speculative.draft_tokens > 0 and out.speculative.accepted_tokens == out.speculative.draft_tokens
    assert engine.stats().kv_blocks_used == 0
    for spec in ("self-int4", "self-fp8"):
        assert isinstance(make(sharp_dir, speculative=spec).proposer, SharedKVDraftProposer), spec
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7 + i, ignore_eos=True)
              for i in range(4)]
    first = run(engine, PROMPTS[:4], params)
    assert run(engine, PROMPTS[:4], params) == first
    assert engine.stats().speculative.acceptance_rate > 0.9


@pytest.fixture(scope="module")
def int4_dir(sharp_dir, tmp_path_factory):
    from qtoolkit.cli import main

    out = tmp_path_factory.mktemp("sharp-int4") / "int4"
    assert main(["quantize", "--model", str(sharp_dir), "--recipe", "int4-rtn-asym", "--output", str(out)]) == 0
    return out


def test_layer_skip_drafts_any_target_quantized_included_with_greedy_identity(sharp_dir, int4_dir):
    """self-skip keeps some of the target's own layers (the same modules: nothing copied) and reads their slices
    of the target's cache; an INT4 checkpoint, which cannot be self-int4-drafted, drafts this way with its
    outputs unchanged."""
    from qtoolkit.engine.speculative.layer_skip import LayerSkipProposer, kept_layers

    int4_reference = run(make(int4_dir))
    with pytest.raises(SpeculativeConfigError, match="self-skip"):
        make(int4_dir, speculative="self-int4")
    for target, reference_out in ((sharp_dir, None), (int4_dir, int4_reference)):
        engine = make(target, speculative="self-skip:1", num_speculative_tokens=3, max_verify_tokens=64)
        proposer = engine.proposer
        assert isinstance(proposer, LayerSkipProposer)
        draft = proposer.drafts[1]
        assert draft.runner.kv_cache is engine.runner.kv_cache
        assert draft.model.layers[0] is engine.model.layers[0] and draft.model.lm_head is engine.model.lm_head
        out = run(engine)
        assert out == (reference_out or run(make(target))), target
        assert engine.stats().speculative.draft_tokens > 0 and engine.stats().kv_blocks_used == 0
    assert kept_layers(30, 20) == [*range(10), *range(20, 30)] and kept_layers(5, 3) == [0, 1, 4]


def test_layer_skip_depth_is_checked_and_parsed_once():
    from qtoolkit.engine.speculative_spec import SpeculativeSpec

    assert SpeculativeSpec.parse("self-skip:12").skip_layers == 12 and SpeculativeSpec.parse("self-skip").skip_layers \
        is None
    assert SpeculativeSpec.parse("self-skip:3").shares_target_kv
    for bad in ("self-skip:0", "self-skip:x", "self-skip:-2"):
        with pytest.raises(SpeculativeConfigError, match="positive whole number") as e:
            SpeculativeSpec.parse(bad)
        assert len(str(e.value).splitlines()) == 1


def test_layer_skip_depth_out_of_range_fails_at_start_up(sharp_dir):
    with pytest.raises(SpeculativeConfigError, match="keeps 1 to 1 of them"):
        make(sharp_dir, speculative="self-skip:2")


def test_depth_chooser_explores_then_keeps_the_depth_that_pays():
    from qtoolkit.engine.speculative.policy import DepthChooser

    policy = SpeculationPolicy(4)
    chooser = DepthChooser([10, 20], policy)
    # the shallow depth is cheap but rarely right, the deep one dearer and mostly right
    truth = {10: (0.05, 0.2), 20: (0.85, 0.4)}  # acceptance, draft step / verification
    for _ in range(2 * DepthChooser.EXPLORE_STEPS):
        depth = chooser.pick()
        acc, cost = truth[depth]
        chooser.record(depth, 4, 4 if acc > 0.5 else 0)
        chooser.observe(depth, cost, 1.0)
    assert chooser.best == 20 and chooser.gain(20) > 1 > chooser.gain(10)
    picks = [chooser.pick() for _ in range(DepthChooser.REPROBE_STEPS)]
    assert picks.count(20) == len(picks) - 1 and picks.count(10) == 1  # one re-probe of the other depth
