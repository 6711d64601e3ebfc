"""The engine's own LLaMA code against transformers, through the paged KV cache (prefill, chunks, decode)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import build_tiny_llama


def build_sharp_tiny_llama(folder: Path, tokenizer_dir: Path, scale: float = 10.0, **kw) -> Path:
    """A tiny random LLaMA whose logits are far from uniform, so greedy argmax has no near-ties."""
    from transformers import LlamaForCausalLM

    build_tiny_llama(folder, tokenizer_dir, **kw)
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(scale)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def sharp_dir(tmp_path_factory, tokenizer_dir):
    return build_sharp_tiny_llama(tmp_path_factory.mktemp("sharp-llama"), tokenizer_dir)


@pytest.fixture(scope="module")
def hf_model(sharp_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(sharp_dir, dtype=torch.float32).eval()


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def test_score_matches_transformers_with_chunks_and_packing(sharp_dir, hf_model):
    from qtoolkit.engine import Engine

    # a 24-token step budget forces long sequences into chunks and packs short ones together
    engine = Engine(str(sharp_dir), kv_cache_memory="2MiB", block_size=4, max_num_batched_tokens=24)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (5, 57, 1, 13, 30)]
    got = engine.score(seqs)
    for ids, lp in zip(seqs, got, strict=True):
        ref = hf_logprobs(hf_model, ids)
        assert lp.shape == ref.shape and lp.dtype == torch.float32
        torch.testing.assert_close(lp, ref, atol=2e-4, rtol=1e-4)
    assert engine.stats().kv_blocks_used == 0  # score leaves no KV behind


def test_paged_decode_matches_dense_reference(sharp_dir, hf_model):
    """Greedy decode through scattered blocks equals transformers' dense-cache greedy generate."""
    from qtoolkit.engine import Engine, SamplingParams

    engine = Engine(str(sharp_dir), kv_cache_memory="2MiB", block_size=4, max_num_batched_tokens=16)
    # fragment the free list so sequences get non-contiguous blocks
    engine.block_manager.free = type(engine.block_manager.free)(
        (i, None) for i in sorted(engine.block_manager.free, key=lambda b: (b % 3, -b)))
    prompts = ["def add(a, b):\n    return", "Summarize: the cat sat on the mat because it was warm.",
               "Hello"]
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        ids = engine.tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            ref = hf_model.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, ids.shape[1]:]
        assert out.token_ids == ref.tolist()
        assert out.finish_reason == "length" and out.num_output_tokens == 12


def test_attention_groups_mix_prefill_and_decode(sharp_dir):
    """One step holding a decode token, a 3-token verify-style query and a long prefill chunk."""
    from qtoolkit.engine.block_manager import BlockManager
    from qtoolkit.engine.model_runner import ModelRunner
    from qtoolkit.engine.params import SamplingParams
    from qtoolkit.engine.sequence import Sequence
    from qtoolkit.model.loader import load_model
    from qtoolkit.model.sources import resolve_model

    model = load_model(resolve_model(str(sharp_dir)))
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (9, 12, 40)]
    new = [1, 3, 40]  # tokens each sequence brings in the mixed step

    def fresh_runner():
        return BlockManager(64, 4), ModelRunner(model, 64, 4)

    # reference: each sequence alone, all its tokens at once
    ref = []
    for t in ids:
        bm, runner = fresh_runner()
        s = Sequence("r", t, SamplingParams())
        bm.grow(s, len(t))
        ref.append(runner.run([(s, len(t))], [len(t)]))
    # mixed: pre-fill the context of the first two, then one step with all three
    bm, runner = fresh_runner()
    seqs = [Sequence(str(i), t, SamplingParams()) for i, t in enumerate(ids)]
    for s, n in zip(seqs[:2], new[:2], strict=True):
        bm.grow(s, len(s) - n)
        runner.run([(s, len(s) - n)], [0])
        s.num_computed_tokens = len(s) - n
    for s in seqs:
        bm.grow(s, len(s))
    logits = runner.run(list(zip(seqs, new, strict=True)), new)
    got = logits.split(new)
    for r, g_, n in zip(ref, got, new, strict=True):
        torch.testing.assert_close(g_, r[-n:], atol=1e-4, rtol=1e-4)
