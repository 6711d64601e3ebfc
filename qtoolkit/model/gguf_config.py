"""The config a GGUF file describes, where transformers' GGUF reader drops or mis-sizes fields.

transformers (5.17) builds a config from a GGUF's metadata through a fixed key table that leaves out what
llama.cpp stores elsewhere: `{arch}.attention.key_length` (Qwen3's head_dim falls back to 128), the MoE sizes
(`expert_feed_forward_length`, `expert_count`, `expert_used_count`), `attention.sliding_window` on a `llama`
file (Mistral), `rope.scaling.*`, and Llama 3's rope scaling, which llama.cpp's converter stores as the
per-frequency `rope_freqs.weight` tensor. `gguf_config` reads those from the file itself (gguf-py's reader) and
returns the config to load the weights with and the config to save; a file whose model transformers' reader
cannot carry (Mixtral's experts, rope kinds the engine lacks) is refused in one line before any conversion.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from transformers import AutoConfig, PretrainedConfig

from ..errors import ModelSourceError


@dataclass
class GGUFConfigs:
    load: PretrainedConfig  # the class transformers' reader maps the tensors for, with the corrected sizes
    save: PretrainedConfig  # the model the file describes (Mistral where a `llama` file carries a window)


def _fields(reader: GGUFReader) -> dict[str, object]:
    return {key: f.contents() for key, f in reader.fields.items() if not key.startswith(("tokenizer.", "GGUF."))}


def _f32(v: float) -> float:
    """The float a GGUF float32 stores, as the shortest decimal that reads back to it (1e-06, not 9.99e-07)."""
    return float(np.format_float_scientific(np.float32(v), unique=True))


def llama3_rope(factors: np.ndarray, theta: float, dim: int, original: int | None) -> dict[str, float] | None:
    """Llama 3 rope parameters that reproduce llama.cpp's `rope_freqs.weight` (factor per frequency). Only
    ratios of (original context, low, high) are determined by the factors, so low is fixed at 1 (then scaled
    to `original` when the file states it); returns None for all-ones factors (no scaling)."""
    factors = factors.astype(np.float64)
    factor = float(factors.max())
    if factor <= 1.0 + 1e-6:
        return None
    wl = 2 * math.pi * theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    short, long = np.isclose(factors, 1.0, rtol=1e-5), np.isclose(factors, factor, rtol=1e-5)
    mid = ~short & ~long
    s = (1 / factors[mid] - 1 / factor) / (1 - 1 / factor)  # smooth = (old / wl - low) / (high - low)
    if mid.sum() >= 2:  # old / wl - (high - 1) * s = 1, least squares
        a = np.stack([1 / wl[mid], -s], axis=1)
        old, span = np.linalg.lstsq(a, np.ones(len(s)), rcond=None)[0]
        high = 1 + span
    else:  # 0 or 1 smoothed frequencies: choose thresholds that fall in the gaps between the wavelengths
        short_max = wl[short].max() if short.any() else 0.0
        long_min = wl[long].min() if long.any() else wl.max() * 4
        if mid.any():
            wm, sm, t = wl[mid][0], s[0], (long_min / wl[mid][0]) ** 0.5 - 1
            while True:
                old = wm * (1 + t)
                high = 1 + (old / wm - 1) / sm
                if old / high > short_max or t < 1e-9:
                    break
                t /= 2
        else:
            old = (max(short_max, 1e-9) * long_min) ** 0.5
            high = old / (max(short_max, 1e-9) * old) ** 0.5
    # scale to the stated original context, or to a whole one (transformers wants an integer there)
    target = int(original) if original else max(1, round(old))
    low, high, old = target / old, high * target / old, target
    params = {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": float(low),
              "high_freq_factor": float(high), "original_max_position_embeddings": old}
    if not np.allclose(_llama_cpp_factors(params, dim), factors, rtol=1e-4, atol=1e-6):
        raise ValueError("rope_freqs.weight is not a Llama 3 rope scaling")
    return params


def _llama_cpp_factors(p: dict[str, float], dim: int) -> np.ndarray:
    """The factors llama.cpp's converter (LlamaModel.generate_extra_tensors) writes for Llama 3 parameters."""
    freqs = 1.0 / (p["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    old, low, high, factor = (p["original_max_position_embeddings"], p["low_freq_factor"], p["high_freq_factor"],
                              p["factor"])
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out)


