"""The quantized KV cache (--kv-cache-dtype fp8|int8): the C++ ops write the bytes the torch path writes and read
them in place; the engine stays batch-invariant and keeps preemption, chunked prefill, prefix caching, sliding
windows and speculation exact; it stays close to the unquantized cache; the budget buys tokens by the byte ratio;
calibrated checkpoint scales are used; bad values are one-line errors."""

from __future__ import annotations

import json

import pytest
import torch
from qtoolkit.kernels.cpu_build import engine_ops
from safetensors.torch import load_file, save_file
from test_engine_ops import reference_attention
from test_model_llama import build_sharp_tiny_llama

import qtoolkit.engine.model_runner as runner_mod
import qtoolkit.model.llama as llama_mod
from qtoolkit.cli import main
from qtoolkit.engine import Engine, EngineConfig, EngineInputError, SamplingParams
from qtoolkit.engine.config import KV_CACHE_DTYPES
from qtoolkit.engine.model_runner import kv_bytes_per_block
from qtoolkit.model import kv_quant
from qtoolkit.model.kv_quant import dequantize, quantize
from qtoolkit.model.llama import apply_rope

ops = engine_ops()
needs_ops = pytest.mark.skipif(ops is None, reason="CPU engine ops unavailable (no AVX2 or no compiler)")
KINDS = ("fp8", "int8")


@pytest.fixture(scope="module")
def sharp_dir(tmp_path_factory, tokenizer_dir):
    return build_sharp_tiny_llama(tmp_path_factory.mktemp("sharp-kvq"), tokenizer_dir)


def test_dtype_lists_agree():
    assert KV_CACHE_DTYPES == kv_quant.KV_CACHE_DTYPES


@pytest.mark.parametrize("kind", KINDS)
def test_quantize_round_trip_error_is_bounded(kind):
    x = torch.randn(50, 3, 64, generator=torch.Generator().manual_seed(0)) * 4
    values, scales = quantize(x, kind)
    assert values.dtype == kv_quant.STORAGE[kind] and scales.shape == (50, 3)
    err = (dequantize(values, scales, kind, torch.float32) - x).abs()
    amax = x.abs().amax(-1, keepdim=True)
    # E4M3 keeps 3 mantissa bits (relative error <= 1/16); int8 rounds to half a step of amax / 127
    bound = x.abs() / 16 + amax / 448 / 8 if kind == "fp8" else amax / 127 / 2 + 1e-6
    assert bool((err <= bound + 1e-6).all()) and float(err.max()) > 0


@needs_ops
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("static", [False, True])
def test_rope_and_cache_quant_writes_the_torch_paths_bytes(kind, static):
    g = torch.Generator().manual_seed(1)
    H, Hk, D, T = 4, 2, 16, 7
    qkv = torch.randn(T, (H + 2 * Hk) * D, generator=g) * 3
    freqs = torch.outer(torch.arange(T).float(), 1 / (10000 ** (torch.arange(0, D, 2).float() / D)))
    cos, sin = freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)
    fixed = torch.tensor([0.02, 0.05]) if static else None
    k_cache = torch.zeros(4, 4, Hk, D, dtype=kv_quant.STORAGE[kind])
    v_cache, k_scales, v_scales = k_cache.clone(), torch.zeros(4, 4, Hk), torch.zeros(4, 4, Hk)
    slots = torch.tensor([3, 7, 0, 12, 5, 15, 9])
    q = ops.rope_and_cache_quant(qkv, cos, sin, k_cache, v_cache, k_scales, v_scales, slots, H, Hk, kind == "fp8",
                                 fixed, fixed)
    qk = apply_rope(qkv[:, :(H + Hk) * D].view(T, H + Hk, D), cos, sin)
    for cache, scales, x in ((k_cache, k_scales, qk[:, H:]), (v_cache, v_scales, qkv[:, (H + Hk) * D:].view(T, Hk, D))):
        values, scale = quantize(x, kind, fixed)
        assert torch.equal(cache.view(-1, Hk, D)[slots], values)
        assert torch.equal(scales.view(-1, Hk)[slots], scale)
    assert torch.equal(q, qk[:, :H])


