"""Slow: speculative decoding on the real default model is token-identical to plain greedy decoding, for every
proposer, at batch 1 and in a mixed batch, and the quantized self-draft is actually accepted."""

from __future__ import annotations

import pytest

from qtoolkit.engine import Engine, SamplingParams

PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "Summarize in one sentence: The city council voted on Tuesday to expand the bike lane network. "
           "The council said the bike lane network would be expanded by 40 km over two years.\nSummary:",
           "import os\nimport sys\n\n\ndef main():\n", "The capital of France is"]


@pytest.mark.slow
def test_real_model_greedy_identity_every_proposer(default_source):
    params = [SamplingParams(max_tokens=24 + 8 * (i % 2)) for i in range(len(PROMPTS))]
    plain = Engine(default_source, kv_cache_memory="256MiB")
    reference = [o.token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    del plain
    for spec in ("ngram", "self-int4", "self-fp8"):
        engine = Engine(default_source, kv_cache_memory="256MiB", speculative=spec, max_verify_tokens=64)
        engine.spec_policy.adaptive = False  # every step speculates: the identity check covers them all
        single = engine.generate(PROMPTS[:1], params[:1], use_tqdm=False)[0].token_ids
        assert single == reference[0], spec
        assert [o.token_ids for o in engine.generate(PROMPTS, params, use_tqdm=False)] == reference, spec
        stats = engine.stats().speculative
        if spec != "ngram":  # the same model rounded to INT4 g32 / FP8 agrees with itself often (0.42-0.8 seen)
            assert stats.acceptance_rate > 0.3 and stats.acceptance_by_position[0] > 0.5, (spec, stats)
