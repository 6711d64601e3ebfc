"""Plain transformers backend: the cross-check for the engine (and the path before the engine existed).

Loads any model source; compressed-tensors checkpoints load through transformers' own quantizer.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList

from qtoolkit.model.sources import resolve_model

from .base import BackendError, GeneratedText, GenParams, Scored, scored_from_logprobs, truncate_at_stop


class HFBackend:
    name = "hf"
    full_distributions = True

    def __init__(self, spec: str, batch_size: int = 8, **_: Any):
        self.source = resolve_model(spec)
        self.batch_size = batch_size
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.source.path)
            self.model = AutoModelForCausalLM.from_pretrained(self.source.path, dtype=torch.float32,
                                                              use_safetensors=True).eval()
        except (OSError, ValueError) as e:
            raise BackendError(f"transformers cannot load {self.source.path} ({e}): check the model folder") from None
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, **self.source.describe()}

    def generate(self, prompts: list[str], params: GenParams) -> list[GeneratedText]:
        out: list[GeneratedText] = []
        tok = self.tokenizer
        tok.padding_side = "left"  # decoder-only batches pad on the left so every row ends at the prompt
        for start in range(0, len(prompts), self.batch_size):
            chunk = prompts[start:start + self.batch_size]
            enc = tok(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
            kw: dict[str, Any] = {"max_new_tokens": params.max_tokens, "pad_token_id": tok.pad_token_id}
            if params.temperature > 0:
                torch.manual_seed(params.seed or 0)
                kw.update(do_sample=True, temperature=params.temperature, top_k=0, top_p=1.0)
            else:
                kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
            if params.stop:
                kw["stopping_criteria"] = StoppingCriteriaList([_StopInCompletion(tok, params.stop,
                                                                                  enc["input_ids"].shape[1])])
            with torch.inference_mode():
                seqs = self.model.generate(**enc, **kw)
            for row in seqs[:, enc["input_ids"].shape[1]:].tolist():
                ids = _strip_after_eos(row, tok.eos_token_id)
                full = tok.decode(ids, skip_special_tokens=True)
                text, stopped = truncate_at_stop(full, params.stop)
                done = stopped or len(ids) < len(row) or (ids and ids[-1] == tok.eos_token_id)
                out.append(GeneratedText(text, ids, "stop" if done else "length"))
        return out

    def score(self, token_ids: list[list[int]]) -> list[Scored]:
        out = []
        with torch.inference_mode():
            for ids in token_ids:
                logits = self.model(torch.tensor([ids])).logits[0].float()
                out.append(scored_from_logprobs(torch.log_softmax(logits, -1), ids))
        return out


class _StopInCompletion(StoppingCriteria):
    """Stops a row once its completion holds a stop string. transformers' own `stop_strings` also matches a stop
    that begins in the prompt (a prompt ending in a newline plus a completion starting with `#` reads as the
    "\\n#" stop), while the engine and OpenAI servers look at the completion alone: a paired comparison needs
    every backend to stop at the same place."""

    def __init__(self, tokenizer: Any, stop: list[str], prompt_len: int):
        self.tokenizer, self.stop, self.prompt_len = tokenizer, list(stop), prompt_len
        # a stop that ends at the newest token lies within its last len(stop) tokens (each token is >= 1
        # character); transformers keeps a stopped row stopped, so only that tail is decoded each step
        self.tail = max(len(s) for s in self.stop) + 1

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **_: Any) -> torch.Tensor:
        start = max(self.prompt_len, input_ids.shape[1] - self.tail)
        texts = self.tokenizer.batch_decode(input_ids[:, start:], skip_special_tokens=True)
        return torch.tensor([any(s in t for s in self.stop) for t in texts], device=input_ids.device)


def _strip_after_eos(row: list[int], eos: int | None) -> list[int]:
    if eos is not None and eos in row:
        return row[: row.index(eos) + 1]
    return row
