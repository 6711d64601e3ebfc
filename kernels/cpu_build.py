"""Build the AVX2 CPU extensions once and cache them; None when that is impossible.

Three extensions: the dequant-matmul kernels (kernels/cpu_kernels.cpp), the engine's step ops
(kernels/cpu_engine_ops.cpp: paged attention, fused residual + RMSNorm, dense GEMV) and the decode layer loop
(kernels/cpu_decode.cpp, which includes the other two sources and calls their ops from C++). All three include
kernels/cpu_isa.h, which picks AVX-512 functions at run time; the build itself targets AVX2.

The build goes to ~/.cache/qtoolkit/torch_extensions (override with QTOOLKIT_EXT_DIR) and is reused while the
source and compiler flags are unchanged. Without gcc, without AVX2, or with QTOOLKIT_NO_CPU_EXT=1 the callers
fall back to torch ops (correct, slower).

torch's builder serializes on a `lock` file it creates and removes; a build killed midway (Ctrl-C, OOM) leaves it
behind and every later load waits on it forever. So qtoolkit's builders first take an flock on a sidecar file,
which the kernel releases when its holder dies: whoever holds it is the only qtoolkit builder of that folder, and
a `lock` file it finds is a dead build's, removed before torch looks.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
ENGINE_OPS_SOURCE = Path(__file__).with_name("cpu_engine_ops.cpp")
DECODE_SOURCE = Path(__file__).with_name("cpu_decode.cpp")
ISA_HEADER = Path(__file__).with_name("cpu_isa.h")  # the run-time AVX-512 checks every source includes
# -ffp-contract=off: scalar a*b - c*d stays two rounded products, as in torch (the intrinsics' FMAs are explicit)
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off"]


def cpu_has_avx2() -> bool:
    try:
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    except Exception:  # pragma: no cover - very old torch
        return False


@functools.cache
def cpu_kernels():
    """The compiled dequant-matmul extension, or None (reason logged once)."""
    return _build("qtoolkit_cpu", SOURCE, (ISA_HEADER,))


@functools.cache
def engine_ops():
    """The compiled engine-ops extension, or None (reason logged once)."""
    return _build("qtoolkit_engine_ops", ENGINE_OPS_SOURCE, (ISA_HEADER,))


@functools.cache
def fused_decode():
    """The compiled decode-loop extension (DecodePlan), or None (reason logged once)."""
    return _build("qtoolkit_decode", DECODE_SOURCE, (SOURCE, ENGINE_OPS_SOURCE, ISA_HEADER))


def build_directory(prefix: str, source: Path, includes: tuple[Path, ...] = ()) -> Path:
    """Where one extension is built: named by a hash of its source (and the sources it includes), flags and
    torch version."""
    code = b"".join(p.read_bytes() for p in (source, *includes))
    tag = hashlib.sha256(code + " ".join(FLAGS).encode() + torch.__version__.encode()).hexdigest()[:12]
    root = Path(os.environ.get("QTOOLKIT_EXT_DIR", Path.home() / ".cache" / "qtoolkit" / "torch_extensions"))
    return root / f"{prefix}_{tag}"


def _build(prefix: str, source: Path, includes: tuple[Path, ...] = ()):
    if os.environ.get("QTOOLKIT_NO_CPU_EXT") == "1":
        return None
    if not cpu_has_avx2() or not all(p.exists() for p in (source, *includes)):
        log.info("qtoolkit CPU kernels unavailable (no AVX2 or source missing); using torch fallback")
        return None

    build_dir = build_directory(prefix, source, includes)
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        with open(build_dir / "qtoolkit-build.flock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            (build_dir / "lock").unlink(missing_ok=True)  # a killed build's baton: nobody else holds the flock
            return load(name=build_dir.name, sources=[str(source)], extra_cflags=FLAGS,
                        extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)
    except Exception as e:  # no compiler, bad headers: the torch path still works
        log.warning("qtoolkit CPU kernels (%s) failed to build (%s); using torch fallback", source.name,
                    str(e).splitlines()[0])
        return None
