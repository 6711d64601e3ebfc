"""The C++ decode layer loop (kernels/cpu_decode.cpp via qtoolkit/model/decode_plan.py) against the Python loop:
the same kernels in the same order, so logits must be identical, for dense and quantized models, at batch 1,
in batches and on verification rows."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from qtoolkit.kernels import scheme as S
from qtoolkit.kernels.cpu_build import engine_ops, fused_decode

from qtoolkit.engine import Engine, SamplingParams
from qtoolkit.engine.model_runner import Chunk, ModelRunner
from qtoolkit.engine.speculative import self_draft
from qtoolkit.engine.speculative.self_draft import quantize_copy
from qtoolkit.model import decode_plan
from qtoolkit.model.kv_quant import StaticKVScales
from qtoolkit.model.loader import load_model
from qtoolkit.model.sources import resolve_model

pytestmark = pytest.mark.skipif(engine_ops() is None or fused_decode() is None,
                                reason="CPU decode extension unavailable (no AVX2 or no compiler)")

BLOCK = 4


# weight formats beyond the self-draft's two (int4, fp8 = FP8_DYNAMIC): FP8 weight-only and INT8 W8A8
EXTRA_SCHEMES = {"fp8-weight": S.fp8_weight_only(), "w8a8": S.w8a8_int()}


def _model(tiny_model_dir, kind: str, monkeypatch=None):
    model = load_model(resolve_model(str(tiny_model_dir)), "float32")
    if kind == "fp32":
        return model
    if kind in EXTRA_SCHEMES:
        monkeypatch.setitem(self_draft.SCHEMES, kind, EXTRA_SCHEMES[kind])
        monkeypatch.setitem(self_draft.HEAD_SCHEMES, kind, EXTRA_SCHEMES[kind])
    model = quantize_copy(model, kind.removesuffix("-bf16"))
    if kind.endswith("-bf16"):  # scales a bf16 checkpoint would have: the kernels read them as bf16
        for module in model.modules():
            if getattr(module, "kind", None) == "int4":
                module.scales.copy_(module.scales.bfloat16().float())
                module._bind_gemv()
                assert module.gemv_args[1].dtype == torch.bfloat16
    return model


def _steps(runner: ModelRunner) -> list[torch.Tensor]:
    """Two prefills, then decode steps at batch 1 and 2, and a batch mixing a decode row with 5 verify rows
    (with the residual stream entering layers 1 and 0 tapped, as EAGLE-3 asks)."""
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (9, 6)]
    tables = [list(range(0, 8)), list(range(8, 16))]
    logits = [runner.forward([Chunk(s, 0, t) for s, t in zip(seqs, tables, strict=True)])]
    for step in range(4):  # batch 1, then batch 2 from the second step on
        feeds = [Chunk([seqs[0][-1]], len(seqs[0]) - 1, tables[0])]
        if step:
            feeds.append(Chunk([seqs[1][-1]], len(seqs[1]) - 1, tables[1]))
        out = runner.forward(feeds)
        logits.append(out)
        for s, row in zip(seqs, out.argmax(-1).tolist(), strict=False):
            s.append(row)
    # verification-shaped feed: five new tokens of one sequence, every row gets logits, and EAGLE-3 taps
    verify = seqs[1][-1:] + [11, 12, 13, 14]
    out = runner.step([Chunk([seqs[0][-1]], len(seqs[0]) - 1, tables[0]),
                       Chunk(verify, len(seqs[1]) - 1, tables[1], num_logits=5)], aux_layers=(1, 0))
    # a single row with taps (an EAGLE-3 draft step at batch 1)
    one = runner.step([Chunk([seqs[0][-1]], len(seqs[0]) - 1, tables[0])], aux_layers=(0, 1))
    return [*logits, out.logits, *out.aux, one.logits, *one.aux]


@pytest.mark.parametrize(("kind", "row_path", "kv"), [
    ("fp32", True, "auto"), ("int4", True, "auto"), ("int4-bf16", True, "auto"), ("int4", False, "auto"),
    ("fp8", False, "auto"), ("int4", True, "fp8"), ("fp32", True, "int8"), ("int4", False, "fp8"),
    ("int4", True, "fp8-calibrated"), ("int4", False, "int8-calibrated"), ("fp8", True, "auto"),
    ("fp8", True, "fp8"), ("fp8-weight", True, "auto"), ("fp8-weight", False, "auto"), ("w8a8", True, "auto")])
def test_plan_logits_identical_to_python_loop(tiny_model_dir, kind, row_path, kv, monkeypatch):
    """fp32, INT4, FP8 (weight-only and dynamic) and W8A8 single rows take the one-parallel-region path (each
    thread quantizes its own copy of a row where the layer quantizes activations); QTOOLKIT_ROW_PATH=0 sends them
    through the batched path: every way gives the Python loop's bits, over an fp32 KV cache and over FP8 / int8
    caches with per-token or calibrated scales."""
    model = _model(tiny_model_dir, kind, monkeypatch)
    kv_dtype = kv.removesuffix("-calibrated")
    if kv.endswith("-calibrated"):  # a checkpoint's k_scale / v_scale for that cache (one per KV head)
        g = torch.Generator().manual_seed(1)
        for layer in model.layers:
            hk = layer.attn.num_kv_heads
            layer.attn.kv_calibrated = StaticKVScales(0.01 + torch.rand(hk, generator=g) / 50,
                                                      0.01 + torch.rand(hk, generator=g) / 50, kv_dtype)
    monkeypatch.setenv("QTOOLKIT_FUSED_DECODE", "0")
    slow = _steps(ModelRunner(model, 16, BLOCK, kv_dtype))
    assert model.decode_plan is False  # turned off: the Python loop ran every step
    monkeypatch.setenv("QTOOLKIT_FUSED_DECODE", "1")
    monkeypatch.setenv("QTOOLKIT_ROW_PATH", "1" if row_path else "0")
    model.decode_plan = None
    runner = ModelRunner(model, 16, BLOCK, kv_dtype)
    assert (model.layers[0].attn.kv_static is not None) == kv.endswith("-calibrated")
    fast = _steps(runner)
    plan = model.decode_plan
    assert isinstance(plan, decode_plan.DecodePlan) and plan.plan.num_layers == model.config.num_layers
    assert plan.plan.times()[0] > 0  # its GEMVs ran
    assert plan.plan.row_path is row_path
    for a, b in zip(slow, fast, strict=True):
        assert torch.equal(a, b)


def test_plan_rebinds_to_a_new_cache_and_skips_long_rows(tiny_model_dir):
    model = _model(tiny_model_dir, "fp32")
    first = ModelRunner(model, 16, BLOCK)
    _steps(first)
    old = model.decode_plan
    second = ModelRunner(model, 16, BLOCK)  # a new cache: the plan must write there, not into the old one
    ref = _steps(second)
    assert model.decode_plan is not old and model.decode_plan.cache_key == decode_plan.cache_key(model)
    assert torch.equal(ref[1], _steps(ModelRunner(model, 16, BLOCK))[1])
    assert model.decode_plan.max_rows == 16  # fp32 dense GEMV limit (kernels/dispatch.py)


def test_unsupported_shapes_keep_the_python_loop(tiny_model_dir):
    model = _model(tiny_model_dir, "fp32")
    ModelRunner(model, 16, BLOCK)
    gemma_like = dataclasses.replace(model.config, qk_norm=True)
    model.config, saved = gemma_like, model.config
    assert decode_plan.build_plan(model) is None
    model.config = saved
    model.layers[0].mlp.act = torch.nn.functional.gelu  # a GeGLU layer is not the loop's SwiGLU
    assert decode_plan.build_plan(model) is None


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_engine_generates_the_same_tokens_with_and_without_the_plan(tiny_model_dir, kv, monkeypatch):
    prompts = ["def add(a, b):", "The results show that", "x"]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    fast = Engine(str(tiny_model_dir), kv_cache_memory="4MiB", block_size=BLOCK, kv_cache_dtype=kv)
    fast_out = [o.token_ids for o in fast.generate(prompts, params, use_tqdm=False)]
    assert isinstance(fast.model.decode_plan, decode_plan.DecodePlan)
    monkeypatch.setenv("QTOOLKIT_FUSED_DECODE", "0")
    slow = Engine(str(tiny_model_dir), kv_cache_memory="4MiB", block_size=BLOCK, kv_cache_dtype=kv)
    assert [o.token_ids for o in slow.generate(prompts, params, use_tqdm=False)] == fast_out
    assert slow.model.decode_plan is False


def test_single_row_path_gives_the_same_bits_at_any_thread_count(tiny_model_dir, monkeypatch):
    """The row path gives each thread a fixed share of every GEMV's rows; the share changes with the thread count,
    the arithmetic of every output element does not (so RowTeam may change the team size mid-generation)."""
    monkeypatch.setenv("QTOOLKIT_ADAPTIVE_TEAM", "0")  # 3 threads on 2 cores would drop to one
    model = _model(tiny_model_dir, "int4")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _steps(ModelRunner(model, 16, BLOCK))
        assert model.decode_plan.plan.row_path
        torch.set_num_threads(3)  # more threads than cores, and an uneven split of 8-row groups
        three = _steps(ModelRunner(model, 16, BLOCK))
        assert not model.decode_plan.plan.adaptive_team and model.decode_plan.plan.row_team == 3
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, three, strict=True):
        assert torch.equal(a, b)


def _drive(team, full: int, seconds_at: dict[int, float], steps: int) -> list[int]:
    """The team sizes RowTeam picks over `steps` steps whose times depend on the team size only."""
    picked = []
    for _ in range(steps):
        size = team.pick(full)
        team.record(size, seconds_at[size])
        picked.append(size)
    return picked


def test_row_team_keeps_the_full_team_at_idle_and_drops_to_one_thread_under_load():
    team = fused_decode().RowTeam()
    idle = {2: 0.004, 1: 0.008}
    assert _drive(team, 2, idle, 100) == [2] * 100  # never a one-thread probe while the team runs at its best
    # another process takes a core: two threads now take 22 ms, one takes 8
    busy = {2: 0.022, 1: 0.008}
    picked = _drive(team, 2, busy, 64)
    assert picked[0] == 2 and picked[1] == 1 and picked.count(2) <= 1 + 64 // 16  # then only the periodic probes
    assert team.team == 1
    # the machine frees up: the periodic full-team probes bring the team back within a few of them
    picked = _drive(team, 2, idle, 96)
    assert picked[-16:] == [2] * 16 and team.team == 2


def test_row_team_stays_when_one_thread_is_no_faster_and_keeps_one_thread_runs_alone():
    team = fused_decode().RowTeam()
    _drive(team, 2, {2: 0.004, 1: 0.008}, 10)
    # slower, but one thread is slower still (a busy memory bus, not a busy core): one probe, then the full team
    picked = _drive(team, 4, {4: 0.004, 1: 0.008}, 5) + _drive(team, 4, {4: 0.010, 1: 0.030}, 40)
    assert picked.count(1) <= 40 // 16 + 1 and team.team == 4
    one = fused_decode().RowTeam()
    assert _drive(one, 1, {1: 0.008}, 5) == [1] * 5 and one.team == 1


def test_row_team_is_fixed_when_not_adaptive(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("QTOOLKIT_ADAPTIVE_TEAM", "0")
    model = _model(tiny_model_dir, "int4")
    _steps(ModelRunner(model, 16, BLOCK))
    assert model.decode_plan.plan.adaptive_team is False
    monkeypatch.delenv("QTOOLKIT_ADAPTIVE_TEAM")
    model = _model(tiny_model_dir, "int4")
    _steps(ModelRunner(model, 16, BLOCK))
    assert model.decode_plan.plan.adaptive_team is True
