"""Test support (not collected): a tiny random transformers model written as a GGUF file, as llama.cpp writes it.

This does by hand what llama.cpp's `convert_hf_to_gguf.py` does for these families (the llama.cpp tensor names
from gguf-py's TensorNameMap, the architecture's metadata keys, LLaMA's q/k row permutation, Gemma's norm weights
stored as 1 + w, experts stacked into `ffn_{gate,up,down}_exps`), because that script does not run from anything
on PyPI: the `gguf` wheel ships only gguf-py, llama-cpp-python's wheel ships no converter, and the
`convert_hf_to_gguf.py` vendored in llama-cpp-python's sdist imports a `conversion` package the sdist lacks
(`ModuleNotFoundError: No module named 'conversion'`). The tokenizer.* metadata is copied from the default model's
GGUF, whose tokenizer the tiny models share. Block types: F32, or any type gguf-py can quantize in Python
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; gguf-py 0.19 dequantizes the K-quants but cannot write them).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import MODEL_ARCH, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, get_tensor_name_map

from qtoolkit.sources import default_gguf_path

# transformers model_type -> the llama.cpp architecture convert_hf_to_gguf.py writes it as (Mistral and Mixtral
# are written as `llama`, Mixtral with stacked expert tensors)
ARCH = {"llama": MODEL_ARCH.LLAMA, "mistral": MODEL_ARCH.LLAMA, "mixtral": MODEL_ARCH.LLAMA,
        "qwen2": MODEL_ARCH.QWEN2, "qwen3": MODEL_ARCH.QWEN3, "qwen3_moe": MODEL_ARCH.QWEN3MOE,
        "gemma3_text": MODEL_ARCH.GEMMA3}
FILE_TYPE = {GGMLQuantizationType.F32: gguf.LlamaFileType.ALL_F32, GGMLQuantizationType.Q8_0:
             gguf.LlamaFileType.MOSTLY_Q8_0, GGMLQuantizationType.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0,
             GGMLQuantizationType.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1, GGMLQuantizationType.Q5_0:
             gguf.LlamaFileType.MOSTLY_Q5_0, GGMLQuantizationType.Q5_1: gguf.LlamaFileType.MOSTLY_Q5_1}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: llama.cpp's rope pairs adjacent dims, HF's pairs halves."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensors(model, arch: MODEL_ARCH) -> dict[str, np.ndarray]:
    """HF state dict -> {llama.cpp tensor name: fp32 array} the way convert_hf_to_gguf.py maps it."""
    cfg = model.config
    names = get_tensor_name_map(arch, cfg.num_hidden_layers)
    out: dict[str, np.ndarray] = {}
    for hf_name, t in model.state_dict().items():
        w = t.detach().float().numpy()
        base, _, suffix = hf_name.rpartition(".")
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: llama.cpp writes no output.weight, which is how transformers detects the tie
        if base.endswith("experts") and suffix in ("gate_up_proj", "down_proj"):  # transformers 5's fused experts
            blk = f"blk.{hf_name.split('.layers.')[1].split('.')[0]}"
            if suffix == "down_proj":
                out[f"{blk}.ffn_down_exps.weight"] = w
            else:
                half = w.shape[1] // 2
                out[f"{blk}.ffn_gate_exps.weight"], out[f"{blk}.ffn_up_exps.weight"] = w[:, :half], w[:, half:]
            continue
        gguf_name = names.get_name(base)
        if gguf_name is None:
            raise KeyError(f"gguf-py has no llama.cpp name for {hf_name} ({arch.name})")
        if arch == MODEL_ARCH.LLAMA and base.endswith("self_attn.q_proj"):
            w = _permute(w, cfg.num_attention_heads)
        elif arch == MODEL_ARCH.LLAMA and base.endswith("self_attn.k_proj"):
            w = _permute(w, cfg.num_key_value_heads)
        if arch == MODEL_ARCH.GEMMA3 and hf_name.endswith("norm.weight"):
            w = w + 1.0
        out[f"{gguf_name}.{suffix}"] = np.ascontiguousarray(w)
    return out


def _rope_theta(cfg) -> float:
    rp = getattr(cfg, "rope_parameters", None) or {}
    if "full_attention" in rp:  # Gemma 3: the global layers' base is the one llama.cpp stores
        rp = rp["full_attention"]
    return float(rp.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


def _metadata(w: GGUFWriter, cfg, arch: MODEL_ARCH) -> None:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(_rope_theta(cfg))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if arch == MODEL_ARCH.LLAMA:
        w.add_rope_dimension_count(head_dim)
        w.add_vocab_size(cfg.vocab_size)
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if getattr(cfg, "moe_intermediate_size", None):
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == MODEL_ARCH.GEMMA3:
        w.add_sliding_window(cfg.sliding_window)


def _copy_tokenizer(w: GGUFWriter) -> None:
    reader = GGUFReader(default_gguf_path())
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), vtype, sub_type=sub)


def write_gguf(model, path: Path, qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
               name: str = "tiny") -> Path:
    """Write `model` (a transformers CausalLM) to `path` with its matrices in `qtype` blocks (1-D tensors and
    rows whose length is not a multiple of the block stay F32, as llama.cpp keeps them)."""
    model_type = model.config.model_type
    arch = ARCH[model_type]
    w = GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_name(name)
    w.add_file_type(FILE_TYPE[qtype])
    _metadata(w, model.config, arch)
    _copy_tokenizer(w)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    for tname, arr in _tensors(model, arch).items():
        if qtype != GGMLQuantizationType.F32 and arr.ndim >= 2 and arr.shape[-1] % block == 0:
            w.add_tensor(tname, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(tname, arr.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def build_model(family: str, tokenizer_dir: Path, **overrides):
    """A tiny random model of `family` from the test suites' config builders (test_families_attn,
    test_families_moe), `overrides` set on its config, weights scaled as those builders scale them."""
    from test_families_attn import _config
    from test_families_moe import family_config
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = family_config(family, tok) if family in ("qwen3", "qwen3_moe", "mixtral") else _config(family, len(tok), tok)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(10.0)
            elif "norm" in pname:
                p.copy_(torch.randn_like(p) * 0.3 + (0.0 if family == "gemma3_text" else 1.0))
    return model, tok


def llama_quantize(src: Path, dst: Path, ftype_name: str = "Q4_K_M") -> set[str]:
    """Requantize an F32 GGUF with llama.cpp's own llama-quantize (llama-cpp-python's binding), which writes
    the K-quant blocks gguf-py cannot; returns the block types of the written file's tensors."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = 1
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name}")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src}) returned {rc}")
    return {t.tensor_type.name for t in GGUFReader(dst).tensors}
