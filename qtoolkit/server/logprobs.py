"""`echo` and `logprobs` for /v1/completions, in OpenAI's legacy completions shape (as vLLM gives them).

The figures come from one teacher-forced pass (Engine.score) over prompt + completion once the generation ends,
so each is the model's own next-token log-probability (before temperature, top-k and top-p), the number
`qtool eval` scores in-process. This is what lets a sign-off through an endpoint measure NLL. The prompt's first
token has no prediction: null, as in OpenAI's API. The pass runs on its own worker thread and holds the engine's
lock like a step does, so it queues between steps and never runs beside one; it decodes with its own
tokenizer copy, since a tokenizer is not shared between threads.
"""

from __future__ import annotations

from typing import Any

from ..engine.engine import EngineCapacityError
from .protocol import APIError


def token_texts(tokenizer: Any, ids: list[int]) -> list[str]:
    return [tokenizer.decode([t]) for t in ids]


def logprobs_blocks(engine: Any, tok: Any, prompts: list[list[int]], outputs: list[list[int]], k: int,
                    echo: bool) -> list[dict[str, Any]]:
    """`choices[i].logprobs` of every choice, scored in one Engine.score call (it packs them into steps)."""
    try:
        scored = engine.score([p + o for p, o in zip(prompts, outputs, strict=True)], top_k=k)
    except EngineCapacityError as e:
        raise APIError(503, f"no KV room to compute logprobs now ({e}): retry later", kind="server_error",
                       code="overloaded", headers={"Retry-After": "1"}) from None
    return [_block(tok, p + o, len(p), s, echo) for p, o, s in zip(prompts, outputs, scored, strict=True)]


def _block(tok: Any, ids: list[int], num_prompt: int, scored: Any, echo: bool) -> dict[str, Any]:
    """Tokens, token_logprobs, top_logprobs and text_offset of the returned text."""
    first = 0 if echo else num_prompt
    shown = token_texts(tok, ids[first:])
    offsets, at = [], 0
    for text in shown:
        offsets.append(at)
        at += len(text)
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    for pos, text in zip(range(first, len(ids)), shown, strict=True):
        if pos == 0:
            token_lps.append(None)
            tops.append(None)
            continue
        row = pos - 1  # row i predicts token i + 1
        lp = float(scored.target[row])
        alternatives = zip(token_texts(tok, scored.top_ids[row].tolist()), scored.top_values[row].tolist(),
                           strict=True)
        top = {}
        for alt, value in alternatives:
            top.setdefault(alt, float(value))  # two ids may decode alike: the first (the likelier) is kept
        top.setdefault(text, lp)  # the chosen token is always listed, as vLLM does
        token_lps.append(lp)
        tops.append(top)
    return {"tokens": shown, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}
