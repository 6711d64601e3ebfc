"""EAGLE-3 heads as vLLM's `speculators` library writes them (`tests/data/speculators-eagle3/head`, written by
speculators 0.9.0 itself with `tests/data/speculators-eagle3/make.py`): the head's logits equal those
speculators' own forward gives on the same inputs; `qtool generate --speculative eagle3:DIR` with that head gives
the target's greedy text token for token; a head this engine cannot run as trained is refused in one line (exit 2)
naming what is different."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_llama
from safetensors.torch import load_file, save_file

from qtoolkit.cli import main
from qtoolkit.draft.format import load_head
from qtoolkit.draft.head import DraftKV
from qtoolkit.errors import DraftHeadError
from qtoolkit.model.llama import ModelConfig

DATA = Path(__file__).parent / "data" / "speculators-eagle3"
HEAD = DATA / "head"


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, tokenizer_dir) -> Path:
    """The target the head was written for: 4 layers of hidden size 16 over SmolLM2's vocabulary."""
    return build_tiny_llama(tmp_path_factory.mktemp("h16"), tokenizer_dir, hidden=16, layers=4, heads=2,
                            kv_heads=1, intermediate=32)


def target_config(folder: Path) -> ModelConfig:
    return ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))


@torch.inference_mode()
def test_logits_equal_speculators_own_forward(target_dir):
    """In float64 on both sides (speculators' own fp32 forward strays from float64 by 2e-4 on these values, this
    head's by 1e-6): a swapped norm, a missed rope or a mispaired embedding moves logits of unit scale by O(1)."""
    head = load_head(HEAD, target_config(target_dir), dtype=torch.float64)
    ref = load_file(str(DATA / "expected.safetensors"))
    assert head.embed_tokens is not None  # the head's own embeddings, as vLLM takes them when the file has them
    embeds = torch.nn.functional.embedding(ref["input_ids"], head.embed_tokens)
    kv = DraftKV.empty(head.config, dtype=torch.float64)
    _, logits = head.step(embeds, head.fuse(ref["aux"].double()), ref["positions"], kv)
    assert ref["logits"].dtype == torch.float64 and ref["logits"].abs().max() > 1
    torch.testing.assert_close(logits, ref["logits"], atol=1e-5, rtol=1e-5)
    # the draft vocabulary maps back to the ids speculators' t2d marks
    t2d = load_file(str(HEAD / "model.safetensors"))["t2d"]
    assert sorted(head.to_target(torch.arange(64)).tolist()) == t2d.nonzero().flatten().tolist()


def generate(model: Path, *extra: str) -> tuple[int, str, str]:
    return main(["generate", "--model", str(model), "--prompt", "def fibonacci(n):", "--temperature", "0",
                 "--max-tokens", "24", *extra])


def test_greedy_output_with_the_head_equals_the_targets_alone(target_dir, capsys):
    assert generate(target_dir) == 0
    plain = capsys.readouterr().out
    assert generate(target_dir, "--speculative", f"eagle3:{HEAD}", "--num-speculative-tokens", "3") == 0
    assert capsys.readouterr().out == plain and plain.strip()


def edited(tmp_path: Path, config=None, tensors=None) -> Path:
    folder = tmp_path / "head"
    shutil.copytree(HEAD, folder)
    if config is not None:
        cfg = json.loads((folder / "config.json").read_text())
        config(cfg)
        (folder / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        t = load_file(str(folder / "model.safetensors"))
        tensors(t)
        save_file(t, str(folder / "model.safetensors"))
    return folder


def _set(path: list[str], value):
    def edit(cfg):
        for key in path[:-1]:
            cfg = cfg[key]
        cfg[path[-1]] = value
    return edit


@pytest.mark.parametrize(("edit", "named"), [
    (_set(["norm_before_residual"], True), "norm_before_residual"),
    (_set(["norm_output"], True), "norm_output"),
    (_set(["speculators_model_type"], "dflash"), "'dflash'"),
    (_set(["transformer_layer_config", "num_hidden_layers"], 2), "2 decoder layers"),
    (_set(["transformer_layer_config", "model_type"], "qwen3"), "'qwen3'"),
    (_set(["transformer_layer_config", "rope_parameters"], {"rope_type": "yarn", "factor": 4.0}), "'yarn'"),
    (_set(["transformer_layer_config", "vocab_size"], 32000), "vocabulary of 32000"),
    (_set(["eagle_aux_hidden_state_layer_ids"], [1, 2, 9]), "aux layer ids"),
])
def test_a_head_it_cannot_run_is_refused_in_one_line(target_dir, tmp_path, capsys, edit, named):
    folder = edited(tmp_path, config=edit)
    assert generate(target_dir, "--speculative", f"eagle3:{folder}") == 2
    err = capsys.readouterr().err.strip()
    assert named in err and len(err.splitlines()) == 1, err


def test_missing_or_misshapen_tensors_are_refused(target_dir, tmp_path):
    folder = edited(tmp_path, tensors=lambda t: t.pop("layers.0.hidden_norm.weight"))
    with pytest.raises(DraftHeadError, match="midlayer.hidden_norm.weight"):
        load_head(folder, target_config(target_dir))
    folder = edited(tmp_path / "b", tensors=lambda t: t.update({"embed_tokens.weight": torch.zeros(10, 16)}))
    with pytest.raises(DraftHeadError, match="embed_tokens.weight has shape"):
        load_head(folder, target_config(target_dir))


def test_null_aux_layers_take_the_targets_default_taps_and_full_vocab_heads_need_no_maps(target_dir, tmp_path):
    def whole_vocab(t):
        t.pop("d2t"), t.pop("t2d")
        t["lm_head.weight"] = torch.zeros(49152, 16, dtype=t["lm_head.weight"].dtype)

    folder = edited(tmp_path, config=lambda c: c.update(eagle_aux_hidden_state_layer_ids=None,
                                                         draft_vocab_size=49152), tensors=whole_vocab)
    head = load_head(folder, target_config(target_dir))
    assert head.config.aux_layer_ids == (1, 2, 3)  # default_aux_layer_ids(4)
    assert torch.equal(head.to_target(torch.arange(49152)), torch.arange(49152))
