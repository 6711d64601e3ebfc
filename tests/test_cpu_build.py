"""A build killed midway must not hang later runs: torch's `lock` baton file it leaves behind is cleared."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from qtoolkit.kernels.cpu_build import ENGINE_OPS_SOURCE, ISA_HEADER, build_directory, engine_ops

LOAD = "from qtoolkit.kernels.cpu_build import engine_ops; print(engine_ops() is not None)"


@pytest.fixture
def built_dir():
    if engine_ops() is None:
        pytest.skip("the AVX2 engine ops are not built on this machine")
    return build_directory("qtoolkit_engine_ops", ENGINE_OPS_SOURCE, (ISA_HEADER,))


def test_a_killed_builds_lock_file_does_not_hang_the_next_load(built_dir):
    # a builder killed with SIGKILL while holding both locks: the flock dies with it, the baton file stays
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time\n"
        f"f = open({str(built_dir / 'qtoolkit-build.flock')!r}, 'w'); fcntl.flock(f, fcntl.LOCK_EX)\n"
        f"open({str(built_dir / 'lock')!r}, 'x'); print('held', flush=True); time.sleep(600)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
        assert (built_dir / "lock").exists()
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "QTOOLKIT_QUIET": "1"})
        assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr[-2000:]
        assert not (built_dir / "lock").exists() and time.monotonic() - t0 < 300
    finally:
        holder.kill()
        (built_dir / "lock").unlink(missing_ok=True)


def test_instruction_set_is_chosen_at_run_time_not_from_the_build_machine():
    from qtoolkit.kernels.cpu_build import FLAGS

    assert not any(f.startswith(("-march", "-mtune=native")) for f in FLAGS)
    # a CPU (or VM) that allows no AVX2: torch's run-time check says so and the kernels are not loaded
    probe = ("import torch; from qtoolkit.kernels.cpu_build import cpu_kernels, engine_ops; "
             "print(torch.backends.cpu.get_cpu_capability(), cpu_kernels() is None and engine_ops() is None)")
    done = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "ATEN_CPU_CAPABILITY": "default"},
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["DEFAULT", "True"], done.stderr[-1000:]


@pytest.mark.skipif(shutil.which("c++") is None or os.environ.get("QTOOLKIT_NO_CPU_EXT") == "1",
                    reason="no C++ compiler, or the extensions are turned off")
def test_every_extension_builds_where_the_cpu_allows_it():
    # the kernel tests skip when an extension is unavailable; a build broken by a change must fail here instead
    from qtoolkit.kernels.cpu_build import cpu_has_avx2, cpu_kernels, fused_decode

    if not cpu_has_avx2():
        pytest.skip("no AVX2 on this CPU")
    assert cpu_kernels() is not None and engine_ops() is not None and fused_decode() is not None
