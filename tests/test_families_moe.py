"""Qwen3, Qwen3-MoE and Mixtral in the engine: tiny random models built from transformers configs give
transformers' greedy tokens (batch 1, short and long prompts, a mixed batch with preemption and prefix caching,
speculation), INT4 checkpoints from `qtool quantize` load and match a fake-quant reference, and the MoE block
runs only the experts its router picks."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from qtoolkit.cli import main
from qtoolkit.engine import Engine, SamplingParams

FAMILIES = ("qwen3", "qwen3_moe", "mixtral")
SHORT = "def add(a, b):\n    return"
LONG = ("Summarize: the committee met on Tuesday to review the budget. After a long debate about the roads, "
        "the schools and the new library, the members agreed to postpone the vote until the auditors had "
        "finished their report, which is expected next month. " * 2)
PROMPTS = [SHORT, LONG, "one two three one two three one two", "The quick brown fox", "x = [1, 2, 3]\ny = [1,"]
NEW_TOKENS = 16


def family_config(family: str, tok, **kw):
    from transformers import MixtralConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=len(tok), hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                  rms_norm_eps=1e-6)
    if family == "qwen3":  # head_dim 32 != hidden / heads: the explicit head_dim is what the engine must use
        return Qwen3Config(**common, intermediate_size=96, head_dim=32, **kw)
    if family == "qwen3_moe":  # layer 1 stays a dense MLP (mlp_only_layers); top-2 of 4, not renormalised
        return Qwen3MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32, head_dim=32,
                              **{"num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": False,
                                 "mlp_only_layers": [1], **kw})
    return MixtralConfig(**common, intermediate_size=64,
                         **{"sliding_window": None, "num_local_experts": 4, "num_experts_per_tok": 2, **kw})


def build_family(folder: Path, tokenizer_dir: Path, family: str, scale: float = 10.0, **kw) -> Path:
    """A random model of `family` with the default model's tokenizer, its weights scaled so that greedy argmax
    and the routers' top-k have no near-ties."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config(family, tok, **kw)).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:  # Linears, embeddings and the fused 3-D experts
                p.mul_(scale)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def hf_greedy(model, tok, prompt: str, n: int = NEW_TOKENS) -> list[int]:
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory, tokenizer_dir):
    """(family, folder, transformers' greedy continuation of each prompt)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = build_family(tmp_path_factory.mktemp(request.param), tokenizer_dir, request.param)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    return request.param, folder, [hf_greedy(model, tok, p) for p in PROMPTS]


def make(folder: Path, blocks: int = 256, block_size: int = 4, **kw) -> Engine:
    cfg = json.loads((folder / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_block = 2 * cfg["num_hidden_layers"] * block_size * cfg["num_key_value_heads"] * head_dim * 4  # fp32
    engine = Engine(str(folder), kv_cache_memory=blocks * per_block, block_size=block_size, **kw)
    if engine.spec_policy is not None:
        engine.spec_policy.adaptive = False  # pin k: the cost model may switch a costly draft off
    return engine


def greedy(engine: Engine, prompts: list[str | list[int]], lengths: list[int]) -> list[list[int]]:
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    return [o.token_ids for o in engine.generate(prompts, params, use_tqdm=False)]


def test_batch_1_matches_transformers_on_short_and_long_prompts(family):
    name, folder, refs = family
    engine = make(folder)
    assert len(engine.tokenizer(LONG).input_ids) > 64  # several blocks, chunked below
    for i in (0, 1):
        assert greedy(engine, [PROMPTS[i]], [NEW_TOKENS]) == [refs[i]], (name, i)


def test_mixed_batch_with_preemption_chunks_and_prefix_cache_matches_transformers(family):
    name, folder, refs = family
    engine = make(folder, blocks=40, max_num_batched_tokens=24)
    prompts = PROMPTS + PROMPTS  # the repeats are served from the prefix cache
    lengths = [NEW_TOKENS - 2 * (i % 3) for i in range(len(prompts))]
    outs = greedy(engine, prompts, lengths)
    assert outs == [refs[i % len(PROMPTS)][:n] for i, n in enumerate(lengths)], name
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_tokens > 0, stats
    assert stats.kv_blocks_used == 0


def test_speculation_keeps_greedy_identity(family):
    """ngram (prompt lookup) and the target's own INT4 copy (experts quantized, router dense)."""
    name, folder, refs = family
    plain = make(folder)
    # the prompt followed by its own continuation and the prompt again: a model that repeats itself gets a match
    ids = plain.tokenizer(SHORT).input_ids
    looped = ids + refs[0] + ids
    prompts, lengths = PROMPTS + [looped], [NEW_TOKENS] * (len(PROMPTS) + 1)
    want = refs + greedy(plain, [looped], [NEW_TOKENS])
    contexts = [plain.tokenizer(p).input_ids if isinstance(p, str) else p for p in prompts]
    # prompt lookup (n >= 1) has a proposal at a decode step iff the newest token occurred earlier
    lookup_hits = any(out[j - 1] in ctx + out[:j - 1] for ctx, out in zip(contexts, want, strict=True)
                      for j in range(1, NEW_TOKENS - 1))
    for spec in ("ngram", "self-int4"):
        engine = make(folder, speculative=spec, num_speculative_tokens=3, max_verify_tokens=64)
        assert greedy(engine, prompts, lengths) == want, (name, spec)
        stats = engine.stats()
        drafted = stats.speculative.draft_tokens > 0
        assert drafted == (lookup_hits if spec == "ngram" else True) and stats.kv_blocks_used == 0, (name, spec)