def _refuse(path: Path, why: str) -> ModelSourceError:
    return ModelSourceError(f"cannot load {path}: {why}: convert the Hugging Face folder instead")


def _rope(path: Path, d: dict, get, reader: GGUFReader) -> None:
    """Rope base, scaling and (Gemma 3) the local layers' base, in place in `d['rope_parameters']`."""
    rp = d.setdefault("rope_parameters", {}) or {}
    d["rope_parameters"] = rp
    full = rp["full_attention"] if "full_attention" in rp else rp
    if (base := get("rope.freq_base")) is not None:
        full["rope_theta"] = _f32(base)
    kind = get("rope.scaling.type")
    if kind == "linear":
        full.update(rope_type="linear", factor=_f32(get("rope.scaling.factor")))
    elif kind not in (None, "none"):
        raise _refuse(path, f"its rope scaling {kind!r} is not run by the engine (default, linear, llama3)")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        try:
            params = llama3_rope(np.asarray(freqs.data), full.get("rope_theta", 10000.0), d["head_dim"],
                                 get("rope.scaling.original_context_length"))
        except ValueError as e:
            raise _refuse(path, str(e)) from None
        if params:
            full.update(params)
    if "sliding_attention" in rp:  # Gemma 3: llama.cpp runs the local layers at base 10000 unless it says
        rp["sliding_attention"]["rope_theta"] = _f32(get("rope.freq_base_swa", 10000.0))


def gguf_configs(path: Path) -> GGUFConfigs:
    """transformers' config for the GGUF at `path`, with the fields its key table drops read from the file."""
    base = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    reader = GGUFReader(path)
    meta = _fields(reader)
    arch = str(meta["general.architecture"])

    def get(suffix: str, default=None):
        return meta.get(f"{arch}.{suffix}", default)

    d = base.to_dict()
    experts = get("expert_count")
    if arch == "llama" and experts:
        raise _refuse(path, f"a `llama` GGUF with {experts} experts (Mixtral): transformers' GGUF reader maps none "
                            "of its ffn_*_exps tensors")
    if (head_dim := get("attention.key_length")) is not None:
        if get("attention.value_length", head_dim) != head_dim:
            raise _refuse(path, "its key and value head sizes differ")
        d["head_dim"] = int(head_dim)
    d["head_dim"] = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
    if d["model_type"] == "qwen3_moe":  # llama.cpp's qwen3moe has experts in every layer
        d.update(num_experts=int(experts), num_experts_per_tok=int(get("expert_used_count")),
                 moe_intermediate_size=int(get("expert_feed_forward_length")), mlp_only_layers=[],
                 norm_topk_prob=bool(get("expert_weights_norm", True)))
    _rope(path, d, get, reader)
    if d["model_type"] == "gemma3_text":
        # llama.cpp's gemma3 scales queries by 1/sqrt(head size) (1/sqrt(hidden/heads) for the 62-layer 27B)
        # and makes every 6th layer global
        d["query_pre_attn_scalar"] = (d["hidden_size"] // d["num_attention_heads"] if d["num_hidden_layers"] == 62
                                      else d["head_dim"])
        d["layer_types"] = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                            for i in range(d["num_hidden_layers"])]
    d.pop("quantization_config", None)
    load = type(base).from_dict(d)
    window = get("attention.sliding_window")
    if arch == "llama" and window:  # Mistral: llama.cpp writes it as `llama`; the weights map as LLaMA's
        for k in ("attention_bias", "mlp_bias", "pretraining_tp", "model_type"):
            d.pop(k, None)
        save = AutoConfig.for_model("mistral", **{**d, "sliding_window": int(window),
                                                  "architectures": ["MistralForCausalLM"]})
        return GGUFConfigs(load, save)
    return GGUFConfigs(load, load)
