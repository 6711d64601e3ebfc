"""lm-eval model `qtoolkit`: lm-evaluation-harness requests served by our engine (or the hf cross-check).

    lm_eval.simple_evaluate(model="qtoolkit", model_args="pretrained=/path/or/default,backend=engine", ...)

Importing this module registers the model; `qtool eval --harness lm-eval` and `qtool-lm-eval` do that.
"""

from __future__ import annotations

from typing import Any

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from ..backends.base import GenParams
from ..backends.factory import make_backend

SCORE_BATCH = 16  # sequences per score() call: bounds the [T, vocab] tensors held at once


@register_model("qtoolkit")
class QToolkitLM(LM):
    def __init__(self, pretrained: str = "default", backend: str = "engine", max_length: int = 2048,
                 max_gen_toks: int = 256, **_: Any):
        super().__init__()
        self.backend = make_backend(str(pretrained), kind=backend)
        self.tokenizer = self.backend.tokenizer
        self.max_length, self.max_gen_toks = int(max_length), int(max_gen_toks)
        self.prefix_token = self.tokenizer.eos_token_id  # scores the first token of a rolling text

    def _score(self, sequences: list[list[int]]):
        out = []
        for i in range(0, len(sequences), SCORE_BATCH):
            out += self.backend.score(sequences[i:i + SCORE_BATCH])
        return out

    def _context_continuation(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        # Whitespace belongs to the continuation's first token, as lm-eval's own models split it.
        n = len(context) - len(context.rstrip())
        context, continuation = context[: len(context) - n], context[len(context) - n:] + continuation
        ctx = self.tokenizer(context, add_special_tokens=False).input_ids if context else []
        cont = self.tokenizer(continuation, add_special_tokens=False).input_ids
        if not ctx:
            ctx = [self.prefix_token]
        keep = self.max_length - len(cont)
        return ctx[-keep:] if keep > 0 else ctx[-1:], cont[-(self.max_length - 1):]

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        pairs = [self._context_continuation(*r.args) for r in requests]
        scored = self._score([ctx + cont for ctx, cont in pairs])
        results = []
        for (ctx, cont), s in zip(pairs, scored, strict=True):
            lo = len(ctx) - 1  # row i predicts token i+1
            target = s.target[lo:lo + len(cont)]
            greedy = bool(s.top1 is not None and s.top1[lo:lo + len(cont)].tolist() == cont)
            results.append((float(target.sum()), greedy))
        return results

    def loglikelihood_rolling(self, requests) -> list[float]:
        results = []
        for r in requests:
            ids = self.tokenizer(r.args[0], add_special_tokens=False).input_ids
            total, window = 0.0, self.max_length - 1
            # Disjoint windows, each conditioned on the token before it: every token is scored once.
            for start in range(0, len(ids), window):
                prev = ids[start - 1] if start else self.prefix_token
                chunk = [prev] + ids[start:start + window]
                total += float(self._score([chunk])[0].target.sum())
            results.append(total)
        return results

    def generate_until(self, requests) -> list[str]:
        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(repr(sorted(r.args[1].items(), key=lambda kv: kv[0])), []).append(i)
        for indices in groups.values():
            kwargs = dict(requests[indices[0]].args[1])
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample", False) else 0.0
            params = GenParams(int(kwargs.get("max_gen_toks", self.max_gen_toks)), temperature, until,
                               kwargs.get("seed"))
            gens = self.backend.generate([requests[i].args[0] for i in indices], params)
            for i, g in zip(indices, gens, strict=True):
                text = g.text
                for stop in until:  # backends stop at a stop string; make sure it is cut off
                    text = text.split(stop)[0]
                results[i] = text
        return [r or "" for r in results]

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return getattr(self.tokenizer, "chat_template", None) if chat_template else None

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", "qtoolkit")