@needs_ops
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("head_dim,window", [(64, 0), (12, 0), (16, 5)])  # 12: the vector loops' scalar tail
def test_paged_attention_reads_the_quantized_cache(kind, head_dim, window):
    g = torch.Generator().manual_seed(2)
    H, Hk, bs, nb = 6, 2, 4, 40
    k, v = (torch.randn(nb * bs, Hk, head_dim, generator=g) * 2 for _ in range(2))
    (kq, ks), (vq, vs) = quantize(k, kind), quantize(v, kind)
    shape = (nb, bs, Hk, head_dim)
    kq, vq, ks, vs = kq.view(shape), vq.view(shape), ks.view(nb, bs, Hk), vs.view(nb, bs, Hk)
    table = torch.randperm(nb, generator=g)[:24].reshape(3, 8)
    rows = [(0, 9), (1, 27), (1, 28), (2, 0)]
    row_seq, row_last = torch.tensor([s for s, _ in rows]), torch.tensor([p for _, p in rows])
    q = torch.randn(len(rows), H, head_dim, generator=g)
    got = ops.paged_attention(q, kq, vq, table, row_seq, row_last, head_dim ** -0.5, window, ks, vs)
    ref = reference_attention(q, dequantize(kq, ks, kind, torch.float32), dequantize(vq, vs, kind, torch.float32),
                              table, row_seq, row_last, head_dim ** -0.5, window)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="both"):
        ops.paged_attention(q, kq, vq, table, row_seq, row_last, 1.0, 0, ks, None)


@needs_ops
@pytest.mark.parametrize("head_dim", [64, 16, 24])  # 64 and 16 take the F16C widening, 24 the exact one
def test_paged_attention_reads_every_fp8_code(head_dim):
    """Every E4M3 byte but the two NaNs (subnormals, both zeros, +-448), read as keys and as values, each where an
    error in its widening shows: the widening that folds 2^8 into the scale reads each as dequantize does."""
    codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)
    values = codes.view(torch.float8_e4m3fn).float()
    bs, n = 4, -(-len(codes) // head_dim)  # n positions hold every code once (the rest: code 0)
    padded = torch.cat([codes[values.abs().argsort()], torch.zeros(n * head_dim - len(codes), dtype=torch.uint8)])
    blocks = -(-n // bs)
    table, rows = torch.arange(blocks).view(1, -1), torch.zeros(head_dim, dtype=torch.long)
    last = torch.full((head_dim,), n - 1)

    def cache(by_position: torch.Tensor) -> torch.Tensor:  # [n, D] codes -> [blocks, bs, 1, D]
        out = torch.zeros(blocks * bs, head_dim, dtype=torch.uint8)
        out[:n] = by_position
        return out.view(blocks, bs, 1, head_dim)

    def check(kq, vq, q, ks, vs):
        got = ops.paged_attention(q, kq, vq, table, rows, last, 1.0, 0, ks, vs)
        ref = reference_attention(q, dequantize(kq, ks, "fp8", torch.float32),
                                  dequantize(vq, vs, "fp8", torch.float32), table, rows, last, 1.0)
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)

    g = torch.Generator().manual_seed(3)
    scales = 0.3 + torch.rand(blocks, bs, 1, generator=g)
    one_hot = torch.zeros(n, head_dim, dtype=torch.uint8)
    one_hot[torch.arange(n), torch.arange(n)] = 0x38  # 1.0: output lane i of a query is its weight on position i
    # keys: query d reads key element d only, and key column d holds codes of one magnitude (sorted), scaled to +-1
    keys = padded.view(head_dim, n).t().contiguous()
    column_max = keys.view(torch.float8_e4m3fn).float().abs().amax(0).clamp_min(2.0 ** -9)
    q = (torch.eye(head_dim) / (column_max * 1.3)).view(head_dim, 1, head_dim)
    check(cache(keys), cache(one_hot), q, scales, torch.ones_like(scales))
    # values: a zero query weighs every position alike, so each output is a mean of one column of codes
    check(cache(one_hot), cache(padded.view(n, head_dim)), torch.zeros(head_dim, 1, head_dim), scales, scales)


def make(model_dir, kv: str, blocks: int = 512, block_size: int = 4, **kw) -> Engine:
    """An engine whose cache holds `blocks` blocks whatever its dtype."""
    cfg = json.loads((model_dir / "config.json").read_text())
    per_head = cfg["hidden_size"] // cfg["num_attention_heads"] * 4 if kv == "auto" else \
        cfg["hidden_size"] // cfg["num_attention_heads"] + kv_quant.SCALE_BYTES
    per_block = 2 * cfg["num_hidden_layers"] * block_size * cfg["num_key_value_heads"] * per_head
    engine = Engine(str(model_dir), kv_cache_memory=blocks * per_block, block_size=block_size, kv_cache_dtype=kv,
                    **kw)
    assert kv_bytes_per_block(engine.model, block_size, kv) == per_block
    return engine


PROMPTS = ["def add(a, b):\n    return a + b\n\ndef mul(a, b):", "The quick brown fox", "Summarize: rain fell.",
           "import numpy as np\nx = np.arange(10)\n", "Once upon a time, in a land far away, there lived",
           "Q: what is 2 + 2?\nA:", "class Stack:\n    def __init__(self):", "hello"]


def greedy(engine: Engine, prompts: list[str], n: int = 10) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True),
                                                 use_tqdm=False)]


