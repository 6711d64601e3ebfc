"""Progress reporting: tqdm bars on stderr, quiet when QTOOLKIT_QUIET=1 (tests)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")


def quiet() -> bool:
    return os.environ.get("QTOOLKIT_QUIET", "") == "1"


def bar(it: Iterable[T] | None = None, **kw) -> tqdm:
    kw.setdefault("disable", quiet())
    kw.setdefault("file", sys.stderr)
    kw.setdefault("dynamic_ncols", True)
    return tqdm(it, **kw)


def status(msg: str) -> None:
    if not quiet():
        print(f"qtool: {msg}", file=sys.stderr, flush=True)
