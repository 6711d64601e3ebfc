"""The `summarization` task: ACLSum abstract -> one-sentence aspect summary, through the chat template.

Per (document, aspect): ROUGE-1/2/L F1 of each model's greedy summary against the reference (rouge-score,
stemmed), and the mean NLL of the reference summary as the assistant's answer. The token-level KLD
statistics run over the summarization text (the user turn with the abstract, plus the reference answer),
leaving out the chat template's fixed system preamble, which is identical for every item.
"""

from __future__ import annotations

from typing import Any

from rouge_score import rouge_scorer

from .backends.base import Backend, GenParams
from .data import ASPECTS, aclsum_items
from .prompts import user_message
from .stats.paired import NOMINAL, Level, paired_delta, token_stats
from .task import paired_scores, scored_records, side_scores

ROUGE = ("rouge1", "rouge2", "rougeL")


def chat_prompt(tokenizer, abstract: str, aspect: str) -> tuple[str, int]:
    """The chat prompt text and the character offset where the item-specific content starts."""
    message = user_message(abstract, aspect)
    text = tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                         add_generation_prompt=True)
    return text, text.index(message)


class SummarizationTask:
    name = "summarization"
    default_limit = 24
    batch_size = 8

    def __init__(self, max_tokens: int = 96, seed: int = 0, split: str = "test", **_: Any):
        self.max_tokens, self.seed, self.split = max_tokens, seed, split
        self.scorer = rouge_scorer.RougeScorer(list(ROUGE), use_stemmer=True)

    def settings(self) -> dict[str, Any]:
        return {"max_tokens": self.max_tokens, "seed": self.seed, "split": self.split, "rouge": list(ROUGE)}

    def items(self, limit: int) -> list[dict[str, Any]]:
        out = []
        for doc in aclsum_items(self.split):
            for aspect in ASPECTS:
                out.append({"id": f"{doc['id']}/{aspect}", "abstract": doc["abstract"], "aspect": aspect,
                            "reference": doc["summaries"][aspect]})
                if len(out) == limit:
                    return out
        return out

    def rouge(self, reference: str, prediction: str) -> dict[str, float]:
        scores = self.scorer.score(reference, prediction)
        return {k: scores[k].fmeasure for k in ROUGE}

    def run_batch(self, items: list[dict[str, Any]], candidate: Backend, baseline: Backend) -> list[dict]:
        tok = candidate.tokenizer
        prompts = [chat_prompt(tok, it["abstract"], it["aspect"]) for it in items]
        params = GenParams(self.max_tokens, 0.0, [], self.seed)
        sequences, content_starts, answer_starts = [], [], []
        for (text, offset), it in zip(prompts, items, strict=True):
            head = tok(text[:offset], add_special_tokens=False).input_ids
            body = tok(text[offset:], add_special_tokens=False).input_ids
            answer = tok(it["reference"] + (tok.eos_token or ""), add_special_tokens=False).input_ids
            sequences.append(head + body + answer)
            content_starts.append(len(head))
            answer_starts.append(len(head) + len(body))
        # each side's generation and scores before the other's: one model loaded at a time (task.side_scores)
        gens = {"candidate": candidate.generate([p for p, _ in prompts], params)}
        sc = side_scores(candidate, sequences)
        gens["baseline"] = baseline.generate([p for p, _ in prompts], params)
        texts = paired_scores(sc, sc if isinstance(sc, str) else side_scores(baseline, sequences), content_starts)
        records = []
        for i, it in enumerate(items):
            t, scored = texts[i], "unsupported" not in texts[i]
            ans = slice(answer_starts[i] - content_starts[i], None)  # record index j predicts token start+j
            n = len(sequences[i]) - answer_starts[i]
            rec: dict[str, Any] = {"id": it["id"], "aspect": it["aspect"], "reference_tokens": n,
                                   "nll_reference_candidate": sum(t["nll_candidate"][ans]) / n if scored else None,
                                   "nll_reference_baseline": sum(t["nll_baseline"][ans]) / n if scored else None,
                                   "token_record": t}
            for side, g in gens.items():
                summary = g[i].text.strip()
                rec[side] = {"summary": summary, "finish_reason": g[i].finish_reason,
                             **self.rouge(it["reference"], summary)}
            records.append(rec)
        return records

    def summarize(self, records: list[dict[str, Any]], *, seed: int, level: Level = NOMINAL) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for i, k in enumerate(ROUGE):
            out[k] = paired_delta([r["candidate"][k] for r in records], [r["baseline"][k] for r in records],
                                  seed=seed + i, level=level)
        token_records, unsupported = scored_records(records)
        scored = [r for r in records if r["nll_reference_candidate"] is not None]
        out["nll_reference"] = paired_delta(
            [r["nll_reference_candidate"] for r in scored], [r["nll_reference_baseline"] for r in scored],
            [r["reference_tokens"] for r in scored], seed=seed + 10, level=level)
        out["text_stats"] = token_stats(token_records, seed=seed + 20, level=level)
        out["not_computed"] = [f"nll_reference, text_stats: {why}" for why in unsupported]
        return out
