"""One engine configuration (nano-vllm's `Config`): every option of the engine, validated once, built once from
the command line, and passed whole to the engine, the server, server subprocesses and the benchmarks.

A new engine flag is one field here (its metadata holds the flag's help): `add_engine_args` adds it to every
command that starts an engine, `from_args` reads it back, `to_cli_args` hands it to a `qtool serve` subprocess.
This module loads no torch, so `qtool --help` stays quick.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from .params import EngineInputError
from .speculative_spec import SpeculativeSpec

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
BATCHING_MODES = ("continuous", "static")
# speculative.policy.DEFAULT_MAX_VERIFY_TOKENS (a test checks they agree): importing it here would load torch
DEFAULT_MAX_VERIFY_TOKENS = 8
KV_CACHE_DTYPES = ("auto", "fp8", "int8")  # model.kv_quant.KV_CACHE_DTYPES (a test checks they agree)


def parse_memory(value: str | int) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise EngineInputError(f"cannot read memory size {value!r}: write e.g. 512MiB, 1GiB or a byte count")
    try:
        return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    except ValueError:
        raise EngineInputError(f"cannot read memory size {value!r}: write e.g. 512MiB, 1GiB or a byte count") from None


def _flag(help_text: str, **argparse_kwargs: Any) -> dict[str, Any]:
    return {"help": help_text, **argparse_kwargs}


@dataclass(frozen=True)
class EngineConfig:
    kv_cache_memory: str | int = field(default="1GiB", metadata=_flag(
        "memory for the paged KV cache, e.g. 512MiB, 2GiB"))
    kv_cache_tokens: int | None = field(default=None, metadata=_flag(
        "size the paged KV cache in tokens instead (overrides --kv-cache-memory): what a known workload needs, "
        "e.g. concurrency x (longest prompt + max output tokens)", type=int))
    kv_cache_dtype: str = field(default="auto", metadata=_flag(
        "KV cache storage: auto (the model's dtype), fp8 (E4M3) or int8, with one scale per token and KV head "
        "(a checkpoint's calibrated k_scale/v_scale when it has them); fp8/int8 fit ~4x the tokens of fp32",
        metavar="{auto,fp8,int8}"))
    block_size: int = field(default=16, metadata=_flag("tokens per KV cache block", type=int))
    max_num_seqs: int = field(default=64, metadata=_flag("most sequences the engine runs at once", type=int))
    max_num_batched_tokens: int = field(default=1024, metadata=_flag("token budget of one engine step", type=int))
    batching: str = field(default="continuous", metadata=_flag(
        "continuous (iteration-level) or static: a batch starts only when the previous one finished (the baseline)",
        choices=BATCHING_MODES))
    dtype: str = field(default="auto", metadata=_flag("compute dtype: auto (float32 on CPU), float32, bfloat16"))
    enable_prefix_caching: bool = field(default=True, metadata=_flag(
        "reuse the KV blocks of a prompt prefix already computed", action=argparse.BooleanOptionalAction))
    max_model_len: int | None = field(default=None, metadata=_flag(
        "cap on prompt + output tokens (default: what the model and the KV cache hold)", type=int))
    speculative: str | None = field(default=None, metadata=_flag(
        "speculative decoding: ngram, draft:PATH, self-int4, self-fp8, self:PATH, eagle3:DIR or none (default)",
        metavar="PROPOSER"))
    num_speculative_tokens: int = field(default=4, metadata=_flag(
        "most tokens proposed per step (1-16; adapted per sequence to its acceptance)", type=int, metavar="K"))
    max_verify_tokens: int = field(default=DEFAULT_MAX_VERIFY_TOKENS, metadata=_flag(
        "most draft tokens one step verifies over the whole batch (the load-aware policy's budget)", type=int))

    def __post_init__(self) -> None:
        # start-up time: the proposer check lives with the proposers, whose package loads torch
        from .speculative import SpeculativeConfigError, check_speculative_args

        # bad flags fail here, before any model loads: the proposer is parsed once, its string kept normalized
        # (None = off) for the CLI and the JSON, its value for the engine (speculative_spec)
        spec = check_speculative_args(self.speculative, self.num_speculative_tokens)
        object.__setattr__(self, "speculative", None if spec is None else str(spec))
        object.__setattr__(self, "_speculative_spec", spec)
        if not _positive_int(self.max_verify_tokens):
            raise SpeculativeConfigError(f"max_verify_tokens must be positive, got {self.max_verify_tokens}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise EngineInputError(f"kv_cache_dtype {self.kv_cache_dtype!r} is unknown: use one of "
                                   f"{', '.join(KV_CACHE_DTYPES)}")
        if self.batching not in BATCHING_MODES:
            raise EngineInputError(f"batching {self.batching!r} is unknown: use continuous or static")
        if not all(map(_positive_int, (self.block_size, self.max_num_seqs, self.max_num_batched_tokens))):
            raise EngineInputError("block_size, max_num_seqs and max_num_batched_tokens must be positive")
        if self.max_model_len is not None and not _positive_int(self.max_model_len):
            raise EngineInputError(f"max_model_len must be a positive integer, got {self.max_model_len!r}")
        parse_memory(self.kv_cache_memory)
        if self.kv_cache_tokens is not None and not _positive_int(self.kv_cache_tokens):
            raise EngineInputError(f"kv_cache_tokens must be a positive integer, got {self.kv_cache_tokens!r}")

    @property
    def speculative_spec(self) -> SpeculativeSpec | None:
        """The proposer as parsed when this config was built; None without speculation."""
        return self._speculative_spec  # type: ignore[attr-defined]

    @property
    def kv_cache_bytes(self) -> int:
        return parse_memory(self.kv_cache_memory)

    @property
    def kv_budget(self) -> str:
        """The KV cache's size as the user gave it, for log lines."""
        return f"{self.kv_cache_tokens} tokens" if self.kv_cache_tokens else str(self.kv_cache_memory)

    def kv_blocks(self, block_bytes: int) -> int:
        """KV blocks of `block_bytes` each: kv_cache_tokens rounded up to whole blocks when set, else as many as
        kv_cache_memory holds."""
        if self.kv_cache_tokens:
            return -(-self.kv_cache_tokens // self.block_size)
        return self.kv_cache_bytes // block_bytes

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_args(cls, ns: argparse.Namespace, **overrides: Any) -> EngineConfig:
        """The config a command's parsed flags describe; `overrides` for options the command sets itself."""
        values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}
        return cls(**{**values, **overrides})

    def to_cli_args(self) -> list[str]:
        """The `qtool serve` flags that rebuild this config in a subprocess (from_args reads them back)."""
        args: list[str] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                args.append(flag if value else "--no-" + flag[2:])
            elif value is not None:
                args += [flag, str(value)]
        return args


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def add_engine_args(p: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()) -> None:
    """Every EngineConfig field as a flag (`--kv-cache-memory`, ...) with the field's default; `skip` leaves out
    those a command declares its own way (bench serve takes lists of batching modes and proposers)."""
    group = p.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        if f.name not in skip:
            group.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=f.default, **f.metadata)
