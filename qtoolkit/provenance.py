"""Provenance for every result file: schema version, input hashes, library versions, machine."""

from __future__ import annotations

import functools
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


# The libraries whose versions change what a step computes: a step's evidence made under others is made again
_CODE_LIBS = ("torch", "transformers", "compressed-tensors", "llmcompressor")
_SOURCE_SKIP = {"__pycache__", ".pytest_cache"}


@functools.lru_cache(maxsize=1)
def source_sha256() -> str:
    """Hash of every source file qtoolkit runs from (qtoolkit/, and kernels/, evals/, recipes/ as they are
    installed): a fix to an interval method or a kernel changes it, so no step's evidence outlives the code that
    made it. Read once per process (~2 MB)."""
    import qtoolkit.evals
    import qtoolkit.kernels
    import qtoolkit.recipes

    roots = {name: Path(mod.__file__).parent for name, mod in (
        ("qtoolkit", __import__("qtoolkit")), ("evals", qtoolkit.evals), ("kernels", qtoolkit.kernels),
        ("recipes", qtoolkit.recipes))}
    h = hashlib.sha256()
    for name, root in roots.items():
        skip = [r for r in roots.values() if r != root and root in r.parents]  # a package inside another
        for p in sorted(root.rglob("*")):
            if (p.is_file() and p.suffix not in (".pyc", ".so") and not _SOURCE_SKIP & set(p.parts)
                    and not any(s in p.parents for s in skip)):
                h.update(f"{name}/{p.relative_to(root).as_posix()}".encode())
                h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def code_identity() -> dict[str, str]:
    """What made a step's evidence besides its inputs: qtoolkit's version and source, and the versions of the
    libraries that compute with it. Part of every sign-off step's reuse key."""
    versions = library_versions()
    return {"qtoolkit": versions.get("qtoolkit", "?"), "source_sha256": source_sha256(),
            **{lib: versions.get(lib, "absent") for lib in _CODE_LIBS}}


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
