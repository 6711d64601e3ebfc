"""Shared fixtures: a tiny random LLaMA built locally (fast tests) and the real default model (slow tests)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("QTOOLKIT_QUIET", "1")


@pytest.fixture(scope="session")
def default_source():
    """The real SmolLM2-135M-Instruct, converted once into the qtoolkit cache."""
    from qtoolkit.model.sources import resolve_model

    return resolve_model("default")


@pytest.fixture(scope="session")
def tokenizer_dir(default_source) -> Path:
    return default_source.path


def build_tiny_llama(folder: Path, tokenizer_dir: Path, *, hidden: int = 64, layers: int = 2, heads: int = 4,
                     kv_heads: int = 2, intermediate: int = 128, seed: int = 0, tie: bool = True,
                     context: int = 2048) -> Path:
    """A random LLaMA with the default model's tokenizer (so prompts and chat templates are real)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=context, tie_word_embeddings=tie, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, rms_norm_eps=1e-5,
                      rope_theta=10000.0)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float().eval()
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer_dir) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), tokenizer_dir)
