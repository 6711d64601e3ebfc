"""Scheduler and Engine behaviour on a tiny model: preemption identity, chunked prefill, static vs continuous,
prefix caching, stop strings, aborts, bad input."""

from __future__ import annotations

import json

import pytest
from test_model_llama import build_sharp_tiny_llama

from qtoolkit.engine import Engine, EngineInputError, SamplingParams
from qtoolkit.engine.model_runner import kv_bytes_per_block

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef mul(a, b):", "The quick brown fox", "Summarize: rain fell.",
           "import numpy as np\nx = np.arange(10)\n", "Once upon a time, in a land far away, there lived",
           "Q: what is 2 + 2?\nA:", "class Stack:\n    def __init__(self):", "hello"]


@pytest.fixture(scope="module")
def sharp_dir(tmp_path_factory, tokenizer_dir):
    return build_sharp_tiny_llama(tmp_path_factory.mktemp("sharp-sched"), tokenizer_dir)


def make(sharp_dir, blocks: int = 512, block_size: int = 4, **kw) -> Engine:
    cfg = json.loads((sharp_dir / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    per_block = 2 * cfg["num_hidden_layers"] * block_size * cfg["num_key_value_heads"] * head_dim * 4  # fp32
    return Engine(str(sharp_dir), kv_cache_memory=blocks * per_block, block_size=block_size, **kw)


def mixed_params():
    # greedy and seeded sampled requests, different lengths
    return [SamplingParams(max_tokens=6 + 3 * (i % 4), ignore_eos=True, temperature=0.0 if i % 2 else 0.8,
                           top_p=0.9, seed=100 + i) for i in range(len(PROMPTS))]


def run(engine: Engine):
    return [(o.token_ids, o.text, o.finish_reason) for o in engine.generate(PROMPTS, mixed_params(),
                                                                            use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(sharp_dir):
    return run(make(sharp_dir))


def test_preemption_by_recompute_gives_identical_outputs(sharp_dir, reference):
    small = make(sharp_dir, blocks=24, max_num_batched_tokens=32)
    assert run(small) == reference
    stats = small.stats()
    assert stats.num_preemptions > 0
    assert stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0


def test_chunked_prefill_gives_identical_outputs(sharp_dir, reference):
    assert run(make(sharp_dir, max_num_batched_tokens=12)) == reference


def test_static_batching_same_outputs_and_waits_for_the_whole_batch(sharp_dir, reference):
    engine = make(sharp_dir, batching="static", max_num_seqs=3)
    assert run(engine) == reference
    engine.add_request("long", "a b c", SamplingParams(max_tokens=6, ignore_eos=True))
    engine.add_request("short", "a b c", SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()
    engine.add_request("late", "x y", SamplingParams(max_tokens=2, ignore_eos=True))
    seen_late_while_long_runs = False
    finished = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "late" and "long" not in finished:
                seen_late_while_long_runs = True
            if out.finished:
                finished.add(out.request_id)
    assert finished == {"long", "short", "late"} and not seen_late_while_long_runs


def test_continuous_batching_admits_new_requests_every_step(sharp_dir):
    engine = make(sharp_dir)
    engine.add_request("long", "a b c", SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    engine.step()
    engine.add_request("late", "x y", SamplingParams(max_tokens=2, ignore_eos=True))
    outs = engine.step()
    assert {o.request_id for o in outs} == {"long", "late"}
    assert engine.stats().num_running == 2


def test_prefix_cache_reuses_blocks_without_changing_output(sharp_dir):
    engine = make(sharp_dir)
    prompt = PROMPTS[0] * 3
    p = SamplingParams(max_tokens=6, ignore_eos=True)
    first = engine.generate([prompt], p, use_tqdm=False)[0]
    hits_before = engine.stats().prefix_cache_hit_tokens
    second = engine.generate([prompt], p, use_tqdm=False)[0]
    assert engine.stats().prefix_cache_hit_tokens - hits_before >= len(engine.tokenizer(prompt).input_ids) - 4
    assert second.token_ids == first.token_ids
    off = make(sharp_dir, enable_prefix_caching=False).generate([prompt], p, use_tqdm=False)[0]
    assert off.token_ids == first.token_ids


def test_stop_strings_eos_and_length(sharp_dir):
    engine = make(sharp_dir)
    full = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    assert full.finish_reason == "length" and full.num_output_tokens == 12
    assert full.text == engine.tokenizer.decode(full.token_ids, skip_special_tokens=True)
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 3]
    cut = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=12, stop=[stop], ignore_eos=True),
                          use_tqdm=False)[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.index(stop)]
    engine.eos_token_ids = {full.token_ids[3]}
    eos = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=12), use_tqdm=False)[0]
    assert eos.finish_reason == "stop" and eos.token_ids == full.token_ids[:full.token_ids.index(
        full.token_ids[3]) + 1]


def test_streamed_deltas_add_up(sharp_dir):
    engine = make(sharp_dir)
    engine.add_request("s", PROMPTS[4], SamplingParams(max_tokens=10, ignore_eos=True))
    text, ids, last = "", [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.new_text
            ids += out.new_token_ids
            last = out
    assert last.finished and text == last.text and ids == last.token_ids and last.num_prompt_tokens > 0


def test_abort_frees_blocks_and_reports(sharp_dir):
    engine = make(sharp_dir)
    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", PROMPTS[1], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    assert engine.stats().kv_blocks_used > 0
    engine.abort_request("a")
    reasons = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    assert reasons == {"a": "abort", "b": "length"}
    assert engine.stats().kv_blocks_used == 0


def test_bad_input_is_rejected(sharp_dir):
    engine = make(sharp_dir, blocks=8)  # 32-token context
    with pytest.raises(EngineInputError, match="context holds 32"):
        engine.add_request("long", list(range(40)), SamplingParams())
    with pytest.raises(EngineInputError, match="max_tokens"):
        engine.add_request("zero", "hi", SamplingParams(max_tokens=0))
    with pytest.raises(EngineInputError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(EngineInputError):
        engine.add_request("vocab", [10**9], SamplingParams())
    engine.add_request("dup", "hi", SamplingParams(max_tokens=1))
    with pytest.raises(EngineInputError, match="already"):
        engine.add_request("dup", "hi", SamplingParams(max_tokens=1))
    # output is capped by the context: finishes with "length" rather than overflowing
    out = engine.generate([list(range(30))], SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False)
    assert out[0].finish_reason == "length" and out[0].num_output_tokens == 2
    assert kv_bytes_per_block(engine.model, 4) * 8 == engine.block_manager.num_blocks * kv_bytes_per_block(
        engine.model, 4)
