"""GGUF files of every engine family, written from tiny random models as llama.cpp writes them
(tests/gguf_files.py), loaded as a user loads one (`qtool generate --model FILE.gguf --temperature 0`): the text
equals transformers' greedy `generate` on the original model (its own config) holding the weights the file's
blocks dequantize to, and for F32 files the original weights exactly. What transformers' GGUF reader cannot
carry (Mixtral's experts) is refused in one line. The fast tests check qtoolkit/model/gguf_config.py's reading."""

from __future__ import annotations

import math
import re

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_files import BLOCKS, FAMILIES, build_model, write_case, write_gguf

from qtoolkit.cli import main
from qtoolkit.errors import ModelSourceError
from qtoolkit.model.gguf_config import _llama_cpp_factors, gguf_configs, llama3_rope
from qtoolkit.model.llama import rope_inv_freq
from qtoolkit.model.sources import cache_dir, resolve_model

SHORT = "The quick brown fox"  # inside every window below
LONG = ("def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n\nclass Stack:\n"
        "    def __init__(self):\n        self.items = []")  # past every window (16 for Mistral, 12 for Gemma 3)
NEW = 8


@pytest.fixture
def fresh_cache(tmp_path, tokenizer_dir, monkeypatch):
    """Conversions into a private cache, so each run converts with today's code (the cache is keyed by the file's
    hash and these files are the same every run); the engine's C++ ops live elsewhere and are not rebuilt."""
    monkeypatch.setenv("QTOOLKIT_CACHE", str(tmp_path / "cache"))
    return tmp_path


def reference_texts(model, src) -> list[str]:
    """transformers' greedy text on the original model's config with the converted (dequantized) weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref = AutoModelForCausalLM.from_pretrained(src.path, config=model.config, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(src.path)
    out = []
    for prompt in (SHORT, LONG):
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = ref.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=src.config["eos_token_id"],
                               pad_token_id=src.config["eos_token_id"])
        out.append(tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True))
    return out, ref


def f32_weights_equal(model, ref) -> bool:
    """The converted weights are the original's; Gemma's norm weights within float32 rounding, as llama.cpp
    stores them as (1 + w) and transformers' reader subtracts the 1."""
    orig = model.state_dict()
    gemma = model.config.model_type == "gemma3_text"
    return all(torch.allclose(v, orig[k], rtol=0, atol=1e-7) if gemma and k.endswith("norm.weight")
               else torch.equal(v, orig[k]) for k, v in ref.state_dict().items())


def cli_texts(path, capsys) -> list[str]:
    assert main(["generate", "--model", str(path), "--prompt", SHORT, "--prompt", LONG, "--temperature", "0",
                 "--max-tokens", str(NEW), "--kv-cache-memory", "8MiB"]) == 0
    texts = re.split(r"^=== \[\d+\] \(.*\)\n", capsys.readouterr().out, flags=re.M)[1:]
    return [t.removesuffix("\n") for t in texts]


# every family in F32 and in llama-quantize's K-quants, F16 and Q8_0 on two (the bar script runs all 24 cells)
CELLS = [(f, b) for f in FAMILIES for b in ("F32", "Q4_K_M")] + [(f, b) for f in ("llama3", "qwen3_moe")
                                                                 for b in ("F16", "Q8_0")]
assert {b for _, b in CELLS} == set(BLOCKS)


@pytest.mark.slow  # seconds a case: the files carry a 2048-token vocabulary
@pytest.mark.parametrize("family, block", CELLS)
def test_gguf_generate_equals_transformers_on_the_original_model(family, block, fresh_cache, tokenizer_dir, capsys):
    if block == "Q4_K_M":
        pytest.importorskip("llama_cpp")
    model, path, kinds = write_case(family, block, fresh_cache, tokenizer_dir)
    if block == "Q4_K_M":
        assert {"Q4_K", "Q6_K"} <= kinds, kinds
    src = resolve_model(path)
    assert src.kind == "gguf" and src.config["model_type"] == model.config.model_type
    want, ref = reference_texts(model, src)
    if block == "F32":  # the file holds the model exactly
        assert f32_weights_equal(model, ref), family
    assert cli_texts(path, capsys) == want, (family, block)


@pytest.mark.parametrize("params", [  # many, one and no frequencies in the smoothed band
    {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    {"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 1.5, "original_max_position_embeddings": 300},
])
@pytest.mark.parametrize("dim", [16, 64, 128])
def test_llama3_rope_is_recovered_from_llama_cpps_rope_freqs(params, dim):
    params = {"rope_type": "llama3", "rope_theta": 500000.0, **params}
    factors = _llama_cpp_factors(params, dim)
    got = llama3_rope(factors, 500000.0, dim, None)
    assert isinstance(got["original_max_position_embeddings"], int)
    want = rope_inv_freq(dim, 500000.0, params)
    assert torch.allclose(rope_inv_freq(dim, 500000.0, got), want, rtol=1e-6, atol=0)
    stated = llama3_rope(factors, 500000.0, dim, params["original_max_position_embeddings"])
    assert torch.allclose(rope_inv_freq(dim, 500000.0, stated), want, rtol=1e-6, atol=0)
    if ((factors > 1 + 1e-5) & (factors < params["factor"] - 1e-5)).sum() >= 2:  # the band pins the parameters
        assert math.isclose(stated["low_freq_factor"], 1.0, rel_tol=1e-6)
        assert math.isclose(stated["high_freq_factor"], params["high_freq_factor"], rel_tol=1e-6)


def test_rope_freqs_that_are_not_llama3_are_refused():
    with pytest.raises(ValueError, match="not a Llama 3 rope"):
        llama3_rope(torch.linspace(1.0, 8.0, 32).numpy(), 500000.0, 64, None)


def test_gguf_config_reads_what_transformers_drops(tmp_path, tokenizer_dir):
    """transformers 5.17's key table reads Qwen3-MoE's head_dim as 128 and experts as 768 wide, and no Mistral
    window, no Llama 3 rope: qtoolkit reads them from the file."""
    moe, _ = build_model("qwen3_moe", tokenizer_dir, **FAMILIES["qwen3_moe"])
    cfg = gguf_configs(write_gguf(moe, tmp_path / "moe.gguf", tokenizer=False)).load
    assert (cfg.head_dim, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok) == (32, 32, 4, 2)
    mistral, _ = build_model("mistral", tokenizer_dir)
    configs = gguf_configs(write_gguf(mistral, tmp_path / "mistral.gguf", tokenizer=False))
    assert configs.load.model_type == "llama"
    assert (configs.save.model_type, configs.save.sliding_window) == ("mistral", 16)
    llama3, _ = build_model("llama3", tokenizer_dir)
    rope = gguf_configs(write_gguf(llama3, tmp_path / "llama3.gguf", tokenizer=False)).load.rope_parameters
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0


def test_a_mixtral_gguf_is_refused_in_one_line(fresh_cache, tokenizer_dir, capsys):
    """llama.cpp writes Mixtral as `llama` with ffn_*_exps tensors, which transformers' reader maps to nothing."""
    model, _ = build_model("mixtral", tokenizer_dir)
    path = write_gguf(model, fresh_cache / "refused-mixtral.gguf", Q.F32, tokenizer=False)
    with pytest.raises(ModelSourceError, match="Mixtral") as err:
        resolve_model(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value), err.value
    assert main(["generate", "--model", str(path), "--prompt", "hi", "--max-tokens", "2"]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
    assert not list((cache_dir() / "models").glob("refused-mixtral-*"))  # nothing half-written is cached