@pytest.mark.parametrize("kind", KINDS)
def test_batch_of_32_is_token_identical_to_batch_1(sharp_dir, kind):
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(32)]
    engine = make(sharp_dir, kind, max_num_seqs=32)
    alone = [greedy(engine, [p])[0] for p in prompts]
    assert greedy(engine, prompts) == alone
    assert engine.stats().kv_cache_dtype == kind


@pytest.fixture(scope="module")
def fp8_reference(sharp_dir):
    return greedy(make(sharp_dir, "fp8"), PROMPTS, 16)


def test_preemption_and_chunked_prefill_are_exact(sharp_dir, fp8_reference):
    small = make(sharp_dir, "fp8", blocks=24, max_num_batched_tokens=32)
    assert greedy(small, PROMPTS, 16) == fp8_reference
    assert small.stats().num_preemptions > 0
    assert greedy(make(sharp_dir, "fp8", max_num_batched_tokens=12), PROMPTS, 16) == fp8_reference


def test_prefix_cache_hits_give_the_same_tokens(sharp_dir, fp8_reference):
    engine = make(sharp_dir, "fp8")
    assert greedy(engine, PROMPTS, 16) == fp8_reference
    assert greedy(engine, PROMPTS, 16) == fp8_reference
    assert engine.stats().prefix_cache_hit_tokens > 0
    assert greedy(make(sharp_dir, "fp8", enable_prefix_caching=False), PROMPTS, 16) == fp8_reference


@pytest.mark.parametrize("proposer", ["self", "draft"])  # self: the draft reads and writes the quantized cache
def test_speculation_keeps_greedy_tokens(sharp_dir, fp8_reference, proposer):
    engine = make(sharp_dir, "fp8", speculative=f"{proposer}:{sharp_dir}", num_speculative_tokens=4,
                  max_verify_tokens=64)
    assert greedy(engine, PROMPTS, 16) == fp8_reference
    assert engine.stats().speculative.accepted_tokens > 0


def mean_kld(base: Engine, quant: Engine, prompts: list[str]) -> float:
    """Mean per-token KL(base || quant) of the teacher-forced next-token distributions."""
    ids = [base.tokenizer.encode(p) for p in prompts]
    klds = [torch.nn.functional.kl_div(q, p, log_target=True, reduction="none").sum(-1)
            for p, q in zip(base.score(ids), quant.score(ids), strict=True)]
    return float(torch.cat(klds).mean())


def test_sliding_window_model_runs_quantized(tmp_path, tokenizer_dir):
    """Every layer slides a 6-token window, so blocks behind it are freed: the quantized cache stays batch-invariant
    and close to the unquantized one."""
    folder = build_sharp_tiny_llama(tmp_path / "sliding", tokenizer_dir)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(model_type="mistral", sliding_window=6)
    (folder / "config.json").write_text(json.dumps(cfg))
    engine = make(folder, "fp8")
    assert engine.kv_window == 6
    together = greedy(engine, PROMPTS, 12)
    assert together == [greedy(engine, [p], 12)[0] for p in PROMPTS]
    assert 0 < mean_kld(make(folder, "auto"), engine, PROMPTS) < 0.02


@pytest.mark.parametrize("kind,max_kld", [("fp8", 0.02), ("int8", 0.002)])
def test_logits_stay_close_to_the_unquantized_cache(sharp_dir, kind, max_kld):
    """A sharp random model (greedy ties flip easily, so tokens are not compared) keeps a small KL divergence."""
    assert 0 < mean_kld(make(sharp_dir, "auto"), make(sharp_dir, kind), PROMPTS) < max_kld


def test_torch_path_matches_the_ops_path(sharp_dir, fp8_reference, monkeypatch):
    """Without the C++ ops the torch path writes the same bytes and gathers-and-dequantizes: same greedy tokens."""
    if ops is None:
        pytest.skip("CPU engine ops unavailable")
    for mod in (runner_mod, llama_mod):
        monkeypatch.setattr(mod, "engine_ops", lambda: None)
    slow = make(sharp_dir, "fp8")
    assert not slow.runner.paged_attention
    assert greedy(slow, PROMPTS, 16) == fp8_reference


