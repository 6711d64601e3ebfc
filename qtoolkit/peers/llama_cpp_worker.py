"""The child side of the llama.cpp peer: `python -m qtoolkit.peers.llama_cpp_worker`, JSON lines on stdin/stdout."""

from __future__ import annotations

import time
from typing import Any

from .child import serve


class Worker:
    def __init__(self) -> None:
        self.llm = None
        self.prompt: list[int] = []

    def __call__(self, request: dict[str, Any]) -> dict[str, Any]:
        if self.llm is None:
            return self.load(request)
        return {"stamps": self.decode(int(request["tokens"]))}

    def load(self, request: dict[str, Any]) -> dict[str, Any]:
        try:
            import llama_cpp
        except ImportError:
            raise RuntimeError("llama-cpp-python is not installed: install the `llamacpp` extra "
                               "(it compiles llama.cpp, ~10 min on 2 cores), or drop llama.cpp from --compare") from None
        threads = int(request["threads"])
        self.llm = llama_cpp.Llama(model_path=request["gguf"], n_ctx=int(request.get("n_ctx", 1024)),
                                   n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)
        self.prompt = self.llm.tokenize(request["prompt"].encode())
        return {"llama_cpp_python": llama_cpp.__version__,
                "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}

    def decode(self, tokens: int) -> list[float]:
        self.llm.reset()
        stamps: list[float] = []
        for _ in self.llm.generate(self.prompt, top_k=1, temp=0.0, reset=True):
            stamps.append(time.perf_counter())
            if len(stamps) == tokens:
                break
        return stamps


if __name__ == "__main__":
    serve(Worker())
