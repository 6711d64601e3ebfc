"""The vLLM EAGLE-3 folder format of a draft head: config.json (`LlamaForCausalLMEagle3`, one llama layer, the
draft vocabulary size and the target's aux layer ids under `eagle_aux_hidden_state_layer_ids`, the key vLLM's
eagle3 utils read) and model.safetensors under the names vLLM's llama_eagle3 loader maps (`fc`, `midlayer.*`,
`norm`, `lm_head`, `d2t`, `t2d`; no `embed_tokens`: vLLM then shares the target's, as this head does).

Each file is written to a temp name in the folder and renamed over the old one, weights first, so a reader never
sees a torn file; other files in the folder (a trainer's state) are left alone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..errors import DraftHeadError
from ..io import fsync_dir
from . import speculators
from .head import Eagle3Config, Eagle3Head, default_aux_layer_ids

ARCHITECTURE = "LlamaForCausalLMEagle3"
CONFIG, WEIGHTS = "config.json", "model.safetensors"


def head_config_json(config: Eagle3Config, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    ids = list(config.aux_layer_ids)
    return {
        "architectures": [ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": config.hidden_size, "target_hidden_size": config.target_hidden_size,
        "intermediate_size": config.intermediate_size, "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads, "head_dim": config.head_dim,
        "hidden_act": "silu", "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "rope_scaling": None, "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size, "draft_vocab_size": config.draft_vocab_size,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": ids,
        "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": ids},
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def head_tensors(head: Eagle3Head, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors: every parameter and the two vocabulary maps (the rope table is not stored)."""
    out = {}
    for name, t in head.state_dict().items():
        if t.is_floating_point() and dtype is not None:
            t = t.to(dtype)
        out[name] = t.detach().cpu().contiguous()
    return out


