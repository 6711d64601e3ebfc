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

import functools
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import MODEL_ARCH, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, get_tensor_name_map

from qtoolkit.model.gguf_config import _llama_cpp_factors
from qtoolkit.model.sources import default_gguf_path

# transformers model_type -> the llama.cpp architecture convert_hf_to_gguf.py writes it as (Mistral and Mixtral
# are written as `llama`, Mixtral with stacked expert tensors)
ARCH = {"llama": MODEL_ARCH.LLAMA, "mistral": MODEL_ARCH.LLAMA, "mixtral": MODEL_ARCH.LLAMA,
        "qwen2": MODEL_ARCH.QWEN2, "qwen3": MODEL_ARCH.QWEN3, "qwen3_moe": MODEL_ARCH.QWEN3MOE,
        "gemma3_text": MODEL_ARCH.GEMMA3}
VOCAB = 2048  # the default model's first 2048 tokens: its byte alphabet and commonest merges (_copy_tokenizer)
FILE_TYPE = {GGMLQuantizationType.F32: gguf.LlamaFileType.ALL_F32, GGMLQuantizationType.F16:
             gguf.LlamaFileType.MOSTLY_F16, GGMLQuantizationType.Q8_0:
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


def _rope(cfg) -> dict:
    rp = getattr(cfg, "rope_parameters", None) or {}
    if "full_attention" in rp:  # Gemma 3: the global layers' rope is the one llama.cpp stores
        rp = rp["full_attention"]
    return {"rope_theta": getattr(cfg, "rope_theta", 10000.0), **rp}


def _rope_freqs(cfg, head_dim: int) -> np.ndarray | None:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors: Llama 3 rope scaling as one factor per
    frequency (`rope_freqs.weight`); it reads the original context from the top-level config (8192 when absent),
    here from the rope parameters where transformers 5 keeps it."""
    rp = _rope(cfg)
    if rp.get("rope_type") != "llama3":
        return None
    # the one copy of llama.cpp's formula (qtoolkit.model.gguf_config), with llama.cpp's defaults for absent fields
    params = {"rope_theta": rp["rope_theta"],
              "original_max_position_embeddings": rp.get("original_max_position_embeddings", 8192),
              "low_freq_factor": rp.get("low_freq_factor", 1.0), "high_freq_factor": rp.get("high_freq_factor", 4.0),
              "factor": rp.get("factor", 8.0)}
    return _llama_cpp_factors(params, head_dim).astype(np.float32)


def _metadata(w: GGUFWriter, cfg, arch: MODEL_ARCH) -> None:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = _rope(cfg)
    w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
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
    if arch == MODEL_ARCH.GEMMA3 or (arch == MODEL_ARCH.LLAMA and getattr(cfg, "sliding_window", None)):
        w.add_sliding_window(cfg.sliding_window)  # Mistral's window: `llama.attention.sliding_window`


@functools.lru_cache(maxsize=1)
def _default_tokenizer_fields() -> dict[str, tuple]:
    reader = GGUFReader(default_gguf_path())
    return {k: (f.types[0], f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None, f.contents())
            for k, f in reader.fields.items() if k.startswith("tokenizer.")}


def _copy_tokenizer(w: GGUFWriter, vocab: int) -> None:
    """The default model's tokenizer.* metadata cut to its first `vocab` tokens (and the merges among them): the
    same byte-level BPE, small enough that transformers' per-element GGUF parsing takes a second, not ten."""
    fields = _default_tokenizer_fields()
    kept = set(fields["tokenizer.ggml.tokens"][2][:vocab])
    for key, (vtype, sub, value) in fields.items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            value = value[:vocab]
        elif key == "tokenizer.ggml.merges":
            value = [m for m in value if (pair := m.split(" ")) and all(p in kept for p in pair)
                     and "".join(pair) in kept]
        w.add_key_value(key, value, vtype, sub_type=sub)


def _gemma_tokenizer(w: GGUFWriter, vocab: int) -> None:
    """A SentencePiece-style vocabulary (tokenizer.ggml.model `llama`: pieces with scores, `▁` for spaces, byte
    pieces) as llama.cpp writes Gemma's: transformers' GGUF reader builds every gemma3 tokenizer as a Unigram
    from tokens and scores (GGUFGemmaConverter), so the BPE metadata above (no scores) cannot load as gemma3.
    Gemma's special ids: <pad> 0, <eos> 1, <bos> 2, <unk> 3. The pieces are the default model's BPE tokens
    decoded to text, scored by rank."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [3, 3, 3, 2] + [6] * 256
    seen = set(tokens)
    for tok in _default_tokenizer_fields()["tokenizer.ggml.tokens"][2][17:]:
        if len(tokens) == vocab:
            break
        try:
            piece = bytes(byte_of[c] for c in tok).decode("utf-8").replace(" ", "\u2581")
        except (KeyError, UnicodeDecodeError):
            continue
        if piece not in seen:
            seen.add(piece)
            tokens.append(piece)
            types.append(1)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 4 + [-1e4] * 256 + [-float(i) for i in range(len(tokens) - 260)])
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)


def write_gguf(model, path: Path, qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
               name: str = "tiny", tokenizer: bool = True) -> Path:
    """Write `model` (a transformers CausalLM) to `path` with its matrices in `qtype` blocks (1-D tensors and
    rows whose length is not a multiple of the block stay F32, as llama.cpp keeps them)."""
    model_type = model.config.model_type
    arch = ARCH[model_type]
    w = GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_name(name)
    w.add_file_type(FILE_TYPE[qtype])
    _metadata(w, model.config, arch)
    if not tokenizer:  # config-only checks: no tokenizer metadata to parse
        pass
    elif arch == MODEL_ARCH.GEMMA3:
        _gemma_tokenizer(w, model.config.vocab_size)
    else:
        _copy_tokenizer(w, model.config.vocab_size)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    tensors = _tensors(model, arch)
    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    if (freqs := _rope_freqs(model.config, head_dim)) is not None:
        tensors[gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"] = freqs
    for tname, arr in tensors.items():
        if qtype == GGMLQuantizationType.F16 and arr.ndim >= 2:
            w.add_tensor(tname, arr.astype(np.float16))
        elif qtype != GGMLQuantizationType.F32 and arr.ndim >= 2 and arr.shape[-1] % block == 0:
            w.add_tensor(tname, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(tname, arr.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@functools.lru_cache(maxsize=2)
def _tokenizer(tokenizer_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def build_model(family: str, tokenizer_dir: Path, **overrides):
    """A tiny random model of `family` from the test suites' config builders (test_families_attn,
    test_families_moe), `overrides` set on its config, weights scaled as those builders scale them."""
    from test_families_attn import _config
    from test_families_moe import family_config
    from transformers import AutoModelForCausalLM

    tok = _tokenizer(str(tokenizer_dir))
    cfg = family_config(family, tok) if family in ("qwen3", "qwen3_moe", "mixtral") else _config(family, len(tok), tok)
    # rebuilt from its fields so that derived ones (layer_types from use_sliding_window) follow the overrides
    fields = {k: v for k, v in cfg.to_dict().items() if k != "layer_types"}
    cfg = type(cfg).from_dict({**fields, "vocab_size": VOCAB, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() >= 2 and not (family == "gemma3_text" and "embed_tokens" in pname):
                p.mul_(10.0)  # (Gemma scales its embeddings by sqrt(hidden) itself: x10 more repeats one token)
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


# family -> the config llama.cpp's format can express for it (tiny random models of tests/test_families_*.py)
FAMILIES = {
    "llama3": {},  # llama3 rope scaling: written as rope_freqs.weight
    "qwen2": {"use_sliding_window": False},  # llama.cpp's qwen2 has no window layers
    "qwen3": {},  # head_dim 32 != hidden / heads
    "mistral": {},  # window 16: written as llama.attention.sliding_window
    # llama.cpp's gemma3: every 6th layer global, queries scaled by 1/sqrt(head_dim), local rope base 1e4
    "gemma3_text": {"num_hidden_layers": 6, "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
                    "query_pre_attn_scalar": 16, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0},
    # llama.cpp's qwen3moe: experts in every layer, the top-k weights renormalised
    "qwen3_moe": {"norm_topk_prob": True, "mlp_only_layers": []},
}
BLOCKS = ("F32", "F16", "Q8_0", "Q4_K_M")  # Q4_K_M: llama-quantize's mix of Q4_K and Q6_K blocks
K_SIZES = {"hidden_size": 256, "intermediate_size": 256}  # K-quant blocks cover rows of 256


def write_case(family: str, block: str, folder: Path, tokenizer_dir: Path):
    """(the tiny model, its GGUF file in `block` blocks, the block types the file holds)."""
    overrides = dict(FAMILIES[family])
    if block == "Q4_K_M":
        overrides.update(K_SIZES, **({"moe_intermediate_size": 256} if family == "qwen3_moe" else {}))
    model, _ = build_model(family, tokenizer_dir, **overrides)
    path = folder / f"{family}-{block.lower()}.gguf"
    if block == "Q4_K_M":
        f32 = write_gguf(model, folder / f"{family}-k-f32.gguf")
        kinds = llama_quantize(f32, path, block)
    else:
        write_gguf(model, path, getattr(GGMLQuantizationType, block))
        kinds = {t.tensor_type.name for t in GGUFReader(path).tensors}
    return model, path, kinds