# -- quantized checkpoints --------------------------------------------------------------------------------

EXPERT = re.compile(r"(.*)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)$")


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for p in folder.glob("*.safetensors"):
        with safe_open(p, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def fake_quant_reference(dense: Path, quantized: Path):
    """transformers' model of `dense` holding the checkpoint's weights: the quantized Linears dequantized
    (compressed-tensors' own unpacking), the rest (bf16 in the checkpoint) widened; fp32 activations."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    params = dict(model.named_parameters())
    groups = json.loads((quantized / "config.json").read_text())["quantization_config"]["config_groups"]
    (scheme,) = groups.values()
    t = _tensors(quantized)
    names = {k.rsplit(".", 1)[0] for k in t if k.endswith(".weight_scale")}
    with torch.no_grad():
        for key, value in t.items():
            key = key.replace(".block_sparse_moe.", ".mlp.")
            if key.endswith(".weight") and key.rsplit(".", 1)[0] not in names and key in params:
                params[key].copy_(value.float())
    for name in names:
        if name + ".weight_packed" in t:
            shape = torch.Size(t[name + ".weight_shape"].tolist())
            q = unpack_from_int32(t[name + ".weight_packed"], scheme["weights"]["num_bits"], shape)
        else:
            q = t[name + ".weight"]
        scale = t[name + ".weight_scale"].float()
        w = q.float() * scale.repeat_interleave(q.shape[1] // scale.shape[1], dim=1)
        m = EXPERT.match(name)
        with torch.no_grad():
            if m is None:
                params[name + ".weight"].copy_(w)
                continue
            prefix, e, kind = m[1], int(m[2]), m[3]
            if kind in ("down_proj", "w2"):
                params[f"{prefix}.mlp.experts.down_proj"][e].copy_(w)
            else:
                gate_up = params[f"{prefix}.mlp.experts.gate_up_proj"][e]
                half = gate_up.shape[0] // 2  # [gate; up] stacked on the output dim
                rows = slice(0, half) if kind in ("gate_proj", "w1") else slice(half, None)
                gate_up[rows].copy_(w)
    return model


def quantize_cli(model: Path, recipe: str, out: Path) -> Path:
    assert main(["quantize", "--model", str(model), "--recipe", recipe, "--output", str(out), "--no-verify"]) == 0
    return out


def test_int4_checkpoint_loads_with_int4_experts_and_matches_fake_quant(family, tmp_path, monkeypatch):
    from qtoolkit.kernels import dispatch
    from transformers import AutoTokenizer

    from qtoolkit.model.moe import SparseMoE
    from qtoolkit.model.quant_linear import DenseLinear, QuantLinear

    name, folder, _ = family
    out = quantize_cli(folder, "int4-rtn", tmp_path / "int4")
    engine = make(out)
    moe = [layer.mlp for layer in engine.model.layers if isinstance(layer.mlp, SparseMoE)]
    assert len(moe) == {"qwen3": 0, "qwen3_moe": 2, "mixtral": 3}[name]
    for block in moe:
        assert isinstance(block.gate, DenseLinear)  # llm-compressor leaves the router unquantized
        assert all(isinstance(e.gate_up_proj, QuantLinear) and e.gate_up_proj.kind == "int4"
                   and e.down_proj.kind == "int4" for e in block.experts)
    ref = fake_quant_reference(folder, out)
    tok = AutoTokenizer.from_pretrained(out)
    short, long = tok(SHORT).input_ids, tok(LONG).input_ids
    with torch.no_grad():
        want = [ref(torch.tensor([ids])).logits[0].log_softmax(-1) for ids in (short, long)]
    # at <= 32 rows the AVX2 INT4 kernel quantizes activations to int8 per 32 (llama.cpp's Q4 x Q8): close
    got = engine.score([short, long])
    for g, w in zip(got, want, strict=True):
        assert (g.argmax(-1) == w.argmax(-1)).float().mean() >= 0.9 and (g - w).abs().mean() < 0.05, name
    # with every call on the dequantize + sgemm path the engine computes W4A16 exactly: the reference's numbers
    # (an engine built after the change: each Linear binds its GEMV and row limit at load)
    monkeypatch.setattr(dispatch, "INT4_GEMV_MAX_M", 0)
    engine = make(out)
    for g, w in zip(engine.score([short, long]), want, strict=True):
        torch.testing.assert_close(g, w, atol=2e-4, rtol=1e-4)
    assert greedy(engine, [SHORT], [8]) == [hf_greedy(ref, tok, SHORT, 8)], name


# -- the MoE block, the CLI, refusals -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def wide_moe(tmp_path_factory, tokenizer_dir):
    """qwen3_moe with 8 experts, top-2 renormalised: most experts idle for any one token."""
    return build_family(tmp_path_factory.mktemp("wide-moe"), tokenizer_dir, "qwen3_moe", num_experts=8,
                        norm_topk_prob=True, mlp_only_layers=[])


def test_moe_runs_only_the_routed_experts_once_each_with_their_tokens(wide_moe):
    from qtoolkit.model.loader import load_model
    from qtoolkit.model.moe import route
    from qtoolkit.model.sources import resolve_model

    block = load_model(resolve_model(str(wide_moe))).layers[0].mlp
    calls: dict[int, list[int]] = {}
    for e, expert in enumerate(block.experts):
        def counted(x, e=e, inner=expert.forward):
            calls.setdefault(e, []).append(x.shape[0])
            return inner(x)
        expert.forward = counted
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)) * 10
    out = block.forward(x)
    weights, picked = route(x @ block.gate.weight.float().t(), block.config)
    routed = {e: int((picked == e).sum()) for e in picked.unique().tolist()}
    assert {e: sum(n) for e, n in calls.items()} == routed and all(len(n) == 1 for n in calls.values())
    assert len(routed) < 8
    # the same sum written densely: every token through its k experts, weighted, in float64. x is scaled by 10, so
    # the down projection sums terms of ~100 into outputs of ~1, and fp32's summation order (a BLAS's against the
    # engine's GEMV) moves an output by up to ~4e-4 on some CPUs; a wrong routing or weight moves it by ~1.
    dense = torch.stack([sum(w.double() * _expert_dense(block.experts[e], x[t].double())
                             for w, e in zip(weights[t], picked[t].tolist(), strict=True)) for t in range(5)])
    torch.testing.assert_close(out.double(), dense, atol=2e-3, rtol=1e-4)
    calls.clear()  # one decode token: exactly top_k expert calls
    block.forward(x[:1])
    assert sorted(calls) == sorted(picked[0].tolist()) and all(n == [1] for n in calls.values())


def _expert_dense(expert, x: torch.Tensor) -> torch.Tensor:
    gate, up = (x @ expert.gate_up_proj.weight.to(x.dtype).t()).chunk(2)
    return (torch.nn.functional.silu(gate) * up) @ expert.down_proj.weight.to(x.dtype).t()


def test_fused_3d_expert_checkpoint_loads_like_the_per_expert_one(family, tmp_path):
    """transformers 5's in-memory layout (experts.gate_up_proj [E, 2I, H]) written as is, Mixtral included."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    name, folder, refs = family
    if name == "qwen3":
        pytest.skip("dense family")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    fused = tmp_path / "fused"
    shutil.copytree(folder, fused, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, fused / "model.safetensors")
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in _tensors(fused))
    assert greedy(make(fused), PROMPTS[:2], [NEW_TOKENS] * 2) == refs[:2]


