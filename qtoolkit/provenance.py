"""Provenance for every result file: schema version, input hashes, library versions, machine."""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import os
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

SCHEMA_VERSION = 1
_LIBS = ("qtoolkit", "torch", "transformers", "compressed-tensors", "llmcompressor", "safetensors", "triton",
         "lm-eval", "bitsandbytes")


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def text_sha256(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


# Every file of a model folder that changes what the model computes or how its text is made: weights, configs
# (generation_config.json's EOS ids end sequences), tokenizer files and the chat template. Result files written
# next to a model (eval.json, ...) are not in it, so evaluating a folder does not change its identity.
IDENTITY_PATTERNS = ("*.safetensors", "model.safetensors.index.json", "config.json", "generation_config.json",
                     "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                     "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "*.tiktoken", "chat_template.jinja",
                     "chat_template.json", "additional_chat_templates/*.jinja", "preprocessor_config.json",
                     "recipe.yaml")


def folder_sha256(folder: str | os.PathLike, patterns: tuple[str, ...] = IDENTITY_PATTERNS) -> str:
    """Hash of every behaviour-changing file of a model folder, cached in the folder (keyed by size and
    mtime)."""
    folder = Path(folder)
    files = sorted({p for pat in patterns for p in folder.glob(pat) if p.is_file()})
    names = [p.relative_to(folder).as_posix() for p in files]
    stamp = [(n, p.stat().st_size, p.stat().st_mtime_ns) for n, p in zip(names, files, strict=True)]
    cache = folder / ".qtoolkit-hash-v2.json"  # v2: covers tokenizer, template and generation config
    try:
        cached = json.loads(cache.read_text())
        if cached.get("stamp") == json.loads(json.dumps(stamp)):
            return cached["sha256"]
    except (OSError, ValueError, KeyError):
        pass
    h = hashlib.sha256()
    for n, p in zip(names, files, strict=True):
        h.update(n.encode())
        h.update(file_sha256(p).encode())
    digest = h.hexdigest()
    try:
        cache.write_text(json.dumps({"stamp": stamp, "sha256": digest}))
    except OSError:
        pass  # read-only folders still hash, just not cached
    return digest


def library_versions() -> dict[str, str]:
    out = {}
    for name in _LIBS:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            continue
    return out


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "cpu_count": os.cpu_count()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def provenance(**inputs: Any) -> dict[str, Any]:
    """The block every result JSON carries."""
    return {
        "schema_version": SCHEMA_VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "inputs": inputs,
        "versions": library_versions(),
        "machine": machine_info(),
    }
