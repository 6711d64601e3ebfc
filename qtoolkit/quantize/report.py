"""What `qtool quantize` made, as types: the recipe applied, bytes per Linear before/after, timings, the smoke test.

quantize_report.json keeps its layout (`to_json` / `from_json`); the sign-off, its reports and the CLI read fields.
It lives apart from qtoolkit/quantize/run.py so that reading a report loads neither torch nor llm-compressor.
The first reports lack the recipe's `sha256`, `head` and `kv_cache_scheme` (later ones only some): missing, they
read as None.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..errors import QToolError

PROVENANCE_KEYS = ("schema_version", "created", "inputs", "versions", "machine")


@dataclass(frozen=True)
class RecipeRecord:
    """The recipe as applied: its identity, and the scheme resolved from presets into explicit arguments."""

    name: str
    sha256: str | None = None
    description: str = ""
    method: str | None = None
    modifier: str | None = None
    scheme: str | None = None
    resolved: dict[str, Any] | None = None
    head: dict[str, Any] | None = None
    targets: list[str] = field(default_factory=list)
    ignore: list[str] = field(default_factory=list)
    kv_cache_scheme: dict[str, Any] | None = None
    calibration: dict[str, Any] | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RecipeRecord:
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class LayerBytes:
    """One targeted Linear: its weight bytes in bf16, in the source checkpoint and quantized (scales included)."""

    name: str
    shape: tuple[int, int]
    bf16_bytes: int
    source_bytes: int
    quantized_bytes: int
    ratio_vs_bf16: float

    @classmethod
    def measured(cls, name: str, shape: tuple[int, int], source_bytes: int, quantized_bytes: int) -> LayerBytes:
        n, k = shape
        return cls(name, (n, k), n * k * 2, source_bytes, quantized_bytes, round(quantized_bytes / (n * k * 2), 4))

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LayerBytes:
        n, k = d["shape"]
        return cls(d["name"], (n, k), d["bf16_bytes"], d["source_bytes"], d["quantized_bytes"], d["ratio_vs_bf16"])

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "bf16_bytes": self.bf16_bytes,
                "source_bytes": self.source_bytes, "quantized_bytes": self.quantized_bytes,
                "ratio_vs_bf16": self.ratio_vs_bf16}


@dataclass(frozen=True)
class QuantizeTotals:
    """Sums over the targeted Linears, and the whole checkpoint's bytes before and after."""

    linear_layers: int
    linear_bf16_bytes: int
    linear_source_bytes: int
    linear_quantized_bytes: int
    linear_ratio_vs_bf16: float | None
    checkpoint_bytes: int
    source_checkpoint_bytes: int

    @classmethod
    def of(cls, layers: list[LayerBytes], checkpoint_bytes: int, source_checkpoint_bytes: int) -> QuantizeTotals:
        bf16 = sum(x.bf16_bytes for x in layers)
        after = sum(x.quantized_bytes for x in layers)
        return cls(len(layers), bf16, sum(x.source_bytes for x in layers), after,
                   round(after / bf16, 4) if bf16 else None, checkpoint_bytes, source_checkpoint_bytes)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> QuantizeTotals:
        return cls(**{f.name: d[f.name] for f in fields(cls)})

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Timings:
    """Seconds per phase; verify_s is None when the smoke test was skipped (--no-verify)."""

    load_s: float
    quantize_s: float
    save_s: float
    total_s: float
    verify_s: float | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Timings:
        return cls(d["load_s"], d["quantize_s"], d["save_s"], d["total_s"], d.get("verify_s"))

    def to_json(self) -> dict[str, float]:
        # the file's key order is the order the phases run in; a skipped smoke test has no key
        out = {"load_s": self.load_s, "quantize_s": self.quantize_s, "save_s": self.save_s}
        if self.verify_s is not None:
            out["verify_s"] = self.verify_s
        return {**out, "total_s": self.total_s}


@dataclass(frozen=True)
class SmokeTest:
    """The greedy completion transformers produced after reloading the written checkpoint."""

    prompt: str
    completion: str

    @classmethod
    def from_json(cls, d: dict[str, Any] | None) -> SmokeTest | None:
        return None if d is None else cls(d["prompt"], d["completion"])

    def to_json(self) -> dict[str, str]:
        return {"prompt": self.prompt, "completion": self.completion}


@dataclass(frozen=True)
class QuantizeSummary:
    """What a sign-off report keeps of a quantize report (its `quantize` section)."""

    recipe: RecipeRecord
    totals: QuantizeTotals
    timings: Timings
    smoke_test: SmokeTest | None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> QuantizeSummary:
        return cls(RecipeRecord.from_json(d["recipe"]), QuantizeTotals.from_json(d["totals"]),
                   Timings.from_json(d["timings"]), SmokeTest.from_json(d.get("smoke_test")))

    def to_json(self) -> dict[str, Any]:
        return {"recipe": self.recipe.to_json(), "totals": self.totals.to_json(), "timings": self.timings.to_json(),
                "smoke_test": self.smoke_test.to_json() if self.smoke_test else None}


@dataclass(frozen=True)
class QuantizeReport:
    """quantize_report.json: provenance, what was quantized how, bytes per layer, timings, the smoke completion."""

    provenance: dict[str, Any]
    recipe: RecipeRecord
    model: dict[str, Any]  # the source as ModelSource.describe() gives it
    output: str
    timings: Timings
    totals: QuantizeTotals
    smoke_test: SmokeTest | None
    layers: list[LayerBytes]

    @property
    def summary(self) -> QuantizeSummary:
        return QuantizeSummary(self.recipe, self.totals, self.timings, self.smoke_test)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> QuantizeReport:
        return cls(provenance={k: d[k] for k in PROVENANCE_KEYS if k in d},
                   recipe=RecipeRecord.from_json(d["recipe"]), model=d["model"], output=d["output"],
                   timings=Timings.from_json(d["timings"]), totals=QuantizeTotals.from_json(d["totals"]),
                   smoke_test=SmokeTest.from_json(d.get("smoke_test")),
                   layers=[LayerBytes.from_json(x) for x in d.get("layers", [])])

    def to_json(self) -> dict[str, Any]:
        return {**self.provenance, "recipe": self.recipe.to_json(), "model": self.model, "output": self.output,
                "timings": self.timings.to_json(), "totals": self.totals.to_json(),
                "smoke_test": self.smoke_test.to_json() if self.smoke_test else None,
                "layers": [x.to_json() for x in self.layers]}

    @classmethod
    def load(cls, path: Path) -> QuantizeReport | None:
        """The report in `path`, or None when there is no such file."""
        if not path.is_file():
            return None
        try:
            return cls.from_json(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError) as e:
            raise QToolError(f"{path} is not a readable quantize report ({type(e).__name__}: {e}): write it again "
                             "with qtool quantize") from None
