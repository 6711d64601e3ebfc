"""Model families with sliding windows and Gemma 3's pieces against transformers, on tiny random models built from
their transformers configs (fp32, the default model's tokenizer): greedy identity with `generate` at batch 1 on
prompts shorter and longer than the window, in a mixed batch with preemption and chunked prefill, with prefix
cache hits and with speculation; teacher-forced logits (final soft-capping too); INT4 checkpoints; `qtool generate`.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qtoolkit.engine import Engine, SamplingParams
from qtoolkit.errors import ModelSourceError
from qtoolkit.model.llama import SUPPORTED_MODEL_TYPES, ModelConfig

SHORT = "The quick brown fox"
LONG = ("def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n\nclass Stack:\n"
        "    def __init__(self):\n        self.items = []")  # 44 tokens: past every window below
REPEAT = "one two three four five six seven eight nine ten " * 4  # prompt lookup finds its n-grams
WINDOWED = ("mistral", "gemma3_text", "qwen2")
FAMILIES = (*WINDOWED, "llama3")
NEW = ("mistral", "gemma3_text")
BLOCK_SIZE = 4
README = Path(__file__).resolve().parents[1] / "README.md"


def _config(family: str, vocab: int, tok, **extra):
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if family == "mistral":
        return MistralConfig(num_hidden_layers=3, sliding_window=16, tie_word_embeddings=False, **common, **extra)
    if family == "qwen2":  # windows on layers 1 and 2 only (max_window_layers): full and windowed layers mixed
        return Qwen2Config(num_hidden_layers=3, use_sliding_window=True, sliding_window=16, max_window_layers=1,
                           tie_word_embeddings=True, **common, **extra)
    if family == "llama3":
        return LlamaConfig(num_hidden_layers=3, tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, **common, **extra)
    # local, local, global, local; the global layers' rope is linearly scaled, the local ones have their own base;
    # query_pre_attn_scalar differs from head_dim so the attention scale is checked
    return Gemma3TextConfig(
        num_hidden_layers=4, head_dim=16, sliding_window=12, query_pre_attn_scalar=32,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}, **common, **extra)


def build_family(folder: Path, tokenizer_dir: Path, family: str, **extra) -> Path:
    """A random model of `family` whose logits are far from uniform (weights x10) and whose norm weights are not
    all ones (Gemma's zero-initialised (1 + w) norms would hide a wrong offset)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(family, len(tok), tok, **extra)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(10.0)
            elif "norm" in name:
                p.copy_(torch.randn_like(p) * 0.3 + (0.0 if family == "gemma3_text" else 1.0))
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def built(tmp_path_factory, tokenizer_dir):
    """family name -> (name, folder, transformers model, greedy(prompt, n) -> transformers' tokens), built once."""
    from transformers import AutoModelForCausalLM

    @functools.cache
    def build(name: str):
        folder = build_family(tmp_path_factory.mktemp(name), tokenizer_dir, name)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

        @functools.cache
        def greedy(prompt: str | tuple[int, ...], n: int) -> list[int]:
            ids = torch.tensor([prompt]) if isinstance(prompt, tuple) else \
                _tok(folder)(prompt, return_tensors="pt").input_ids
            with torch.no_grad():
                out = hf.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n)
            return out[0, ids.shape[1]:].tolist()

        return name, folder, hf, greedy

    return build


@pytest.fixture(params=FAMILIES)
def family(request, built):
    return built(request.param)


@pytest.fixture(params=NEW)
def new_family(request, built):
    """The families this change adds or fixes (Mistral's window was ignored, Gemma 3 was refused)."""
    return built(request.param)


@functools.cache
def _tok(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def make(folder: Path, blocks: int = 256, **kw) -> Engine:
    c = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    per_block = 2 * c.num_layers * BLOCK_SIZE * c.num_kv_heads * c.head_dim * 4  # fp32
    return Engine(str(folder), kv_cache_memory=blocks * per_block, block_size=BLOCK_SIZE, **kw)


def random_prompts(lengths) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(7)
    return [tuple(torch.randint(0, 2000, (n,), generator=g).tolist()) for n in lengths]


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None if len(a) == len(b) else 0)


