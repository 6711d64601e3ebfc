"""`qtool signoff` prints its verdict on stdout and nothing else there: llm-compressor's logger, which binds to
whatever sys.stdout is when it is imported, must be imported while stdout goes to stderr (the main job's stdout
began with five of its warnings before)."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
from qtoolkit.cli import main
code = main(["signoff", "--model", "default", "--recipe", "fp8-dynamic", "--rejudge", "--output", sys.argv[1]])
from loguru import logger  # the logger llm-compressor configured when the sign-off imported it
logger.error("probe from llm-compressor's sink")
print(f"exit {code}, llm-compressor imported: {'llmcompressor' in sys.modules}")
"""


def test_the_sign_offs_libraries_log_to_stderr_and_stdout_keeps_the_answer(tmp_path):
    proc = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "no-run-here")], capture_output=True,
                          text=True, timeout=300)
    assert proc.stdout.strip().splitlines()[-1] == "exit 2, llm-compressor imported: True", proc.stdout + proc.stderr
    assert "probe from llm-compressor's sink" in proc.stderr
    assert "probe" not in proc.stdout and "WARNING" not in proc.stdout and "ERROR" not in proc.stdout, proc.stdout
