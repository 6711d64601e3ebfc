"""One in-process model at a time: each side's backend built when its side's work runs, the other side's released.

An eval compares a candidate with its baseline item by item, and with both as in-process engines it held two
models, two KV caches and their scratch at once: the eval step was a sign-off's memory peak (issue 43). Here each
side is an `OnDemand` backend; when both are in-process they share one `Resident` slot, so loading one side first
releases the other's (its weights and KV cache freed and handed back to the operating system). Tasks run a
batch one side after the other (evals/task.py: every call on one side before any on the other), so a batch costs
at most one switch per side: a load of the default model takes ~2 s, an item of generation far longer.

What a task reads without running the model (the tokenizer, `describe()`, `full_distributions`) is kept from
the side's first load, so reading it never reloads a released side; the tokenizer is loaded on its own, before
any model, so the vocabulary check costs no load.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from collections.abc import Callable
from functools import cache
from typing import Any

from qtoolkit.progress import status

from .base import Backend, GeneratedText, GenParams, Scored


@cache
def _libc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, where the C library has one (musl and macOS do not)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


def return_freed_memory() -> None:
    """Collect what a released model left in reference cycles, then hand glibc's free heap pages back to the
    operating system: without it the freed scratch of one model stays in this process's resident set, and a
    sweep's parent grows candidate by candidate."""
    gc.collect()
    trim = _libc_trim()
    if trim is not None:
        trim(0)


class Resident:
    """The one in-process backend loaded at a time among the sides that share this slot."""

    def __init__(self) -> None:
        self.holder: OnDemand | None = None
        self.switches = 0  # loads caused by switching sides (tests and the eval's record read it)

    def take(self, side: OnDemand) -> None:
        if self.holder is not None and self.holder is not side:
            self.holder.release()
            self.switches += 1
        self.holder = side


class OnDemand:
    """A Backend built on first use and released when another side takes the `Resident` slot (None: kept)."""

    def __init__(self, role: str, build: Callable[[], Backend], slot: Resident | None = None,
                 tokenizer: Any = None):
        self.role = role
        self._build = build
        self.slot = slot
        self.inner: Backend | None = None
        self.loads = 0
        self._tokenizer = tokenizer
        self._description: dict[str, Any] | None = None
        self._name: str | None = None
        self._full: bool | None = None

    @property
    def loaded(self) -> bool:
        return self.inner is not None

    def backend(self) -> Backend:
        """The side's backend, loaded now if it is not (releasing the other side's first)."""
        if self.slot is not None:
            self.slot.take(self)
        if self.inner is None:
            if self.loads == 0:
                status(f"loading the {self.role} model")
            self.inner = self._build()
            self.loads += 1
            self._description = self.inner.describe()
            self._name, self._full = self.inner.name, self.inner.full_distributions
            if self._tokenizer is None:
                self._tokenizer = self.inner.tokenizer
        return self.inner

    def release(self) -> None:
        if self.inner is not None:
            self.inner = None
            return_freed_memory()

    @property
    def name(self) -> str:
        return self._name if self._name is not None else self.backend().name

    @property
    def full_distributions(self) -> bool:
        return self._full if self._full is not None else self.backend().full_distributions

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer if self._tokenizer is not None else self.backend().tokenizer

    def describe(self) -> dict[str, Any]:
        return dict(self._description) if self._description is not None else self.backend().describe()

    def generate(self, prompts: list[str], params: GenParams) -> list[GeneratedText]:
        return self.backend().generate(prompts, params)

    def score(self, token_ids: list[list[int]]) -> list[Scored]:
        return self.backend().score(token_ids)
