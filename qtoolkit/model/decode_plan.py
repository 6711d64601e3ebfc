"""The decoder's layer loop for decode and verify steps as one C++ call (kernels/cpu_decode.cpp DecodePlan).

At batch 1 the Python loop costs ~9 interpreter round trips per layer (~270 per step on the default model) on
top of the kernels. A plan binds each layer's norms, KV cache and Linear kernels (chosen by
kernels/dispatch.gemv_spec, the one dispatch point) once, and runs all layers in C++ with the GIL released.
The plan calls the same kernels in the same order as the Python loop, so its outputs are identical.

A model gets a plan only when every layer has the plain LLaMA shape the loop implements: fp32 activations on the
CPU, an fp32 KV cache or a quantized one (FP8 E4M3 / int8 with a scale per token and KV head, calibrated scales
included: the quantized caches' ops, rope_and_cache_quant and the scaled paged attention), pre-norm RMSNorm (not
Gemma's 1 + w), no q/k norm, no sandwich norms, a dense SwiGLU MLP, and every Linear a single AVX2 kernel call. Anything else (and prefill, and rows beyond the GEMV limits) keeps the
Python loop. EAGLE-3's taps (the residual stream entering chosen layers) are taken inside the C++ loop. QTOOLKIT_FUSED_DECODE=0 turns plans off (for A/B measurements).

A single row (a batch-1 decode step) takes the plan's single-row path when every Linear is an R8 INT4 / INT8 /
FP8 or fp32 GEMV (FP8 dynamic and W8A8 Linears quantize each thread's copy of the row per token first, with
fake_quant_tokens' operations): all layers in one parallel region, each thread a fixed share of every GEMV, barriers only where
an op needs every thread's rows (kernels/cpu_decode.cpp). QTOOLKIT_ROW_PATH=0 keeps single rows on the batched
path (for A/B measurements); both give the same bits.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from qtoolkit.kernels.cpu_build import engine_ops, fused_decode
from qtoolkit.kernels.dispatch import GemvSpec, gemv_spec


@dataclass
class DecodePlan:
    """A bound C++ plan and what it is valid for."""

    plan: object  # cpu_decode.DecodePlan
    max_rows: int  # the fewest rows any of its Linears' GEMV kernels take (dispatch thresholds)
    cache_key: tuple[int, ...]  # data pointers of the KV caches it was bound to


def switched_on(variable: str) -> bool:
    """An A/B switch of the decode loop, on unless the variable is "0": QTOOLKIT_FUSED_DECODE (the C++ loop),
    QTOOLKIT_ROW_PATH (its single-row path), QTOOLKIT_ADAPTIVE_TEAM (RowTeam in kernels/cpu_decode.cpp: one thread
    while other processes hold the cores)."""
    return os.environ.get(variable, "1") != "0"


def enabled() -> bool:
    return switched_on("QTOOLKIT_FUSED_DECODE")


# what the norms are asked about: the plan's activations are fp32 (build_plan checks the model's dtype)
FP32_ACTIVATIONS = torch.empty(0)
# the cache as kernels/cpu_decode.cpp's kv codes name it
KV_CODES = {None: 0, "fp8": 1, "int8": 2}


def cache_key(model) -> tuple[int, ...]:
    """What a plan is bound to: the caches, their scales, and the calibrated scales a runner chose for them."""
    first = model.layers[0].attn
    static = first.kv_static
    return (first.k_cache.data_ptr(), first.v_cache.data_ptr(), first.k_scales.data_ptr(),
            0 if static is None else static.k.data_ptr())


def _linear_parts(spec: GemvSpec) -> tuple[list[torch.Tensor], list[int]]:
    bias = spec.bias if spec.bias is not None else torch.empty(0)
    return [spec.weight, spec.scales, spec.zeros, bias], [spec.kind, spec.group, int(spec.bias is not None),
                                                          spec.act]


def _layer_parts(model, i: int) -> tuple[list[torch.Tensor], list[int], int] | None:
    """One layer's tensors and ints in DecodePlan's order, and its row limit; None when it does not fit."""
    layer = model.layers[i]
    attn, mlp = layer.attn, layer.mlp
    if (attn.q_norm is not None or layer.attn_out_norm is not None or layer.mlp_out_norm is not None
            or not hasattr(mlp, "gate_up_proj") or mlp.act is not None or attn.kv_kind not in KV_CODES
            or (attn.kv_kind is None and attn.k_cache.dtype != torch.float32) or attn.k_cache.is_cuda):
        return None
    norms = [n.fused_weight(FP32_ACTIVATIONS) for n in (layer.input_norm, layer.post_attn_norm)]
    if any(w is None or w is not n.weight for w, n in zip(norms, (layer.input_norm, layer.post_attn_norm),
                                                          strict=True)):
        return None  # Gemma's (1 + w) norms stay in Python
    specs = [gemv_spec(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    if any(s is None for s in specs):
        return None
    tensors = [*norms, attn.k_cache, attn.v_cache]
    ints = [model.rope_index[i], attn.window or 0]
    for spec in specs:
        t, n = _linear_parts(spec)
        tensors += t
        ints += n
    tensors += _cache_scales(attn)
    ints.append(KV_CODES[attn.kv_kind])
    return tensors, ints, min(s.max_rows for s in specs)


def _cache_scales(attn) -> list[torch.Tensor]:
    """k_scales, v_scales, k_static, v_static of a layer's cache (empty where it has none)."""
    none = torch.empty(0)
    if attn.kv_kind is None:
        return [none] * 4
    static = attn.kv_static
    fixed = [none, none] if static is None else [static.k.float().contiguous(), static.v.float().contiguous()]
    return [attn.k_scales, attn.v_scales, *fixed]


def build_plan(model) -> DecodePlan | None:
    """A plan over all of `model`'s layers, or None when the model or this machine cannot run one."""
    c = model.config
    if (not enabled() or model.dtype != torch.float32 or c.qk_norm or c.sandwich_norms or c.unit_offset_norm
            or engine_ops() is None or not len(model.layers) or model.layers[0].attn.k_cache.numel() == 0):
        return None
    ext = fused_decode()
    if ext is None:
        return None
    tensors, ints, rows = [], [], []
    for i in range(len(model.layers)):
        parts = _layer_parts(model, i)
        if parts is None:
            return None
        tensors += parts[0]
        ints += parts[1]
        rows.append(parts[2])
    eps = {layer.input_norm.eps for layer in model.layers} | {layer.post_attn_norm.eps for layer in model.layers}
    scales = {layer.attn.scale for layer in model.layers}
    if len(eps) != 1 or len(scales) != 1:
        return None
    plan = ext.DecodePlan(tensors, ints, c.num_heads, c.num_kv_heads, eps.pop(), scales.pop())
    plan.row_path = plan.row_path and switched_on("QTOOLKIT_ROW_PATH")
    plan.adaptive_team = switched_on("QTOOLKIT_ADAPTIVE_TEAM")
    return DecodePlan(plan, min(rows), cache_key(model))
