"""The package as users install it: a built wheel (and sdist) holds every source file, and a non-editable install in a
fresh virtual environment imports every module and runs `qtool` from a directory outside the checkout.

The venv sees the machine's installed dependencies (torch alone is 700 MB) through a plain sys.path entry, not as
a site directory, so the checkout's editable-install hook (a .pth file there) is never loaded: a module missing from
the wheel cannot be found in the checkout instead.
"""

from __future__ import annotations

import json
import os
import site
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = {"qtoolkit": "qtoolkit", "kernels": "qtoolkit/kernels", "evals": "qtoolkit/evals", "recipes": "qtoolkit/recipes"}

pytestmark = pytest.mark.slow


def tracked_package_files() -> set[str]:
    """Every tracked file of the four source folders, as the path it must have inside the wheel."""
    listed = subprocess.run(["git", "ls-files", *ROOTS], cwd=REPO, capture_output=True, text=True, check=True)
    files = set()
    for path in listed.stdout.split():
        folder, _, rest = path.partition("/")
        files.add(f"{ROOTS[folder]}/{rest}")
    return files


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--sdist", "--outdir", str(out), str(REPO)],
                   check=True, capture_output=True, timeout=600)
    return out


@pytest.fixture(scope="module")
def installed(dist, tmp_path_factory) -> Path:
    env_dir = tmp_path_factory.mktemp("venv")
    venv.create(env_dir, with_pip=True)
    lib = next((env_dir / "lib").glob("python3*/site-packages"))
    # dependencies visible, their .pth hooks (the checkout's editable finder among them) not run
    (lib / "machine_packages.pth").write_text(
        f"import sys; sys.path.extend({site.getsitepackages()!r})\n")
    wheel = next(dist.glob("qtoolkit-*.whl"))
    subprocess.run([env_dir / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], check=True, capture_output=True, timeout=300)
    return env_dir


def outside_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "QTOOLKIT_QUIET": "1", **extra}


def test_wheel_and_sdist_hold_every_source_file(dist):
    wheel = zipfile.ZipFile(next(dist.glob("qtoolkit-*.whl")))
    missing = tracked_package_files() - set(wheel.namelist())
    assert not missing, f"files of the source tree missing from the wheel: {sorted(missing)[:10]}"
    # and nothing else: a module left in build/ by an earlier build must not ship
    extra = {n for n in wheel.namelist() if n.endswith(".py")} - tracked_package_files()
    assert not extra, f"Python files in the wheel that the source tree does not have: {sorted(extra)[:10]}"
    with tarfile.open(next(dist.glob("qtoolkit-*.tar.gz"))) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    listed = subprocess.run(["git", "ls-files", *ROOTS], cwd=REPO, capture_output=True, text=True, check=True)
    missing = set(listed.stdout.split()) - names
    assert not missing, f"files missing from the sdist: {sorted(missing)[:10]}"


def test_installed_wheel_imports_every_module_from_outside_the_checkout(installed, tmp_path):
    script = (
        "import importlib, json, pkgutil, qtoolkit\n"
        "names = [m.name for m in pkgutil.walk_packages(qtoolkit.__path__, 'qtoolkit.')\n"
        "         if not m.name.endswith('.__main__')]  # __main__ runs the CLI\n"
        "files = {n: importlib.import_module(n).__file__ for n in names}\n"
        "print(json.dumps({'root': qtoolkit.__file__, 'files': files}))\n")
    done = subprocess.run([installed / "bin" / "python", "-c", script], cwd=tmp_path, env=outside_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.splitlines()[-1])
    expected = {p.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
                for p in tracked_package_files() if p.endswith(".py") and not p.endswith("__main__.py")}
    assert expected <= set(found["files"]) | {"qtoolkit"}
    assert all(str(installed) in f for f in [found["root"], *found["files"].values()])


def test_installed_qtool_runs_version_help_generate_and_serve(installed, tiny_model_dir, tmp_path):
    qtool = installed / "bin" / "qtool"
    env = outside_env()
    version = subprocess.run([qtool, "--version"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert version.returncode == 0 and "0.1" in version.stdout + version.stderr
    helped = subprocess.run([qtool, "--help"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and "signoff" in helped.stdout
    gen = subprocess.run([qtool, "generate", "--model", str(tiny_model_dir), "--prompt", "hi", "--max-tokens", "4",
                          "--temperature", "0"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert gen.returncode == 0, gen.stderr[-2000:]
    assert gen.stdout.strip()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([qtool, "serve", "--model", str(tiny_model_dir), "--port", str(port),
                               "--speculative", "ngram", "--kv-cache-memory", "64MiB"], cwd=tmp_path, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline, health = time.monotonic() + 300, None
        while time.monotonic() < deadline and server.poll() is None and health is None:
            try:
                health = urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status
            except OSError:
                time.sleep(1)
        assert health == 200, f"serve did not come up: {server.poll()=}"
        body = json.dumps({"model": tiny_model_dir.name, "prompt": "hi", "max_tokens": 4, "temperature": 0})
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(req, timeout=120).read())
        assert answer["choices"][0]["text"] is not None
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_installed_qtool_starts_its_servers_from_inside_the_checkout(installed, tiny_model_dir, tmp_path):
    # `python -m qtoolkit` in the checkout would import its qtoolkit/ folder, which holds no evals/ or kernels/
    out = tmp_path / "bench.json"
    done = subprocess.run([installed / "bin" / "qtool", "bench", "serve", "--model", str(tiny_model_dir),
                           "--max-concurrency", "1", "--num-prompts", "2", "--mean-output-tokens", "4",
                           "--max-output-tokens", "8", "--kv-cache-memory", "64MiB", "--output", str(out)],
                          cwd=REPO, env=outside_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(out.read_text())["tiers"]
