"""The engine picks each Linear's config group exactly as compressed-tensors does, and reads group formats as vLLM.

compressed-tensors' `apply_quantization_config` (what llm-compressor runs, and what vLLM's loader mirrors) marks
the transformers modules of a tiny LLaMA; the engine's `config_group_for` sees only tensor names. The same
targets/ignore lists must select the same layers with the same group.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
from qtoolkit.kernels import scheme as S
from transformers import AutoModelForCausalLM

from qtoolkit.model.loader import config_group_for, load_model
from qtoolkit.model.sources import resolve_model
from qtoolkit.quantize.run import quantize

W = {"type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}


def _groups(*targets_per_group: list[str]) -> dict:
    # num_bits tells the groups apart: group i quantizes with 8 - i bits
    return {f"group_{i}": {"targets": t, "weights": {**W, "num_bits": 8 - i}, "format": "pack-quantized"}
            for i, t in enumerate(targets_per_group)}


CASES = [
    ({"config_groups": _groups(["Linear"]), "ignore": ["lm_head"]}),
    # a bare suffix names no module in compressed-tensors (only exact names and `re:` patterns do)
    ({"config_groups": _groups(["Linear"]), "ignore": ["lm_head", "down_proj"]}),
    ({"config_groups": _groups(["Linear"]), "ignore": ["lm_head", "re:.*down_proj$"]}),
    ({"config_groups": _groups(["Linear"], ["re:.*self_attn.*"]), "ignore": ["lm_head"]}),
    ({"config_groups": _groups(["re:.*mlp.*"], ["model.layers.0.mlp.up_proj"]), "ignore": []}),
    ({"config_groups": _groups(["Linear"], ["lm_head"]), "ignore": ["re:model.layers.1.*"]}),
    ({"config_groups": _groups(["q_proj", "re:.*v_proj"]), "ignore": ["model.layers.0.self_attn.v_proj"]}),
]


@pytest.fixture(scope="module")
def linear_names(tiny_model_dir) -> list[str]:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


@pytest.mark.parametrize("qconfig", CASES)
def test_engine_selects_the_layers_compressed_tensors_selects(qconfig, tiny_model_dir, linear_names):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    apply_quantization_config(model, QuantizationConfig.model_validate(qconfig))
    by_ct = {n: getattr(m, "quantization_scheme", None) for n, m in model.named_modules()
             if isinstance(m, torch.nn.Linear)}
    by_ct = {n: s.weights.num_bits if s is not None else None for n, s in by_ct.items()}
    by_engine = {n: (g["weights"]["num_bits"] if (g := config_group_for(qconfig, n)) else None)
                 for n in linear_names}
    assert by_engine == by_ct
    assert any(v is not None for v in by_ct.values())  # the case quantizes something


def test_suffix_alone_does_not_match():
    qconfig = {"config_groups": _groups(["Linear"]), "ignore": ["down_proj"]}
    assert config_group_for(qconfig, "model.layers.0.mlp.down_proj") is not None


def test_group_without_format_takes_the_global_format():
    group = {"targets": ["Linear"], "weights": {**W, "num_bits": 4, "strategy": "group", "group_size": 32}}
    with pytest.raises(S.QuantSchemeError, match="format None is not supported"):
        S.parse_scheme(group)
    assert S.parse_scheme(group, default_format="pack-quantized").packed
    chosen = config_group_for({"config_groups": {"g": group}, "format": "pack-quantized", "ignore": []}, "x.q")
    assert chosen["format"] == "pack-quantized" and "format" not in group


def test_scheme_defaults_come_from_compressed_tensors():
    # no strategy: compressed-tensors infers `group` from group_size; its validators judge the rest
    s = S.parse_scheme({"format": "pack-quantized", "weights": {"num_bits": 4, "group_size": 32}})
    assert (s.strategy, s.group_size, s.symmetric) == ("group", 32, True)
    with pytest.raises(S.QuantSchemeError, match="not a valid compressed-tensors scheme"):
        S.parse_scheme({"format": "pack-quantized", "weights": {"num_bits": 4, "strategy": "group"}})


def test_engine_loads_a_checkpoint_with_only_a_global_format(tiny_model_dir, tmp_path):
    """Older llm-compressor checkpoints keep `format` only at the top of quantization_config."""
    out = tmp_path / "q"
    quantize(tiny_model_dir, "int4-rtn", out, verify=False)
    legacy = tmp_path / "legacy"
    shutil.copytree(out, legacy)
    cfg = json.loads((legacy / "config.json").read_text())
    assert cfg["quantization_config"]["format"] == "pack-quantized"
    for group in cfg["quantization_config"]["config_groups"].values():
        group.pop("format", None)
    (legacy / "config.json").write_text(json.dumps(cfg))
    want = load_model(resolve_model(str(out)))
    got = load_model(resolve_model(str(legacy)))
    assert type(got.layers[0].mlp.down_proj) is type(want.layers[0].mlp.down_proj)
    w = want.layers[0].mlp.down_proj.state_dict()
    g = got.layers[0].mlp.down_proj.state_dict()
    assert w.keys() == g.keys() and all(torch.equal(w[k], g[k]) for k in w)
