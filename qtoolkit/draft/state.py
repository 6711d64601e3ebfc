"""A training run's resumable state in its output folder: the head itself (vLLM format, servable at every
checkpoint), the optimizer's moments (train_state.safetensors) and the counters (train_state.json, written last:
it is the commit point of a checkpoint)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..io import write_json
from .format import save_head
from .head import Eagle3Head

STATE_JSON, STATE_TENSORS = "train_state.json", "train_state.safetensors"


def save_state(folder: Path, head: Eagle3Head, opt: torch.optim.Optimizer, counters: dict[str, Any]) -> None:
    names = {id(p): n for n, p in head.named_parameters()}
    tensors = {}
    for group in opt.param_groups:
        for p in group["params"]:
            for key, value in opt.state.get(p, {}).items():
                if torch.is_tensor(value):
                    tensors[f"{names[id(p)]}::{key}"] = value.detach().cpu().contiguous()
    tmp = folder / f".{STATE_TENSORS}.tmp"
    save_file(tensors, str(tmp))
    tmp.replace(folder / STATE_TENSORS)
    save_head(head, folder)
    write_json(folder / STATE_JSON, counters)


def load_state(folder: Path, head: Eagle3Head, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Restore the optimizer's moments into `opt` (the head is loaded by the caller) and return the counters."""
    counters = json.loads((folder / STATE_JSON).read_text())
    tensors = load_file(str(folder / STATE_TENSORS))
    params = dict(head.named_parameters())
    for key, value in tensors.items():
        name, slot = key.split("::")
        if name in params:
            # Adam's step counter stays on the CPU (torch keeps it there unless capturable)
            opt.state[params[name]][slot] = value if slot == "step" else value.to(params[name].device)
    return counters
