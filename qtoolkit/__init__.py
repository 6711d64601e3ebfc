"""qtoolkit: quantize a released LLM, serve it, and prove it is still good enough to ship.

Kept light on purpose: importing `qtoolkit` loads no torch; the commands import what they need.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("qtoolkit")
except PackageNotFoundError:  # a source tree on sys.path without an installed distribution
    __version__ = "0+unknown"