@pytest.mark.parametrize("kind", KINDS)
def test_the_budget_buys_tokens_by_the_byte_ratio(tiny_model_dir, kind):
    auto = Engine(str(tiny_model_dir), kv_cache_memory="8MiB", kv_cache_dtype="auto").stats()
    quant = Engine(str(tiny_model_dir), kv_cache_memory="8MiB", kv_cache_dtype=kind).stats()
    head_dim = 16  # the tiny model: hidden 64 over 4 heads
    assert auto.kv_bytes_per_token == 2 * 2 * 2 * head_dim * 4  # K and V, 2 layers, 2 KV heads, fp32
    assert quant.kv_bytes_per_token == 2 * 2 * 2 * (head_dim + 4)  # one byte a value plus an fp32 scale
    ratio = quant.kv_capacity_tokens / auto.kv_capacity_tokens
    assert ratio == pytest.approx(head_dim * 4 / (head_dim + 4), rel=0.01) and ratio >= 1.8


def test_calibrated_checkpoint_scales_are_used(tmp_path, tokenizer_dir):
    """A checkpoint with compressed-tensors' kv_cache_scheme and self_attn.k_scale / v_scale: an fp8 cache stores
    every slot with those scales; an int8 cache (not what they were calibrated for) keeps dynamic ones."""
    folder = build_sharp_tiny_llama(tmp_path / "calibrated", tokenizer_dir)
    tensors = load_file(folder / "model.safetensors")
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.05 + i)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([0.03, 0.04])  # per KV head
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {}, "kv_cache_scheme": {
        "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}}
    (folder / "config.json").write_text(json.dumps(cfg))
    engine = make(folder, "fp8")
    out = greedy(engine, PROMPTS[:2], 4)
    assert all(len(o) == 4 for o in out)
    used = engine.runner.kv_scales[1, :, 1:]  # layer 1, K and V, blocks past the first
    assert used[0][used[0] > 0].unique().tolist() == pytest.approx([1.05])
    assert used[1][used[1] > 0].unique().tolist() == pytest.approx([0.03, 0.04])
    int8 = make(folder, "int8")
    greedy(int8, PROMPTS[:1], 2)
    assert int8.model.layers[0].attn.kv_static is None and len(int8.runner.kv_scales.unique()) > 3


def test_bad_kv_cache_dtype_is_refused():
    with pytest.raises(EngineInputError, match="kv_cache_dtype 'fp4' is unknown") as e:
        EngineConfig(kv_cache_dtype="fp4")
    assert "\n" not in str(e.value)
    assert EngineConfig(kv_cache_dtype="fp8").to_cli_args()[2:4] == ["--kv-cache-dtype", "fp8"]


@pytest.mark.parametrize("argv", [["generate", "--prompt", "hi", "--kv-cache-dtype", "fp4"],
                                  ["serve", "--kv-cache-dtype", "FP8"],
                                  ["eval", "--model", "default", "--baseline", "default", "--kv-cache-dtype", "e5m2"]])
def test_bad_kv_cache_dtype_flag_is_one_cli_error(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is unknown" in err and "fp8" in err


def test_long_workload_has_distinct_2k_token_documents():
    from qtoolkit.bench.workloads import build_workload

    requests = build_workload("long", 8, seed=1)
    assert {r.kind for r in requests} == {"long"} and len({r.prompt for r in requests}) == 8
    assert all(len(r.prompt) >= 10000 for r in requests)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["fp8-dynamic-kv8", "int4-gptq-kv8"])
def test_fp8_kv_recipe_checkpoint_serves_with_its_calibrated_scales(recipe, tiny_model_dir, tmp_path):
    """qtool quantize with a shipped KV recipe writes kv_cache_scheme into the config and self_attn.k_scale /
    v_scale into the weights (where vLLM reads them); the engine's fp8 cache then stores every slot with those
    scales."""
    out = tmp_path / recipe
    assert main(["quantize", "--model", str(tiny_model_dir), "--recipe", recipe, "--output", str(out),
                 "--no-verify", "--num-samples", "4"]) == 0
    scheme = json.loads((out / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]
    assert (scheme["num_bits"], scheme["type"], scheme["strategy"], scheme["dynamic"]) == (8, "float", "tensor", False)
    tensors = load_file(out / "model.safetensors")
    k_scale = tensors["model.layers.1.self_attn.k_scale"].float()
    engine = Engine(str(out), kv_cache_memory="4MiB", block_size=4, kv_cache_dtype="fp8")
    assert all(len(o) == 6 for o in greedy(engine, PROMPTS[:2], 6))
    static = engine.model.layers[1].attn.kv_static
    assert static is not None and torch.equal(static.k, k_scale.expand(2))
    used = engine.runner.kv_scales[1, 0]
    assert used[used > 0].unique().tolist() == pytest.approx(k_scale.tolist())
