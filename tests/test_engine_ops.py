"""The engine's AVX2 step ops (kernels/cpu_engine_ops.cpp) against plain torch, and the model with and without them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import qtoolkit.kernels.dispatch as dispatch_mod
import torch
from qtoolkit.kernels import dispatch
from qtoolkit.kernels.cpu_build import engine_ops
from qtoolkit.kernels.reference import quantize_activations

import qtoolkit.engine.model_runner as runner_mod
import qtoolkit.model.llama as llama_mod
from qtoolkit.engine import Engine, SamplingParams
from qtoolkit.model.llama import apply_rope

ops = engine_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="CPU engine ops unavailable (no AVX2 or no compiler)")


def reference_attention(q, k_cache, v_cache, table, row_seq, row_last, scale, window=0):
    H, Hk = q.shape[1], k_cache.shape[2]
    bs = k_cache.shape[1]
    out = []
    for t in range(q.shape[0]):
        pos = torch.arange(max(0, int(row_last[t]) + 1 - window) if window else 0, int(row_last[t]) + 1)
        blocks = table[row_seq[t]][pos // bs]
        k = k_cache[blocks, pos % bs].float().repeat_interleave(H // Hk, dim=1)  # [L, H, D]
        v = v_cache[blocks, pos % bs].float().repeat_interleave(H // Hk, dim=1)
        p = (torch.einsum("hd,lhd->hl", q[t].float(), k) * scale).softmax(-1)
        out.append(torch.einsum("hl,lhd->hd", p, v).reshape(-1))
    return torch.stack(out)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("head_dim", [64, 12])  # 12: the scalar tail of the vector loops
def test_paged_attention_matches_reference(dtype, tol, head_dim):
    g = torch.Generator().manual_seed(0)
    H, Hk, bs, nb = 6, 2, 4, 40
    k_cache = torch.randn(nb, bs, Hk, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(nb, bs, Hk, head_dim, generator=g).to(dtype)
    table = torch.randperm(nb, generator=g)[:24].reshape(3, 8)  # three sequences, scattered blocks
    # one decode row, four verification rows of one sequence (each sees one more position), a first-token row
    rows = [(0, 9), (1, 27), (1, 28), (1, 29), (1, 30), (2, 0)]
    row_seq = torch.tensor([s for s, _ in rows])
    row_last = torch.tensor([p for _, p in rows])
    qkv = torch.randn(len(rows), H + 2 * Hk, head_dim, generator=g).to(dtype)
    q = qkv[:, :H]  # a strided view, as the model passes it
    got = ops.paged_attention(q, k_cache, v_cache, table, row_seq, row_last, head_dim ** -0.5)
    ref = reference_attention(q, k_cache, v_cache, table, row_seq, row_last, head_dim ** -0.5)
    assert got.shape == (len(rows), H * head_dim) and got.dtype == dtype
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [5, 1, 64])
def test_paged_attention_sliding_window(window):
    """A row sees only its last `window` positions (1: itself; 64: more than it has)."""
    g = torch.Generator().manual_seed(3)
    H, Hk, D, bs, nb = 4, 2, 16, 4, 24
    k_cache, v_cache = torch.randn(nb, bs, Hk, D, generator=g), torch.randn(nb, bs, Hk, D, generator=g)
    table = torch.randperm(nb, generator=g)[:16].reshape(2, 8)
    row_seq, row_last = torch.tensor([0, 1, 1, 1, 0]), torch.tensor([0, 17, 18, 19, 30])
    q = torch.randn(5, H, D, generator=g) * 3
    got = ops.paged_attention(q, k_cache, v_cache, table, row_seq, row_last, D ** -0.5, window)
    ref = reference_attention(q, k_cache, v_cache, table, row_seq, row_last, D ** -0.5, window)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    if window == 5:  # and it differs from full attention
        assert not torch.allclose(got, ops.paged_attention(q, k_cache, v_cache, table, row_seq, row_last, D ** -0.5))


def test_paged_attention_rejects_rows_past_the_block_table():
    k = torch.zeros(4, 4, 1, 8)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.paged_attention(torch.zeros(1, 1, 8), k, k, torch.zeros(1, 2, dtype=torch.long),
                            torch.zeros(1, dtype=torch.long), torch.tensor([8]), 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_cache_matches_torch(dtype):
    g = torch.Generator().manual_seed(2)
    T, H, Hk, D, nb, bs = 5, 6, 2, 16, 8, 4
    qkv = torch.randn(T, (H + 2 * Hk) * D, generator=g).to(dtype)
    angles = torch.rand(T, 1, D // 2, generator=g) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slots = torch.tensor([3, 17, 0, 30, 12])
    k_cache, v_cache = torch.zeros(nb, bs, Hk, D, dtype=dtype), torch.zeros(nb, bs, Hk, D, dtype=dtype)
    q = ops.rope_and_cache(qkv, cos, sin, k_cache, v_cache, slots, H, Hk)
    qk = apply_rope(qkv[:, :(H + Hk) * D].view(T, H + Hk, D), cos, sin)
    if dtype == torch.float32:  # the same products and sums, rounded the same way
        assert torch.equal(q, qk[:, :H]) and torch.equal(k_cache.view(-1, Hk, D)[slots], qk[:, H:])
    else:  # torch rounds every bf16 product; the op rounds once
        torch.testing.assert_close(q, qk[:, :H], atol=3e-2, rtol=2e-2)
        torch.testing.assert_close(k_cache.view(-1, Hk, D)[slots], qk[:, H:], atol=3e-2, rtol=2e-2)
    assert torch.equal(v_cache.view(-1, Hk, D)[slots], qkv[:, (H + Hk) * D:].view(T, Hk, D))
    assert k_cache.view(-1, Hk, D)[1].abs().sum() == 0  # nothing else written
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops.rope_and_cache(qkv, cos, sin, k_cache, v_cache, torch.tensor([0, 1, 2, 3, 32]), H, Hk)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_silu_mul_matches_torch(dtype, tol):
    gate_up = (torch.randn(3, 40, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    gate, up = gate_up.float().split(20, dim=-1)
    got = ops.silu_mul(gate_up)
    assert got.shape == (3, 20) and got.dtype == dtype
    torch.testing.assert_close(got.float(), torch.nn.functional.silu(gate) * up, atol=tol, rtol=tol)


@pytest.mark.parametrize("kind", ["float", "int"])
@pytest.mark.parametrize("width", [96, 101])  # the vector body alone, and with a scalar tail
def test_fake_quant_tokens_is_bit_identical_to_the_reference(kind, width):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(7, width, generator=g) * torch.logspace(-3, 3, 7).unsqueeze(1)  # tiny to large rows
    x[2] = 0.0  # the eps floor of the scale
    # a heavy-tailed row: most of it lands in E4M3's subnormal range, next to exact ties and signed zeros
    x[5] = torch.randn(width, generator=g) ** 5 * 0.01
    x[5, :4] = torch.tensor([-0.0, 1.0, 1.0625, -1.1875])
    q, scale = quantize_activations(x, kind)
    assert torch.equal(ops.fake_quant_tokens(x, kind == "float"), q.float() * scale)


def test_add_rms_norm_matches_torch():
    g = torch.Generator().manual_seed(1)
    x, r, w = torch.randn(5, 96, generator=g), torch.randn(5, 96, generator=g), torch.randn(96, generator=g)
    out, res = ops.add_rms_norm(x, r, w, 1e-6)
    s = x + r
    torch.testing.assert_close(res, s)
    torch.testing.assert_close(out, w * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)))
    out, res = ops.add_rms_norm(x, None, w, 1e-6)
    assert res.data_ptr() == x.data_ptr()  # no residual yet: x is the residual, not a copy
    torch.testing.assert_close(out, w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)))


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 33, 70])  # every branch of dispatch.cpu_dense
@pytest.mark.parametrize("k", [24, 48])  # bf16: 48 takes the 16-wide unpack kernel, 24 the 8-wide one
def test_dense_linear_paths_match_matmul(wdtype, m, k):
    g = torch.Generator().manual_seed(m)
    w = torch.randn(40, k, generator=g).to(wdtype)
    x = torch.randn(m, k, generator=g)
    got = dispatch.cpu_dense(x, w)
    assert got.shape == (m, 40) and got.is_contiguous()
    torch.testing.assert_close(got, x @ w.float().t(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("k", [48, 576, 1536])
def test_dense_rows_take_the_same_lanes_alone_and_in_a_batch(k):
    """The fp32 GEMV's AVX-512 rows sum in other lanes than the AVX2 ones, so the choice is per weight: a row
    decoded alone equals its row in a batch of any size, bit for bit, under either instruction set."""
    g = torch.Generator().manual_seed(k)
    w, x = torch.randn(72, k, generator=g), torch.randn(9, k, generator=g)
    isas = [0, 1] if ops.dense_avx512(k) else [0]
    results = {}
    for isa in isas:
        batch = ops.dense_gemv(x, w, isa)
        for m in range(9):
            assert torch.equal(ops.dense_gemv(x[m:m + 1], w, isa), batch[m:m + 1])
        torch.testing.assert_close(batch, (x.double() @ w.double().t()).float(), atol=1e-4, rtol=1e-5)
        results[isa] = batch
    assert torch.equal(ops.dense_gemv(x, w), results[isas[-1]])  # auto takes AVX-512 wherever it is allowed


def test_dense_avx512_rows_refused_where_they_cannot_run():
    with pytest.raises(RuntimeError, match="K % 16 == 0"):
        ops.dense_gemv(torch.randn(1, 24), torch.randn(8, 24), 1)
    with pytest.raises(RuntimeError, match="isa must be"):
        ops.dense_gemv(torch.randn(1, 48), torch.randn(8, 48), 2)
    assert not ops.dense_avx512(24)


@pytest.mark.parametrize("cap", [None, "avx2", "default"])
def test_dense_isa_is_chosen_at_run_time(cap):
    """AVX-512 rows only where the CPU reports AVX-512 F, the OS saves its state (Linux then lists the flag) and
    ATEN_CPU_CAPABILITY does not hold torch to AVX2 or less: the same switch as the INT4 kernels' VNNI path."""
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    if not flags:
        pytest.skip("no /proc/cpuinfo")
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if cap:
        env["ATEN_CPU_CAPABILITY"] = cap
    probe = ("from qtoolkit.kernels.cpu_build import engine_ops; e = engine_ops(); "
             "print(e is not None and e.dense_avx512(576))")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str("avx512f" in flags and cap is None)]


def test_model_logits_same_with_and_without_ops(tiny_model_dir, monkeypatch):
    """The engine's step with the AVX2 ops equals its pure-torch path (padded SDPA, torch RMSNorm and matmuls)."""
    prompts = ["def add(a, b):", "The results show that the proposed method", "x"]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    fast = Engine(str(tiny_model_dir), kv_cache_memory="4MiB", block_size=4)
    assert fast.runner.paged_attention
    fast_scores = fast.score([fast.tokenizer.encode(p) for p in prompts])
    fast_out = [o.token_ids for o in fast.generate(prompts, params)]

    for mod in (runner_mod, llama_mod):
        monkeypatch.setattr(mod, "engine_ops", lambda: None)
    monkeypatch.setattr(dispatch_mod.cpu, "dense_fast_ok", lambda w: False)
    slow = Engine(str(tiny_model_dir), kv_cache_memory="4MiB", block_size=4)
    assert not slow.runner.paged_attention
    slow_scores = slow.score([slow.tokenizer.encode(p) for p in prompts])
    assert [o.token_ids for o in slow.generate(prompts, params)] == fast_out
    for a, b in zip(fast_scores, slow_scores, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
