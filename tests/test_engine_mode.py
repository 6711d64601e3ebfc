"""Engine.set_mode: batching and speculation switch inside one loaded engine, only while it is idle, and the
switch changes what the engine does (static admission, proposals); kv_cache_tokens sizes the KV cache."""

from __future__ import annotations

import pytest

from qtoolkit.engine import Engine, EngineConfig, SamplingParams
from qtoolkit.engine.engine import EngineBusyError
from qtoolkit.engine.params import EngineInputError


@pytest.fixture(scope="module")
def spec_engine(tiny_model_dir):
    return Engine(str(tiny_model_dir), EngineConfig(kv_cache_memory="16MiB", speculative="ngram"))


def running_ids(engine: Engine) -> set[str]:
    return {s.request_id for s in engine.scheduler.running}


def test_static_batching_switched_on_holds_new_requests_until_the_batch_ends(tiny_model_dir):
    engine = Engine(str(tiny_model_dir), EngineConfig(kv_cache_memory="16MiB"))
    assert engine.mode.batching == "continuous" and engine.stats().batching == "continuous"
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)

    def late_joiner_waits() -> bool:
        engine.add_request("a", [1, 2, 3], params)
        engine.step()
        engine.add_request("b", [4, 5, 6], params)
        engine.step()
        waited = "b" not in running_ids(engine)
        while engine.has_unfinished_requests():
            engine.step()
        return waited

    assert not late_joiner_waits()  # continuous: b joins the running batch at once
    assert engine.set_mode(batching="static").batching == "static"
    assert engine.stats().batching == "static"
    assert late_joiner_waits()  # static: b waits for a's batch to finish
    assert engine.set_mode(batching="continuous").batching == "continuous"
    assert not late_joiner_waits()


def test_mode_switch_is_refused_while_requests_run(tiny_model_dir):
    engine = Engine(str(tiny_model_dir), EngineConfig(kv_cache_memory="16MiB"))
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    with pytest.raises(EngineBusyError, match="in flight"):  # queued, not yet stepped: busy all the same
        engine.set_mode(batching="static")
    engine.step()
    with pytest.raises(EngineBusyError):
        engine.set_mode(batching="static")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.set_mode(batching="static").batching == "static"
    with pytest.raises(EngineInputError, match="unknown"):
        engine.set_mode(batching="dynamic")
    with pytest.raises(EngineInputError, match="no proposer"):
        engine.set_mode(speculative=True)


def test_speculation_switches_off_and_on_in_the_loaded_engine(spec_engine):
    prompt = [5, 6, 7, 8] * 12  # repetitive: the n-gram proposer always finds a continuation
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0)
    assert spec_engine.mode.to_json() == {"batching": "continuous", "speculating": True, "proposer": "ngram"}
    on = spec_engine.generate([prompt], params, use_tqdm=False)[0]
    drafted = spec_engine.stats().speculative.draft_tokens
    assert drafted > 0 and on.speculative.draft_tokens > 0

    mode = spec_engine.set_mode(speculative=False)
    assert (mode.speculating, mode.proposer) == (False, "ngram")
    off = spec_engine.generate([prompt], params, use_tqdm=False)[0]
    assert spec_engine.stats().speculative is None  # as a plain engine reports
    assert off.speculative.draft_tokens == 0
    assert off.token_ids == on.token_ids  # greedy: speculation never changes the output

    spec_engine.set_mode(speculative=True)
    spec_engine.generate([prompt], params, use_tqdm=False)
    # the same proposer with its counters kept (whether this run drafts more depends on the adaptive policy's
    # timing of the step: under CPU load speculation stops paying and the policy drafts nothing)
    assert spec_engine.mode.speculating and spec_engine.stats().speculative.draft_tokens >= drafted


def test_mode_switch_empties_the_prefix_cache(tiny_model_dir):
    engine = Engine(str(tiny_model_dir), EngineConfig(kv_cache_memory="16MiB", block_size=4))
    prompt = list(range(10, 30))
    params = SamplingParams(max_tokens=2, temperature=0.0)
    engine.generate([prompt], params, use_tqdm=False)
    engine.generate([prompt], params, use_tqdm=False)
    hits = engine.stats().prefix_cache_hit_tokens
    assert hits > 0
    engine.set_mode(batching="continuous")  # the same mode: the cache is emptied all the same
    engine.generate([prompt], params, use_tqdm=False)
    assert engine.stats().prefix_cache_hit_tokens == hits  # a fresh server's cache: nothing reused


def test_kv_cache_tokens_sizes_the_cache_in_tokens(tiny_model_dir):
    engine = Engine(str(tiny_model_dir), EngineConfig(kv_cache_tokens=100, block_size=16))
    assert engine.stats().kv_capacity_tokens == 112  # rounded up to whole blocks
    assert EngineConfig(kv_cache_tokens=100).kv_budget == "100 tokens"
    with pytest.raises(EngineInputError, match="kv_cache_tokens"):
        EngineConfig(kv_cache_tokens=0)
    assert "--kv-cache-tokens" in EngineConfig(kv_cache_tokens=64).to_cli_args()
