"""The `--speculative` value as a value: which proposer, and the folder it reads when it reads one.

It is parsed once, where the engine options are built (EngineConfig), and every consumer (the proposer builder,
the sign-off's head check) reads its fields. The module loads no torch, so `qtool --help` and the config stay
quick; `SpeculativeConfigError` lives here for the same reason (speculative/base.py re-exports it)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import QToolError

USAGE = ("use ngram, draft:PATH, self-int4, self-fp8, self-skip, self-skip:K, self:PATH, eagle3:DIR (an EAGLE-3 "
         "head from `qtool train-draft` or vLLM's speculators) or none")
OFF = ("", "none", "off")
PLAIN_KINDS = ("ngram", "self-int4", "self-fp8", "self-skip")  # proposers that read no folder
# proposers written KIND:PATH; self-skip:K is the exception, its "path" is the number of layers the draft keeps
PATH_KINDS = ("draft", "self", "eagle3", "self-skip")
_FORMS = {"draft": "draft:PATH", "self": "self:PATH", "eagle3": "eagle3:DIR", "self-skip": "self-skip:K"}


class SpeculativeConfigError(QToolError):
    """Speculative decoding cannot start as configured (unknown proposer, bad k, unusable draft)."""


@dataclass(frozen=True)
class SpeculativeSpec:
    kind: str  # one of PLAIN_KINDS or PATH_KINDS
    path: str | None = None  # the draft model, self-draft checkpoint or EAGLE-3 head folder of a PATH_KINDS

    def __post_init__(self) -> None:
        if self.kind in PLAIN_KINDS and self.path is None:
            return
        if self.kind == "self-skip" and not (self.path and self.path.isdigit() and int(self.path) > 0):
            raise SpeculativeConfigError(f"--speculative {str(self)!r}: K must be a positive whole number of "
                                         "layers, e.g. self-skip:12, or write self-skip to let the engine pick it")
        if self.kind in PATH_KINDS and self.path:
            return
        raise SpeculativeConfigError(f"--speculative {str(self)!r} is unknown: {USAGE}")

    @classmethod
    def parse(cls, value: str | None) -> SpeculativeSpec | None:
        """`--speculative VALUE`; None for no speculation (none, off or empty). A bad value is one line naming
        the accepted forms."""
        if value is None or value.strip().lower() in OFF:
            return None
        text = value.strip()
        if text in PLAIN_KINDS:
            return cls(text)
        kind, colon, path = text.partition(":")
        if kind in PATH_KINDS and not (colon and path.strip()):
            raise SpeculativeConfigError(f"--speculative {value!r} names no folder: write {_FORMS[kind]}")
        if kind not in PATH_KINDS:
            raise SpeculativeConfigError(f"--speculative {value!r} is unknown: {USAGE}")
        return cls(kind, path.strip())

    def __str__(self) -> str:
        """The value as written on a command line (and the proposer's name in metrics and reports)."""
        return self.kind if self.path is None else f"{self.kind}:{self.path}"

    @property
    def self_draft_format(self) -> str | None:
        """int4 or fp8 for a target quantized in memory (self-int4, self-fp8); None otherwise."""
        return self.kind.removeprefix("self-") if self.kind in ("self-int4", "self-fp8") else None

    @property
    def skip_layers(self) -> int | None:
        """self-skip:K -> K, the target layers the layer-skipping draft keeps; None for self-skip (the engine
        picks) and every other kind."""
        return int(self.path) if self.kind == "self-skip" and self.path is not None else None

    @property
    def shares_target_kv(self) -> bool:
        """A self-draft (in memory, layer-skipping or a `self:` checkpoint) reads the target's KV cache."""
        return self.kind in ("self", "self-skip") or self.self_draft_format is not None
