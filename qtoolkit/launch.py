"""How qtool starts Python children (servers, peers): the package as installed, never a folder of the working directory.

`python -m qtoolkit` puts the working directory first on sys.path, so run from a source checkout with a
non-editable install it imports the checkout's `qtoolkit/` folder, which lacks `qtoolkit.evals` and
`qtoolkit.kernels` (they install from `evals/` and `kernels/`). The child drops that entry before importing.
"""

from __future__ import annotations

import ctypes
import signal
import sys
from collections.abc import Callable

_RUN = "import runpy, sys; sys.path.pop(0); sys.argv[0] = {module!r}; runpy.run_module({module!r}, run_name='__main__')"


def python_module_argv(module: str) -> list[str]:
    """argv that runs `python -m MODULE` without the working directory on sys.path (what `-P` does on 3.11+)."""
    return [sys.executable, "-c", _RUN.format(module=module)]


def parent_death_signal(sig: signal.Signals = signal.SIGTERM) -> Callable[[], None] | None:
    """Linux: a hook that has the calling process sent `sig` when its parent dies (SIGKILL, crash), so no child
    outlives a benchmark or a sign-off killed without cleanup; None elsewhere.

    libc is loaded here, in the parent: a hook run between fork and exec must not import.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, sig)  # 1 = PR_SET_PDEATHSIG