@pytest.mark.parametrize("which", ["qwen3_moe", "mixtral"])
def test_qtool_generate_greedy_through_the_cli(which, tmp_path, tokenizer_dir, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = build_family(tmp_path / which, tokenizer_dir, which)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for prompt in (SHORT, LONG):
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            ref = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:]
        assert main(["generate", "--model", str(folder), "--prompt", prompt, "--temperature", "0",
                     "--max-tokens", "12", "--kv-cache-memory", "8MiB"]) == 0
        assert capsys.readouterr().out == tok.decode(ref, skip_special_tokens=True) + "\n"


def test_unsupported_family_is_refused_with_the_list(family, tmp_path, capsys):
    name, folder, _ = family
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "deepseek_v3"}))
    assert main(["generate", "--model", str(bad), "--prompt", "hi", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and all(w in err for w in ["'deepseek_v3' is not supported", "qwen3_moe",
                                                            "mixtral", "qwen3"]), err


@pytest.mark.parametrize("name, window", [("mixtral", {"sliding_window": 16}),
                                          ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 16})])
def test_windowed_moe_matches_transformers_past_the_window(name, window, tmp_path, tokenizer_dir):
    """The MoE families' sliding windows run in the engine (the windowed attention of the dense families)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = build_family(tmp_path / name, tokenizer_dir, name, **window)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    assert greedy(make(folder), [LONG], [NEW_TOKENS]) == [hf_greedy(model, tok, LONG)]


@pytest.mark.parametrize("recipe,kind", [("int8-weight", "int8"), ("fp8-weight", "fp8")])
def test_int8_and_fp8_experts_match_fake_quant(wide_moe, recipe, kind, tmp_path, monkeypatch):
    from qtoolkit.kernels import dispatch
    from transformers import AutoTokenizer

    out = quantize_cli(wide_moe, recipe, tmp_path / recipe)
    # the dequantize + sgemm path: exact W8A16 (set before the engine loads: each Linear binds its GEMV row limit)
    for name in ("GEMV_MAX_M", "FP8_GEMV_MAX_M"):
        monkeypatch.setattr(dispatch, name, 0)
    engine = make(out)
    block = engine.model.layers[0].mlp
    assert {e.gate_up_proj.kind for e in block.experts} == {e.down_proj.kind for e in block.experts} == {kind}
    ref = fake_quant_reference(wide_moe, out)
    ids = AutoTokenizer.from_pretrained(out)(LONG).input_ids
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].log_softmax(-1)
    torch.testing.assert_close(engine.score([ids])[0], want, atol=2e-4, rtol=1e-4)



@pytest.mark.slow  # a server subprocess and the diagnose sweeps: tens of seconds
def test_diagnose_and_bench_serve_run_on_a_moe_family(tmp_path, tokenizer_dir):
    """The sign-off's bench and diagnose steps on Qwen3-MoE (its quantize and eval steps run the engine paths the
    tests above hold to transformers): `qtool diagnose` counts the experts' bytes and sweeps, `qtool bench serve`
    serves every request."""
    folder = build_family(tmp_path / "qwen3_moe", tokenizer_dir, "qwen3_moe")
    diag, bench = tmp_path / "diagnose.json", tmp_path / "bench.json"
    assert main(["diagnose", "--model", str(folder), "--batches", "1,2", "--prompt-lengths", "16",
                 "--kv-cache-memory", "16MiB", "--output", str(diag)]) == 0
    d = json.loads(diag.read_text())
    weights = _tensors(folder)  # every matrix but the embedding and the head: attention, dense MLP, routers, experts
    want = sum(t.numel() * t.element_size() for k, t in weights.items()
               if t.dim() >= 2 and "embed_tokens" not in k and "lm_head" not in k)
    assert d["model"]["linear_bytes"] == want and all(r["tokens_per_s"] > 0 for r in d["decode"])
    assert main(["bench", "serve", "--model", str(folder), "--concurrency", "1,2", "--num-requests", "2",
                 "--mean-output-tokens", "4", "--max-output-tokens", "8", "--kv-cache-memory", "16MiB",
                 "--output", str(bench)]) == 0
    tiers = json.loads(bench.read_text())["tiers"]
    assert [t["results"]["continuous"]["completed"] for t in tiers] == [2, 2]
