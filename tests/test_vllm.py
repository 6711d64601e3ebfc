"""The vLLM tier (`pytest -m vllm`, CI's third pass): vLLM CPU 0.32 from the project's own env (.venv-vllm, built
once by `python -m qtoolkit.peers.vllm_env`) serves the default model and qtoolkit's checkpoints, and the
scale-out path runs against it: a deployment sign-off with both sides served by vLLM ends in a decisive verdict
with its NLL gates measured through vLLM's echo + logprobs, and a redeploy at the same URL is detected.

vLLM starts slowly on 2 shared cores: one or two servers at a time, each with a bounded start-up wait, a 1 GiB KV
cache and its OpenMP threads bound to its own core, stopped by process group."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import httpx
import pytest

from qtoolkit.cli import main
from qtoolkit.peers.vllm_env import ENV_VAR, STAMP, VLLMError, ensure_env, vllm_server

pytestmark = pytest.mark.vllm
REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Photosynthesis is the process by which",
           "Once upon a time, in a small village,"]
POLICY = """version: 1
name: vllm-nll
tasks:
  summarization:
    nll_delta: {max: 0.10}
memory:
  max_linear_ratio_vs_bf16: 0.55
"""
# 8 items, up to 16 while the NLL gate is undecided: fp8-dynamic's per-item NLL deltas on the default model have
# an sd of ~0.1 nats, so 4 items leave the interval straddling the 0.1 bound
LOAD = ["--concurrency", "1", "--num-requests", "2", "--rounds", "2", "--limit", "8", "--max-items", "16"]
# torch.compile costs vLLM minutes per checkpoint on 2 cores; what these tests check does not depend on it
EAGER = ["--enforce-eager"]


@pytest.fixture(scope="session")
def venv():
    return ensure_env(Path(os.environ.get(ENV_VAR) or REPO / ".venv-vllm"))


@pytest.fixture(scope="session")
def fp8_dir(tmp_path_factory) -> Path:
    from qtoolkit.quantize.run import quantize

    out = tmp_path_factory.mktemp("vllm-fp8") / "SmolLM2-fp8-dynamic"
    quantize("default", "fp8-dynamic", out)
    return out


def complete(url: str, model: str, prompt, **kw) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": prompt, "temperature": 0.0, **kw},
                   timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_the_env_is_built_once_and_reused(venv):
    stamp = venv.path / STAMP
    before = stamp.stat().st_mtime_ns
    again = ensure_env(venv.path)
    assert again.versions == venv.versions and venv.versions["vllm"] == "0.32.0"
    assert venv.versions["torch"].startswith("2.13.0") and stamp.stat().st_mtime_ns == before
    assert not any((venv.path / "lib").glob("python*/site-packages/torchvision"))


def test_default_model_greedy_agrees_with_qtool_generate_and_scores_prompts(venv, tmp_path):
    from qtoolkit.engine import Engine, EngineConfig, SamplingParams

    engine = Engine("default", EngineConfig())
    ids = [engine.tokenizer(p, add_special_tokens=False).input_ids for p in PROMPTS]
    ours = [o.token_ids for o in engine.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0))]
    del engine
    with vllm_server(venv, "default", served_model_name="smollm2", omp_threads_bind="0",
                     log_dir=tmp_path, extra_args=EAGER) as server:
        theirs = [complete(server.url, "smollm2", p, max_tokens=16, return_token_ids=True)["token_ids"]
                  for p in ids]
        scored = complete(server.url, "smollm2", ids[0], max_tokens=1, echo=True, logprobs=1)
        echo_only = httpx.post(f"{server.url}/v1/completions", json={
            "model": "smollm2", "prompt": ids[0], "max_tokens": 0, "echo": True, "logprobs": 1}, timeout=60)
    # fp32 on both engines: greedy paths start the same (summation order may split a near-tie later on)
    assert all(a[:4] == b[:4] for a, b in zip(ours, theirs, strict=True)), (ours, theirs)
    assert sum(a == b for a, b in zip(ours, theirs, strict=True)) >= len(PROMPTS) - 1, (ours, theirs)
    lp = scored["logprobs"]  # what the NLL gates read: one log-prob per prompt token, the first None
    assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(ids[0]) + 1
    assert all(x < 0 for x in lp["token_logprobs"][1:])
    assert echo_only.status_code == 200, echo_only.text


@pytest.fixture(scope="module")
def deployments(venv, fp8_dir, tmp_path_factory):
    """vLLM on the default model (fp32, baseline) and on qtoolkit's fp8-dynamic checkpoint (candidate), each with
    its OpenMP threads on its own core; `stop_candidate()` ends the candidate early (for a redeploy)."""
    logs = tmp_path_factory.mktemp("vllm-logs")
    with contextlib.ExitStack() as stack, contextlib.ExitStack() as candidate:
        base = stack.enter_context(vllm_server(venv, "default", served_model_name="smollm2", omp_threads_bind="0",
                                               log_dir=logs, extra_args=EAGER))
        cand = candidate.enter_context(vllm_server(venv, fp8_dir, served_model_name="smollm2-candidate",
                                                   omp_threads_bind="1", log_dir=logs, extra_args=EAGER))
        yield {"baseline": base, "candidate": cand, "logs": logs, "stop_candidate": candidate.close}


def signoff(deps: dict, model: Path, out: Path, policy: Path) -> tuple[int, dict]:
    code = main(["signoff", "--candidate-endpoint", f"{deps['candidate'].url}/v1", "--baseline-endpoint",
                 deps["baseline"].url, "--model", str(model), "--baseline", "default", "--policy", str(policy),
                 *LOAD, "--output", str(out)])
    return code, json.loads((out / "report.json").read_text())


def test_signoff_with_both_sides_served_by_vllm_is_decisive(deployments, fp8_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("vllm-signoff")
    (folder / "policy.yaml").write_text(POLICY)
    code, report = signoff(deployments, fp8_dir, folder / "run", folder / "policy.yaml")
    assert report["verdict"] in ("PASS", "FAIL") and code == {"PASS": 0, "FAIL": 1}[report["verdict"]], report
    gates = {g["name"]: g for g in report["gates"]}
    nll = gates["summarization.nll_delta"]  # measured through vLLM's echo + logprobs, never "not measurable"
    assert nll["state"] is None and nll["point"] is not None and nll["verdict"] in ("PASS", "FAIL")
    served = report["deployments"]
    assert served["candidate"]["model_id"] == "smollm2-candidate" and served["baseline"]["model_id"] == "smollm2"
    assert served["baseline"]["version"]["version"] == "0.32.0"  # vLLM's /version
    assert served["candidate"]["fingerprint"]["method"] == "echo+logprobs"
    assert {t["concurrency"] for t in report["deployment_bench"]["tiers"]} == {1}


def test_a_redeploy_at_the_same_vllm_url_is_detected(deployments, venv, fp8_dir, tmp_path_factory, capfd):
    """The candidate's URL and model id stay; the weights behind them become the unquantized model's."""
    folder = tmp_path_factory.mktemp("vllm-redeploy")
    (folder / "policy.yaml").write_text(POLICY)
    out = folder / "run"
    first = signoff(deployments, fp8_dir, out, folder / "policy.yaml")[1]
    cand = deployments["candidate"]
    port = int(cand.url.rsplit(":", 1)[1])
    deployments["stop_candidate"]()
    capfd.readouterr()
    with vllm_server(venv, "default", served_model_name="smollm2-candidate", omp_threads_bind="1", port=port,
                     log_dir=deployments["logs"], extra_args=EAGER) as redeployed:
        second = signoff({**deployments, "candidate": redeployed}, fp8_dir, out, folder / "policy.yaml")[1]
    err = capfd.readouterr().err
    lines = [ln for ln in err.splitlines() if "is not the deployment of the last run" in ln]
    assert len(lines) == 1 and "candidate endpoint" in lines[0] and cand.url in lines[0], err[-2000:]
    assert second["deployments"]["candidate"]["changed"] and not second["steps"]["eval"].get("skipped")
    assert second["deployments"]["baseline"]["changed"] is None
    nll = [next(g["point"] for g in r["gates"] if g["name"] == "summarization.nll_delta") for r in (first, second)]
    assert nll[0] != 0.0 and nll[1] == 0.0  # the redeploy serves the baseline's own weights: measured, not reused


def test_a_checkpoint_vllm_refuses_is_one_line_quoting_its_reason(venv, tmp_path):
    """qtoolkit's int8-weight checkpoint (W8A16, uint8b128): vLLM CPU's W-A16 kernels take 4-bit weights only."""
    from qtoolkit.quantize.run import quantize

    quantize("default", "int8-weight", tmp_path / "int8")
    with pytest.raises(VLLMError) as e, vllm_server(venv, tmp_path / "int8", startup_timeout_s=420, log_dir=tmp_path,
                                                 extra_args=EAGER):
        pass
    assert "vLLM exited" in str(e.value) and "\n" not in str(e.value)
    assert "uint4" in str(e.value), str(e.value)  # vLLM's own reason, quoted
