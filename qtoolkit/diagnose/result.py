"""What `qtool diagnose` found, as types: the machine's ceilings, the model's bytes per step, the KV capacity, the
prefill and decode sweeps against their roofline, and the bottleneck with its levers.

diagnose.json keeps its layout (`to_json` / `from_json`); the report and the terminal read fields. It lives apart
from qtoolkit/diagnose/run.py so that reading a result loads no engine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class MachineCeilings:
    memory_bandwidth_gb_s: float
    fp32_gemm_gflop_s: float


@dataclass
class ModelBytes:
    """Bytes a decode step streams: every Linear's weights + the lm_head; matmul weights per token."""

    linear_bytes: int
    lm_head_bytes: int
    decode_bytes_per_step: int
    matmul_weights: int


@dataclass
class KVCapacity:
    bytes_per_token: int
    blocks: int
    block_size: int
    context: int
    max_concurrent_at_context: int


@dataclass
class PrefillRow:
    prompt_tokens: int
    seconds: float
    tokens_per_s: float
    fraction_of_roofline: float | None = None


@dataclass
class DecodeRow:
    batch: int
    decode_seconds: float
    tokens_per_s: float
    ms_per_step: float
    fraction_of_roofline: float | None = None


@dataclass
class Roofline:
    """Attainable decode tok/s at one batch size: min(bytes bound, flops bound)."""

    decode_memory_bound_tok_s: float
    compute_bound_tok_s: float
    decode_attainable_tok_s: float


def _row(cls, d: dict[str, Any]):
    return cls(**{k: d.get(k) for k in cls.__dataclass_fields__})


_FIELDS = ("machine_ceilings", "model", "kv", "prefill", "decode", "roofline", "batching_ceiling", "bottleneck",
           "levers")


@dataclass
class DiagnoseResult:
    provenance: dict[str, Any]
    machine_ceilings: MachineCeilings
    model: ModelBytes
    kv: KVCapacity
    prefill: list[PrefillRow]
    decode: list[DecodeRow]
    roofline: dict[int, Roofline]  # by decode batch size
    prefill_attainable_tok_s: float
    batching_ceiling: dict[str, Any] = field(default_factory=dict)  # qtoolkit/diagnose/batching_ceiling.py's replay
    bottleneck: str = ""
    levers: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        roof: dict[str, Any] = {f"batch{b}": asdict(r) for b, r in self.roofline.items()}
        roof["prefill_attainable_tok_s"] = self.prefill_attainable_tok_s
        return {**self.provenance, "machine_ceilings": asdict(self.machine_ceilings), "model": asdict(self.model),
                "kv": asdict(self.kv), "prefill": [asdict(r) for r in self.prefill],
                "decode": [asdict(r) for r in self.decode], "roofline": roof,
                "batching_ceiling": self.batching_ceiling, "bottleneck": self.bottleneck, "levers": self.levers}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DiagnoseResult:
        roof = d["roofline"]
        return cls(
            provenance={k: v for k, v in d.items() if k not in _FIELDS},
            machine_ceilings=_row(MachineCeilings, d["machine_ceilings"]), model=_row(ModelBytes, d["model"]),
            kv=_row(KVCapacity, d["kv"]), prefill=[_row(PrefillRow, r) for r in d["prefill"]],
            decode=[_row(DecodeRow, r) for r in d["decode"]],
            roofline={int(k.removeprefix("batch")): _row(Roofline, v) for k, v in roof.items() if k.startswith("batch")},
            prefill_attainable_tok_s=roof["prefill_attainable_tok_s"],
            batching_ceiling=d.get("batching_ceiling") or {}, bottleneck=d.get("bottleneck", ""),
            levers=list(d.get("levers") or []))
