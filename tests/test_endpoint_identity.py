"""An endpoint's identity (model id + a fingerprint of its answers) decides what a deployment sign-off reuses:
`qtool serve` restarted at the same port with another checkpoint under the same model id must be detected and
measured again, while the same deployment asked again is reused. Real `qtool serve` processes on loopback."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from conftest import build_tiny_llama

from qtoolkit.cli import main
from qtoolkit.endpoints.identity import TOLERANCE_NATS, EndpointIdentity, Fingerprint, settle
from qtoolkit.launch import python_module_argv
from qtoolkit.server.process import free_port

LOAD = ["--concurrency", "1", "--num-requests", "1", "--rounds", "2", "--limit", "1", "--max-items", "1"]


@contextlib.contextmanager
def qtool_serve(model: Path, port: int):
    """`qtool serve` through its CLI on a fixed port (a redeploy keeps the URL), stopped by pid."""
    proc = subprocess.Popen([*python_module_argv("qtoolkit"), "serve", "--model", str(model), "--port", str(port),
                             "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 900  # a loaded 2-core machine may take minutes
        while True:
            assert proc.poll() is None, f"qtool serve {model} exited with {proc.returncode}"
            assert time.monotonic() < deadline, f"qtool serve {model} not healthy after 900 s"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.3)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    """Two different random LLaMAs in folders of one name: `qtool serve` lists both as model id `model`."""
    root = tmp_path_factory.mktemp("identity")
    return {name: build_tiny_llama(root / name / "model", tokenizer_dir, seed=seed)
            for name, seed in (("first", 0), ("second", 1))}


def signoff(cand: str, base: str, model: Path, out: Path, policy: Path) -> tuple[int, dict]:
    code = main(["signoff", "--candidate-endpoint", cand, "--baseline-endpoint", base, "--model", str(model),
                 "--baseline", str(model), "--policy", str(policy), *LOAD, "--output", str(out)])
    return code, json.loads((out / "report.json").read_text())


def test_a_redeploy_at_the_same_url_is_measured_again(checkpoints, tmp_path, capsys):
    policy = tmp_path / "nll.yaml"
    policy.write_text("version: 1\nname: nll\ntasks:\n  summarization:\n    nll_delta: {max: 0.1}\n")
    out, port = tmp_path / "run", free_port()
    with qtool_serve(checkpoints["first"], free_port()) as base:
        with qtool_serve(checkpoints["first"], port) as cand:
            first = signoff(cand, base, checkpoints["first"], out, policy)
            again = signoff(cand, base, checkpoints["first"], out, policy)
        capsys.readouterr()
        with qtool_serve(checkpoints["second"], port) as cand:  # same URL, same model id, other weights
            third = signoff(cand, base, checkpoints["first"], out, policy)
    err = capsys.readouterr().err
    for code, report in (first, again, third):
        assert code in (0, 1, 3) and all(s["status"] == "ok" for s in report["steps"].values())
    assert first[1]["deployments"]["candidate"]["model_id"] == third[1]["deployments"]["candidate"]["model_id"]
    # the same deployment asked again: its steps are reused, its identity unchanged
    assert again[1]["steps"]["eval"].get("skipped") and again[1]["steps"]["bench"].get("skipped")
    assert again[1]["deployments"]["candidate"]["identity"] == first[1]["deployments"]["candidate"]["identity"]
    assert again[1]["deployments"]["candidate"]["changed"] is None
    # the redeploy: named in one line, its steps measured again, the baseline's identity kept
    lines = [ln for ln in err.splitlines() if "is not the deployment of the last run" in ln]
    assert len(lines) == 1 and "candidate endpoint" in lines[0] and "log-probs on the probe moved" in lines[0]
    assert not third[1]["steps"]["eval"].get("skipped") and not third[1]["steps"]["bench"].get("skipped")
    assert third[1]["deployments"]["candidate"]["changed"].startswith("its log-probs on the probe moved")
    assert third[1]["deployments"]["candidate"]["identity"] != first[1]["deployments"]["candidate"]["identity"]
    assert third[1]["deployments"]["baseline"]["identity"] == first[1]["deployments"]["baseline"]["identity"]
    nll = [next(g["point"] for g in r["gates"] if g["name"] == "summarization.nll_delta") for _, r in (first, third)]
    assert nll[0] == 0.0 and nll[1] != 0.0  # measured on the second checkpoint, not read back from the first


def fp(logprobs: list[float], text: str = " red") -> Fingerprint:
    return Fingerprint("echo+logprobs", text, [f"t{i}" for i in range(len(logprobs))], logprobs)


def test_noise_below_the_tolerance_keeps_the_recorded_identity(tmp_path):
    old = EndpointIdentity("http://h:1", "m", fp([-1.0, -2.0, None]))  # type: ignore[list-item]
    assert settle(tmp_path, "baseline", old) == (old, None)  # first run: recorded
    noisy = EndpointIdentity("http://h:1", "m", fp([-1.0 + TOLERANCE_NATS / 2, -2.0, None]))  # type: ignore[list-item]
    assert settle(tmp_path, "baseline", noisy) == (old, None)  # the recorded one keys the reuse
    moved = EndpointIdentity("http://h:1", "m", fp([-1.0 + 3 * TOLERANCE_NATS, -2.0, None]))  # type: ignore[list-item]
    settled, change = settle(tmp_path, "baseline", moved)
    assert settled == moved and "moved by up to 0.030 nats" in change
    renamed = EndpointIdentity("http://h:1", "other", moved.fingerprint)
    assert settle(tmp_path, "baseline", renamed)[1] == "it now serves 'other', before 'm'"
    retexted = EndpointIdentity("http://h:1", "other", fp(list(moved.fingerprint.logprobs), " blue"))
    assert "greedy answer to the probe changed from ' red' to ' blue'" in settle(tmp_path, "baseline", retexted)[1]
    assert EndpointIdentity.from_json(json.loads((tmp_path / "endpoints.json").read_text())["baseline"]) == retexted


def test_cached_completions_are_keyed_by_what_the_endpoint_serves(tmp_path):
    """A sweep's baseline completions (evals/backends/cached.py) are keyed by the baseline's identity: a redeploy
    behind the same URL misses the cache instead of answering with the old model's completions."""
    from qtoolkit.evals.backends.base import GeneratedText, GenParams
    from qtoolkit.evals.backends.cached import CachedGenerations
    from qtoolkit.evals.runner import model_identity

    class Inner:
        name, tokenizer, full_distributions, calls = "openai", None, False, 0

        def generate(self, prompts, params):
            Inner.calls += len(prompts)
            return [GeneratedText(f"answer {Inner.calls}", [1], "stop") for _ in prompts]

    params, path = GenParams(8, 0.0, [], 0), tmp_path / "generations.jsonl"
    before = model_identity("default", "http://h:8001", "engine", served="key-of-first-deployment")
    after = model_identity("default", "http://h:8001", "engine", served="key-of-second-deployment")
    first = CachedGenerations(Inner(), path, before).generate(["p"], params)
    assert CachedGenerations(Inner(), path, before).generate(["p"], params) == first and Inner.calls == 1
    assert CachedGenerations(Inner(), path, after).generate(["p"], params) != first and Inner.calls == 2
