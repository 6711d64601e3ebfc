"""EAGLE-3 heads in the format vLLM's `speculators` library writes (what a head trained on a GPU with it ships as,
and what vLLM serves with `--speculative-config '{"model": DIR}'`), read into the same Eagle3Head as vLLM's own
layout.

The format (speculators 0.9, `Eagle3SpeculatorConfig` / `Eagle3DraftModel.save_pretrained`): config.json with
`speculators_model_type: "eagle3"`, the draft layer's transformers config under `transformer_layer_config` (its
`vocab_size` is the target's), `draft_vocab_size`, `target_hidden_size`, `eagle_aux_hidden_state_layer_ids` (null:
the target's default taps) and layer-shape switches; model.safetensors with the decoder layer under `layers.0.`
where vLLM's layout has `midlayer.`, the vocabulary maps `d2t` / `t2d` (absent when the draft vocabulary is the
target's) and usually the head's own `embed_tokens` (a copy of the target's, or trained when
`embed_requires_grad`), which the head then uses instead of the target's, as vLLM does.

A head this engine cannot run as it was trained is refused by name, never approximated: more than one decoder
layer, a layer type other than LLaMA's (Qwen3's has q/k norms), rope scaling, or any of the switches that change
the layer's arithmetic (`norm_before_residual`, `norm_before_fc`, `fc_norm`, `norm_output`). Other speculators
algorithms (DFlash, MTP, ...) are refused in one line naming the algorithm.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .head import Eagle3Config

MODEL_TYPE_KEY = "speculators_model_type"
# switches of speculators' Eagle3SpeculatorConfig that change the head's arithmetic; this engine runs each off
SWITCHES = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def is_speculators(cfg: Any) -> bool:
    return isinstance(cfg, dict) and MODEL_TYPE_KEY in cfg


def rename(name: str) -> str:
    """A speculators tensor name -> vLLM's layout name (what Eagle3Head's state dict holds)."""
    return "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name


def head_config(folder: Path, cfg: dict[str, Any], fail) -> Eagle3Config:
    """The Eagle3Config of a speculators head; `fail(problem, fix)` builds the one-line error to raise.

    An empty `aux_layer_ids` means the target's default taps (the config stores null), resolved against the
    target in format.resolve_aux."""
    kind = cfg.get(MODEL_TYPE_KEY)
    if kind != "eagle3":
        raise fail(f"a speculators {kind!r} head: only EAGLE-3 heads run in this engine",
                   "serve it with vLLM, or use an EAGLE-3 head (speculators_model_type eagle3)")
    on = [s for s in SWITCHES if cfg.get(s)]
    if on:
        raise fail(f"{', '.join(on)} is set: this engine runs the EAGLE-3 layer without it",
                   "use a head trained with these switches off (speculators' defaults)")
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise fail("config.json has no transformer_layer_config object", "pass a folder speculators wrote")
    if layer.get("model_type", "llama") != "llama":
        raise fail(f"its decoder layer is {layer.get('model_type')!r}, not 'llama'",
                   "use a head with a LLaMA-type layer (speculators' `--draft-arch llama`)")
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise fail(f"{layer.get('num_hidden_layers')} decoder layers: this engine runs one-layer heads",
                   "use a one-layer EAGLE-3 head")
    rope = layer.get("rope_parameters") or layer.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise fail(f"rope scaling {rope.get('rope_type', rope.get('type'))!r} is not supported in a draft head",
                   "use a head without rope scaling")
    try:
        hidden, heads = int(layer["hidden_size"]), int(layer["num_attention_heads"])
        ids = cfg.get("eagle_aux_hidden_state_layer_ids")
        return Eagle3Config(
            hidden_size=hidden, num_attention_heads=heads,
            num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
            head_dim=int(layer.get("head_dim") or hidden // heads), intermediate_size=int(layer["intermediate_size"]),
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", layer.get("rope_theta", 10000.0))),
            max_position_embeddings=int(layer.get("max_position_embeddings", 2048)),
            draft_vocab_size=int(cfg.get("draft_vocab_size") or layer["vocab_size"]),
            vocab_size=int(layer["vocab_size"]), target_hidden_size=int(cfg.get("target_hidden_size") or hidden),
            aux_layer_ids=tuple(int(i) for i in ids) if ids is not None else ())
    except KeyError as e:
        raise fail(f"transformer_layer_config has no {e.args[0]!r}", "pass a folder speculators wrote") from None
    except (TypeError, ValueError) as e:
        raise fail(f"config.json has a malformed field ({e})", "pass a folder speculators wrote") from None