def _replace(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_head(head: Eagle3Head, folder: str | os.PathLike, dtype: torch.dtype | None = None) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = head_tensors(head, dtype)
    stored = next(t.dtype for t in tensors.values() if t.is_floating_point())
    _replace(folder / WEIGHTS, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
    text = json.dumps(head_config_json(head.config, stored), indent=2) + "\n"
    _replace(folder / CONFIG, lambda p: p.write_text(text))
    fsync_dir(folder)
    return folder


def _fail(folder: Path, problem: str, fix: str) -> DraftHeadError:
    return DraftHeadError(f"draft head {folder}: {problem}: {fix}")


RETRAIN = "train a head for this target with `qtool train-draft --model MODEL --output DIR`"


def read_head_config(folder: Path) -> Eagle3Config:
    if not folder.is_dir():
        raise _fail(folder, "no such folder", f"pass the --output folder of `qtool train-draft`, or {RETRAIN}")
    path = folder / CONFIG
    if not path.is_file():
        raise _fail(folder, f"{CONFIG} is missing", f"pass a folder `qtool train-draft` wrote, or {RETRAIN}")
    try:
        cfg = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise _fail(folder, f"{CONFIG} is not valid JSON ({str(e).splitlines()[0]})", RETRAIN) from None
    if speculators.is_speculators(cfg):
        return speculators.head_config(folder, cfg, lambda problem, fix: _fail(folder, problem, fix))
    archs = cfg.get("architectures") if isinstance(cfg, dict) else None
    if not isinstance(archs, list) or ARCHITECTURE not in archs:
        raise _fail(folder, f"architecture {archs} is not {ARCHITECTURE} (vLLM's EAGLE-3 draft layout)",
                    f"pass an EAGLE-3 head folder, or {RETRAIN}")
    try:
        ids = tuple(int(i) for i in cfg["eagle_aux_hidden_state_layer_ids"])
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        return Eagle3Config(
            hidden_size=hidden, num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads), intermediate_size=int(cfg["intermediate_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=float(cfg.get("rope_theta", 10000.0)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            draft_vocab_size=int(cfg.get("draft_vocab_size") or cfg["vocab_size"]), vocab_size=int(cfg["vocab_size"]),
            target_hidden_size=int(cfg.get("target_hidden_size") or hidden), aux_layer_ids=ids)
    except KeyError as e:
        raise _fail(folder, f"{CONFIG} has no {e.args[0]!r}", RETRAIN) from None
    except (TypeError, ValueError) as e:
        raise _fail(folder, f"{CONFIG} has a malformed field ({e})", RETRAIN) from None


def check_fits(folder: Path, c: Eagle3Config, target: Any) -> None:
    """The head drafts for `target` (qtoolkit.model.llama.ModelConfig) only if it reads the target's embeddings,
    hidden states and vocabulary."""
    if c.hidden_size != target.hidden_size or c.target_hidden_size != target.hidden_size:
        raise _fail(folder, f"hidden size {c.hidden_size} (target hidden {c.target_hidden_size}) does not match the "
                    f"target's {target.hidden_size}", f"use the head trained for this model, or {RETRAIN}")
    if c.vocab_size != target.vocab_size:
        raise _fail(folder, f"vocabulary of {c.vocab_size} tokens does not match the target's {target.vocab_size}",
                    f"use the head trained for this model's tokenizer, or {RETRAIN}")
    if not 0 < c.draft_vocab_size <= c.vocab_size:
        raise _fail(folder, f"draft_vocab_size {c.draft_vocab_size} is outside 1..{c.vocab_size}", RETRAIN)
    top = target.num_layers - 1
    c = resolve_aux(c, target)
    if len(c.aux_layer_ids) != 3 or any(not 1 <= i <= top for i in c.aux_layer_ids):
        raise _fail(folder, f"aux layer ids {list(c.aux_layer_ids)} are not three target layers in 1..{top}",
                    f"use the head trained for this model, or {RETRAIN}")


def read_tensors(folder: Path, expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The head's tensors under Eagle3Head's names (speculators' `layers.0.` read as `midlayer.`), plus the
    head's own `embed_tokens.weight` where the file has one. `d2t` / `t2d` may be absent only where the draft
    vocabulary is the whole target vocabulary (speculators then omits them): the identity maps are filled in."""
    path = folder / WEIGHTS
    if not path.is_file():
        others = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl"))
        what = f"{WEIGHTS} is missing" + (f" ({', '.join(others)} is not safetensors)" if others else "")
        raise _fail(folder, what, f"only safetensors weights are read: {RETRAIN}")
    optional = {"embed_tokens.weight"}
    if expected["d2t"].shape == (expected["t2d"].shape[0],):
        optional |= {"d2t", "t2d"}
    try:
        with safe_open(str(path), framework="pt") as f:
            names = {speculators.rename(n): n for n in f.keys()}
            missing = sorted(set(expected) - set(names) - optional)
            extra = sorted(set(names) - set(expected) - optional)
            if missing or extra:
                raise _fail(folder, f"{WEIGHTS} lacks {missing[:3]} / has unexpected {extra[:3]}", RETRAIN)
            tensors = {name: f.get_tensor(stored) for name, stored in names.items()}
    except SafetensorError as e:
        raise _fail(folder, f"{WEIGHTS} is not a safetensors file ({str(e).splitlines()[0]})", RETRAIN) from None
    tensors.setdefault("d2t", torch.zeros_like(expected["d2t"]))
    tensors.setdefault("t2d", torch.ones_like(expected["t2d"]))
    shapes = {**{k: tuple(v.shape) for k, v in expected.items()},
              "embed_tokens.weight": (expected["t2d"].shape[0], expected["fc.weight"].shape[0])}
    for name, t in tensors.items():
        if tuple(t.shape) != shapes[name]:
            raise _fail(folder, f"tensor {name} has shape {list(t.shape)}, {CONFIG} implies "
                        f"{list(shapes[name])}", RETRAIN)
    return tensors


def resolve_aux(config: Eagle3Config, target_config: Any) -> Eagle3Config:
    """A head config whose aux layers were left to the target (speculators' null) gets the target's default taps."""
    if config.aux_layer_ids:
        return config
    return dataclasses.replace(config, aux_layer_ids=default_aux_layer_ids(target_config.num_layers))


def load_head(folder: str | os.PathLike, target_config: Any, dtype: torch.dtype = torch.float32) -> Eagle3Head:
    """A head folder (vLLM's EAGLE-3 layout or speculators') checked against the target it drafts for; every
    problem is one DraftHeadError line."""
    folder = Path(folder)
    config = resolve_aux(read_head_config(folder), target_config)
    check_fits(folder, config, target_config)
    head = Eagle3Head(config)
    tensors = read_tensors(folder, head.state_dict())
    target_ids = torch.arange(config.draft_vocab_size) + tensors["d2t"].to(torch.int64)
    if target_ids.min() < 0 or target_ids.max() >= config.vocab_size:
        raise _fail(folder, "d2t maps draft ids outside the target's vocabulary", RETRAIN)
    embed = tensors.pop("embed_tokens.weight", None)
    head.load_state_dict({k: v.to(torch.int64) if k == "d2t" else v.to(torch.bool) if k == "t2d" else v
                          for k, v in tensors.items()})
    head = head.to(dtype).eval()
    head.embed_tokens = None if embed is None else embed.to(dtype)
    return head
