"""llama.cpp as a batch-1 decode peer, in a child process (llama-cpp-python on a GGUF).

The child loads the model once and answers "decode n tokens" with the wall-clock stamp of each token, taken in the
child, so the pipe's latency never enters a rate.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .child import PeerProcess

# What the README's install line builds: no -march=native, so one build runs on every x86-64 machine with AVX2.
PORTABLE_CMAKE_ARGS = "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
REBUILD = (f'rebuild llama-cpp-python portably: CMAKE_ARGS="{PORTABLE_CMAKE_ARGS}" pip install --no-cache-dir '
           "--force-reinstall --no-deps llama-cpp-python==0.3.36 (a native build can use instructions this CPU or "
           "VM does not allow)")
LOAD_TIMEOUT_S = 300.0


class LlamaCppPeer:
    """One llama.cpp model in a child process; `decode(n)` returns the stamp of each of n greedy tokens."""

    def __init__(self, gguf: Path, threads: int, prompt: str, *, seconds_per_token: float = 1.0,
                 context: int = 1024) -> None:
        """`context`: llama.cpp's n_ctx, the prompt's tokens and the decoded ones."""
        self.seconds_per_token = seconds_per_token
        self.process = PeerProcess("llama.cpp", "qtoolkit.peers.llama_cpp_worker", crash_hint=REBUILD)
        self.info: dict[str, Any] = self.process.call(
            {"gguf": str(gguf), "threads": threads, "prompt": prompt, "n_ctx": context}, timeout=LOAD_TIMEOUT_S,
            doing=f"loading {gguf.name}")

    def decode(self, tokens: int) -> list[float]:
        answer = self.process.call({"tokens": tokens}, timeout=60 + tokens * self.seconds_per_token,
                                   doing=f"decoding {tokens} tokens")
        return answer["stamps"]

    def close(self) -> None:
        self.process.close()
