"""GGUF files of every engine family, written from tiny random models as llama.cpp writes them
(tests/gguf_files.py), loaded as a user loads one (`--model FILE.gguf`): qtoolkit's greedy tokens equal
transformers' greedy `generate` on the model transformers reads from the same file, and for F32 files the
original model's; what transformers' GGUF reader cannot map is refused in one line, or (Mistral's window)
lost as the README says."""

from __future__ import annotations

import re

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_files import build_model, llama_quantize, write_gguf

from qtoolkit.cli import main
from qtoolkit.engine import Engine, SamplingParams
from qtoolkit.errors import ModelSourceError
from qtoolkit.sources import cache_dir, resolve_model

SHORT = "The quick brown fox"  # 4 tokens + 8 new: inside every window below
LONG = ("def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n\nclass Stack:\n"
        "    def __init__(self):\n        self.items = []")  # 44 tokens: past every window
NEW = 8
# Config fields transformers 5.17's GGUF reader does not read are set to the values it falls back to, so the file
# describes the whole model (real Qwen3 / Qwen3-MoE models have these values). Gemma 3 is not here: transformers'
# Gemma tokenizer converter needs SentencePiece scores, which the shared (BPE) tokenizer has none of.
CASES = {  # id -> (family, config overrides, block type)
    "llama": ("llama3", {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}, Q.F32),
    "qwen3": ("qwen3", {"head_dim": 128}, Q.F32),
    "qwen3-q8_0": ("qwen3", {"head_dim": 128}, Q.Q8_0),
    "qwen3_moe": ("qwen3_moe", {"moe_intermediate_size": 768, "norm_topk_prob": True, "mlp_only_layers": []},
                  Q.F32),
}


@pytest.fixture
def cache(tmp_path):
    """Where the GGUF files go; their conversions land in the qtoolkit cache as a user's do (a private
    QTOOLKIT_CACHE would also rebuild the engine's C++ ops, minutes, in every test)."""
    return tmp_path


def hf_greedy(model, tok, prompt: str, to_eos: bool = False) -> list[int]:
    ids = tok(prompt, return_tensors="pt").input_ids
    least = 0 if to_eos else NEW
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW, min_new_tokens=least, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def engine_greedy(folder, prompts: list[str]) -> list[list[int]]:
    engine = Engine(str(folder), kv_cache_memory=8 << 20, block_size=4)
    params = [SamplingParams(max_tokens=NEW, ignore_eos=True) for _ in prompts]
    return [o.token_ids for o in engine.generate(prompts, params, use_tqdm=False)]


def from_gguf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.mark.slow  # about a minute a case: transformers rebuilds the 49k-token tokenizer from each file
@pytest.mark.parametrize("case", list(CASES))
def test_gguf_greedy_equals_transformers_reading_the_same_file(case, cache, tokenizer_dir):
    family, overrides, qtype = CASES[case]
    model, tok = build_model(family, tokenizer_dir, **overrides)
    path = write_gguf(model, cache / f"{case}.gguf", qtype)
    src = resolve_model(path)
    assert src.kind == "gguf" and src.config["model_type"] == model.config.model_type
    hf = from_gguf(path)
    got = engine_greedy(src.path, [SHORT, LONG])
    assert got == [hf_greedy(hf, tok, p) for p in (SHORT, LONG)], case
    if qtype == Q.F32:  # the F32 file holds the model exactly: the original's tokens too
        assert got == [hf_greedy(model, tok, p) for p in (SHORT, LONG)], case


@pytest.mark.slow
def test_qtool_generate_on_a_q8_0_gguf_through_the_cli(cache, tokenizer_dir, capsys):
    model, tok = build_model("qwen3", tokenizer_dir, head_dim=128)
    path = write_gguf(model, cache / "qwen3-q8.gguf", Q.Q8_0)
    hf = from_gguf(path)
    assert main(["generate", "--model", str(path), "--prompt", SHORT, "--prompt", LONG, "--temperature", "0",
                 "--max-tokens", str(NEW), "--kv-cache-memory", "8MiB"]) == 0
    texts = re.split(r"^=== \[\d+\] \(.*\)\n", capsys.readouterr().out, flags=re.M)[1:]
    want = [tok.decode(hf_greedy(hf, tok, p, to_eos=True), skip_special_tokens=True) for p in (SHORT, LONG)]
    assert [t.removesuffix("\n") for t in texts] == want


@pytest.mark.slow
def test_mistral_gguf_loads_as_llama_and_its_window_is_lost(cache, tokenizer_dir):
    """llama.cpp writes Mistral as `llama` with no window key transformers reads: the file loads as a LLaMA that
    attends to every position, as transformers runs it; within the window it is the original model."""
    model, tok = build_model("mistral", tokenizer_dir)  # sliding_window 16
    assert model.config.sliding_window == 16
    path = write_gguf(model, cache / "mistral.gguf", Q.F32, name="Mistral tiny")
    src = resolve_model(path)
    assert src.config["model_type"] == "llama" and not src.config.get("sliding_window")
    hf = from_gguf(path)
    got = engine_greedy(src.path, [SHORT, LONG])
    assert got == [hf_greedy(hf, tok, p) for p in (SHORT, LONG)]
    assert got[0] == hf_greedy(model, tok, SHORT)  # 12 positions: the window never binds


@pytest.mark.slow
@pytest.mark.parametrize("family, overrides, lost", [
    ("mixtral", {}, "experts"),  # llama arch with ffn_*_exps: transformers builds a dense LLaMA
    ("qwen3", {}, "head_dim"),  # head_dim 32 != Qwen3Config's 128: qwen3's mapping reads no key_length
    ("qwen3_moe", {"norm_topk_prob": True, "mlp_only_layers": []}, "moe_intermediate_size"),  # 32, read as 768
])
def test_a_gguf_transformers_cannot_map_is_refused_in_one_line(family, overrides, lost, cache, tokenizer_dir,
                                                               capsys):
    model, _ = build_model(family, tokenizer_dir, **overrides)
    path = write_gguf(model, cache / f"refused-{family}.gguf", Q.F32)
    with pytest.raises(ModelSourceError) as err:
        resolve_model(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value), err.value
    assert main(["generate", "--model", str(path), "--prompt", "hi", "--max-tokens", "2"]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
    assert not list((cache_dir() / "models").glob(f"refused-{family}-*"))  # nothing half-written is cached


@pytest.mark.slow
def test_k_quant_gguf_from_llama_quantize_equals_transformers(cache, tokenizer_dir):
    """Q4_K_M written by llama.cpp's llama-quantize (rows of 256, so the K-quant blocks apply) on a Qwen3 file."""
    pytest.importorskip("llama_cpp")
    model, tok = build_model("qwen3", tokenizer_dir, head_dim=128, hidden_size=256, intermediate_size=256,
                             tie_word_embeddings=True)
    f32 = write_gguf(model, cache / "qwen3-f32.gguf", Q.F32)
    kinds = llama_quantize(f32, cache / "qwen3-q4_k_m.gguf", "Q4_K_M")
    assert {"Q4_K", "Q6_K"} <= kinds, kinds
    path = cache / "qwen3-q4_k_m.gguf"
    hf = from_gguf(path)
    assert engine_greedy(resolve_model(path).path, [SHORT, LONG]) == [hf_greedy(hf, tok, p) for p in (SHORT, LONG)]
