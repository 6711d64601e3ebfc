"""Slow: greedy output of the engine is token-identical to transformers `generate` (fp32, default model) on code
and summarization prompts, at batch 1 and inside a continuous batch of 32 mixed requests, with and without
preemption."""

from __future__ import annotations

import pytest
import torch
from qtoolkit.evals.data import aclsum_items, humaneval_problems
from transformers import AutoModelForCausalLM, AutoTokenizer

from qtoolkit.engine import Engine, SamplingParams

pytestmark = pytest.mark.slow

NUM_DISTINCT = 16  # 8 code + 8 summarization prompts; each runs twice in the batch of 32 (two lengths)


@pytest.fixture(scope="module")
def prompts(default_source):
    tok = AutoTokenizer.from_pretrained(default_source.path)
    code = [p["prompt"] for p in humaneval_problems()[:NUM_DISTINCT // 2]]
    summ = [tok.apply_chat_template([{"role": "user", "content": "Summarize the outcome of this abstract in one "
                                      f"sentence.\n\n{d['abstract']}"}], tokenize=False, add_generation_prompt=True)
            for d in aclsum_items()[:NUM_DISTINCT // 2]]
    return code + summ


@pytest.fixture(scope="module")
def hf_reference(default_source, prompts):
    """transformers greedy continuation of each prompt, unbatched (padding would change its numerics)."""
    tok = AutoTokenizer.from_pretrained(default_source.path)
    model = AutoModelForCausalLM.from_pretrained(default_source.path, dtype=torch.float32).eval()
    refs = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=40, do_sample=False)
        refs.append(out[0, ids.shape[1]:].tolist())
    return refs


def check(outs, refs, lengths):
    for i, (out, ref, n) in enumerate(zip(outs, refs, lengths, strict=True)):
        want = ref[:n]
        assert out.token_ids == want, f"request {i}: engine diverged from transformers at token " \
            f"{next((j for j, (a, b) in enumerate(zip(out.token_ids, want, strict=False)) if a != b), len(want))}"


def test_batch1_matches_transformers(default_source, prompts, hf_reference):
    engine = Engine(default_source, dtype="float32", kv_cache_memory="256MiB")
    for i in (0, 1, NUM_DISTINCT // 2, NUM_DISTINCT // 2 + 1):
        out = engine.generate([prompts[i]], SamplingParams(max_tokens=40), use_tqdm=False)
        check(out, [hf_reference[i]], [40])


@pytest.mark.parametrize("kv_cache_memory", ["512MiB", "24MiB"], ids=["no-preemption", "preemption"])
def test_batch_of_32_mixed_matches_transformers(default_source, prompts, hf_reference, kv_cache_memory):
    engine = Engine(default_source, dtype="float32", kv_cache_memory=kv_cache_memory, max_num_seqs=32,
                    max_num_batched_tokens=512)
    lengths = [40 if i % 2 == 0 else 17 + i // 2 for i in range(2 * NUM_DISTINCT)]  # <= 40 (the reference)
    batch = [prompts[i % NUM_DISTINCT] for i in range(2 * NUM_DISTINCT)]
    outs = engine.generate(batch, [SamplingParams(max_tokens=n) for n in lengths], use_tqdm=False)
    check(outs, [hf_reference[i % NUM_DISTINCT] for i in range(2 * NUM_DISTINCT)], lengths)
    stats = engine.stats()
    if kv_cache_memory == "24MiB":
        assert stats.num_preemptions > 0
    else:
        assert stats.num_preemptions == 0
    assert stats.kv_blocks_used == 0
