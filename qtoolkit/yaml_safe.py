"""Bounded YAML loading for recipes and sign-off policies: size-capped, no anchors or aliases, one-line errors.

Aliases are what makes a few hundred bytes expand exponentially (each level of nested aliases multiplies the
composed tree), which hangs any pass that walks the tree, e.g. a CI gate that only parses a policy. Recipes
and policies are short hand-written files that never need them, so they are refused at the event level,
before anything is composed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from .errors import QToolError

MAX_YAML_BYTES = 1 << 20


class YAMLInputError(QToolError):
    """A YAML file that is too large, uses anchors/aliases or is malformed."""


def read_yaml_text(path: str | os.PathLike, error: type[QToolError] = YAMLInputError,
                   max_bytes: int = MAX_YAML_BYTES) -> str:
    """The file's text, refused before it is read whole when it is larger than max_bytes."""
    path = Path(path)
    size = path.stat().st_size
    if size > max_bytes:
        raise error(f"{path}: {size} bytes is larger than the {max_bytes}-byte limit for a YAML file: this is "
                    "not a recipe or policy (check the path)")
    with path.open("rb") as f:
        raw = f.read(max_bytes + 1)
    if len(raw) > max_bytes:  # it grew since the stat
        raise error(f"{path}: larger than the {max_bytes}-byte limit for a YAML file: check the path")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text (byte {e.start}): save it as UTF-8") from None


def safe_compose(text: str, source: str, error: type[QToolError] = YAMLInputError,
                 max_bytes: int = MAX_YAML_BYTES) -> tuple[Any, yaml.Node | None]:
    """(data, composed node) of one YAML document with no anchors or aliases."""
    if len(text) > max_bytes:
        raise error(f"{source}: {len(text)} characters is larger than the {max_bytes}-byte limit for a YAML file")
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
                line = event.start_mark.line + 1
                raise error(f"{source}:{line}: YAML anchors and aliases (&name, *name) are not accepted: write "
                            "the values out in full")
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise error(f"{where}: malformed YAML ({problem}): fix the syntax at that line") from None
    return data, node


def load_yaml_file(path: str | os.PathLike, error: type[QToolError] = YAMLInputError) -> Any:
    """The data of a bounded, alias-free YAML file."""
    return safe_compose(read_yaml_text(path, error), str(path), error)[0]
