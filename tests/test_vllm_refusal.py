"""vllm_env.refusal quotes vLLM's own reason from its log: the first specific error line with its indented
continuation, a dotted pydantic error name included, without pydantic's link line (no vLLM needed: logs as vLLM
0.32 CPU wrote them)."""

from __future__ import annotations

from qtoolkit.peers.vllm_env import refusal

BNB = """(APIServer pid=10492) INFO 12-04 23:58:05 [utils.py:233] non-default args: {'model': '/ckpt'}
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
  Value error, Unknown quantization method: bitsandbytes. Must be one of ['awq', 'fp8', 'compressed-tensors'].
    For further information visit https://errors.pydantic.dev/2.14/v/value_error
"""

WNA16 = """(Worker pid=10338) ERROR 12-04 23:57:27 [multiproc_executor.py:953]     raise ValueError(
(Worker pid=10338) ERROR 12-04 23:57:27 [multiproc_executor.py:953] ValueError: Failed to find a kernel that can implement the WNA16 linear layer. Reasons:
(Worker pid=10338) ERROR 12-04 23:57:27 [multiproc_executor.py:953]  CPUWNA16LinearKernel cannot implement due to: Quant type (uint3b4) not supported by CPUWNA16
(APIServer pid=6) ERROR 12-04 23:57:29 [api_server.py:1] RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


def test_a_pydantic_refusal_is_quoted_by_its_reason(tmp_path):
    log = tmp_path / "bnb.log"
    log.write_text(BNB)
    got = refusal(log)
    assert "Unknown quantization method: bitsandbytes" in got and "errors.pydantic.dev" not in got


def test_the_specific_reason_wins_over_the_generic_wrapper(tmp_path):
    log = tmp_path / "wna16.log"
    log.write_text(WNA16)
    got = refusal(log)
    assert got.startswith("ValueError: Failed to find a kernel") and "uint3b4" in got
    assert "Engine core initialization failed" not in got