def test_teacher_forced_logits_match_and_the_window_matters(family, tokenizer_dir):
    """Chunked, packed scoring equals transformers' logits; for windowed families the same model with the window
    removed gives clearly different logits, so these prompts exercise it."""
    from transformers import AutoModelForCausalLM

    name, folder, hf, _ = family
    seqs = [list(p) for p in random_prompts((60, 9, 33))]
    for budget in (12, 64):  # 12: every chunk through the paged op; 64: the masked SDPA path
        engine = make(folder, max_num_batched_tokens=budget)
        for ids, got in zip(seqs, engine.score(seqs), strict=True):
            with torch.no_grad():
                ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
            torch.testing.assert_close(got, ref, atol=3e-4, rtol=1e-4)
    if name in WINDOWED:
        wide = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, sliding_window=4096).eval()
        with torch.no_grad():
            gap = (wide(torch.tensor([seqs[0]])).logits - hf(torch.tensor([seqs[0]])).logits).abs().max()
        assert gap > 1.0


@pytest.mark.parametrize("paged", [True, False], ids=["paged-op", "torch-fallback"])
def test_batch1_greedy_matches_transformers_short_and_past_the_window(family, paged):
    name, folder, _, greedy = family
    engine = make(folder, max_num_batched_tokens=20)  # the 44-token prompt is prefilled in chunks
    engine.runner.paged_attention = paged and engine.runner.paged_attention
    for prompt in (SHORT, LONG, *random_prompts((50,))):
        out = engine.generate([list(prompt) if isinstance(prompt, tuple) else prompt],
                              SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
        ref = greedy(prompt, 24)
        assert out.token_ids == ref, f"{name}: diverged at token {first_difference(out.token_ids, ref)}"
    assert engine.stats().kv_blocks_used == 0


def test_mixed_batch_with_preemption_matches_transformers(family):
    name, folder, _, greedy = family
    prompts = [SHORT, LONG, *random_prompts((3, 60, 17, 40, 25, 8))]
    lengths = [24, 20, 24, 16, 24, 22, 18, 24]
    engine = make(folder, blocks=28, max_num_seqs=8, max_num_batched_tokens=32)
    outs = engine.generate([list(p) if isinstance(p, tuple) else p for p in prompts],
                           [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths], use_tqdm=False)
    for i, (out, p, n) in enumerate(zip(outs, prompts, lengths, strict=True)):
        ref = greedy(p, 24)[:n]
        assert out.token_ids == ref, f"{name} request {i}: diverged at {first_difference(out.token_ids, ref)}"
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.kv_blocks_used == 0


def test_prefix_cache_hits_past_the_window_keep_greedy_identity(new_family):
    name, folder, _, greedy = new_family
    engine = make(folder)
    prefix = random_prompts((41,))[0]  # ten full blocks, most of them outside every window of the suffixes
    for suffix in ((5, 6, 7), (9, 10), (5, 6, 8, 1, 2)):
        prompt = prefix + suffix
        out = engine.generate([list(prompt)], SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
        assert out.token_ids == greedy(prompt, 20), name
    assert engine.stats().prefix_cache_hit_tokens >= 2 * 40


@pytest.mark.parametrize("name, proposer", [*((f, "ngram") for f in FAMILIES), *((f, "self") for f in NEW)])
def test_speculation_keeps_greedy_identity(built, name, proposer):
    """ngram proposals on this random model are mostly rejected; the model drafting for itself (`self:PATH`, its
    own paged cache) has every draft accepted: both ends of multi-token verification through the windows."""
    name, folder, _, greedy = built(name)
    spec = "ngram" if proposer == "ngram" else f"self:{folder}"
    engine = make(folder, speculative=spec, num_speculative_tokens=4, max_verify_tokens=64,
                  max_num_batched_tokens=32)
    engine.spec_policy.adaptive = False  # keep proposing: the verification path is what is tested
    short = tuple(_tok(folder)(SHORT).input_ids)
    looped = short + tuple(greedy(SHORT, 24)) + short  # a model that repeats itself gets a prompt-lookup match
    prompts = [REPEAT, LONG, SHORT, looped]
    outs = engine.generate([list(p) if isinstance(p, tuple) else p for p in prompts],
                           SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)
    refs = [greedy(p, 24) for p in prompts]
    for out, ref in zip(outs, refs, strict=True):
        assert out.token_ids == ref, f"{name} {proposer}: diverged at {first_difference(out.token_ids, ref)}"
    stats = engine.stats()
    assert stats.kv_blocks_used == 0
    if proposer == "self":
        assert stats.speculative.draft_tokens > 0 and stats.speculative.acceptance_rate == 1.0
        return
    # prompt lookup has a proposal at a decode step iff the newest token occurred earlier in the context
    contexts = [list(p) if isinstance(p, tuple) else _tok(folder)(p).input_ids for p in prompts]
    hits = any(out[j - 1] in ctx + out[:j - 1] for ctx, out in zip(contexts, refs, strict=True) for j in range(1, 23))
    assert (stats.speculative.draft_tokens > 0) == hits, name


def test_int4_checkpoint_loads_and_generates(family, tmp_path):
    from qtoolkit.model.quant_linear import DenseLinear
    from qtoolkit.quantize.run import quantize

    name, folder, _, _ = family
    quantize(folder, "int4-rtn", tmp_path / "int4", verify=False)
    engine = Engine(str(tmp_path / "int4"), kv_cache_memory="16MiB", block_size=BLOCK_SIZE)
    assert not isinstance(engine.model.layers[0].attn.qkv_proj, DenseLinear)
    outs = engine.generate([SHORT, LONG], SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert all(o.num_output_tokens == 24 and o.finish_reason == "length" for o in outs)


def test_final_logit_softcapping_matches_transformers(tmp_path, tokenizer_dir):
    """Gemma's final-logit soft-capping (off in released Gemma 3 configs, honoured when set)."""
    from transformers import AutoModelForCausalLM

    folder = build_family(tmp_path / "capped", tokenizer_dir, "gemma3_text", final_logit_softcapping=30.0)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = list(random_prompts((40,))[0])
    got = make(folder).score([ids])[0]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    assert logits.abs().max() <= 30.0
    torch.testing.assert_close(got, logits.log_softmax(-1), atol=3e-4, rtol=1e-4)


def test_qtool_generate_cli_matches_transformers(built):
    """`qtool generate --temperature 0` as a user runs it, one short and one long prompt in one call (Gemma 3:
    the family with the most new pieces; one process start is most of this test's time)."""
    name, folder, _, greedy = built("gemma3_text")
    qtool = shutil.which("qtool")
    cmd = [qtool] if qtool else [sys.executable, "-m", "qtoolkit"]
    proc = subprocess.run([*cmd, "generate", "--model", str(folder), "--prompt", SHORT, "--prompt", LONG,
                           "--temperature", "0", "--max-tokens", "24", "--kv-cache-memory", "16MiB"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "QTOOLKIT_QUIET": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    texts = re.split(r"^=== \[\d+\] \(.*\)\n", proc.stdout, flags=re.M)[1:]
    tok = _tok(folder)
    want = [tok.decode(greedy(p, 24), skip_special_tokens=True) for p in (SHORT, LONG)]
    assert [t.removesuffix("\n") for t in texts] == want


def test_a_family_the_engine_cannot_run_is_refused_with_the_list(built, tmp_path, capsys):
    from qtoolkit.cli import main

    _, folder, _, _ = built("mistral")
    other = shutil.copytree(folder, tmp_path / "phi3")
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "model_type": "phi3"}))
    assert main(["generate", "--model", str(other), "--prompt", "hi", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "'phi3' is not supported" in err and "gemma3_text" in err and "mistral" in err
    with pytest.raises(ModelSourceError, match="layer_types"):  # Llama 4's chunked attention: not run wrongly
        ModelConfig.from_hf({**cfg, "model_type": "llama", "layer_types": ["chunked_attention"] * 3})


def test_blocks_behind_every_window_are_freed_as_a_sequence_advances(built):
    """Mistral slides a 16-token window on every layer: a sequence holds at most the blocks of its window (plus
    the one being filled), greedy output stays transformers', and freed blocks serve other requests. Gemma 3 has
    global layers, so it keeps every block."""
    name, folder, _, greedy = built("mistral")
    engine = make(folder, max_num_batched_tokens=16)
    assert engine.kv_window == 16 and make(built("gemma3_text")[1]).kv_window is None
    engine.add_request("long", LONG, SamplingParams(max_tokens=40, ignore_eos=True))
    most = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.token_ids == greedy(LONG, 40)
        most = max(most, engine.stats().kv_blocks_used)
    assert most <= 16 // BLOCK_SIZE + 2 < (44 + 40) // BLOCK_SIZE
    assert engine.stats().kv_blocks_used == 0


def test_readme_lists_exactly_the_families_the_engine_runs():
    """The README's supported-families table names each `model_type` the engine accepts, and no other."""
    section = README.read_text().split("## Supported model families", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\|[^|]+\| `([a-z0-9_]+)` \|", section, flags=re.M)[1:]  # [0]: the header
    assert sorted(listed) == sorted(SUPPORTED_MODEL_TYPES)
