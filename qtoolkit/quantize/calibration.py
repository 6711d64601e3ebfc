"""Calibration text for GPTQ, from data installed with the packages (never a hub).

Code: HumanEval problems from index CODE_HOLDOUT_START on, prompt + canonical solution (the eval task reads the
first items, so a small `--limit` eval never sees calibration items). Summarization: ACLSum *train* split
(evaluation uses `test`), an abstract -> aspect summary exchange in the model's chat template.
"""

from __future__ import annotations

import random
from typing import Any

from datasets import Dataset
from qtoolkit.evals.data import ASPECTS, aclsum_items, humaneval_problems
from qtoolkit.evals.prompts import user_message

CODE_HOLDOUT_START = 100


def _code_texts() -> list[str]:
    return [p["prompt"] + p["canonical_solution"] for p in humaneval_problems()[CODE_HOLDOUT_START:]]


def _summarization_texts(tokenizer: Any) -> list[str]:
    texts = []
    for i, doc in enumerate(aclsum_items("train")):
        aspect = ASPECTS[i % len(ASPECTS)]
        messages = [
            {"role": "user", "content": user_message(doc["abstract"], aspect)},
            {"role": "assistant", "content": doc["summaries"][aspect]},
        ]
        if getattr(tokenizer, "chat_template", None):
            texts.append(tokenizer.apply_chat_template(messages, tokenize=False))
        else:
            texts.append(f"{messages[0]['content']}\n{messages[1]['content']}")
    return texts


def calibration_texts(dataset: str, num_samples: int, tokenizer: Any, seed: int = 0) -> list[str]:
    """`num_samples` texts: `code`, `summarization` or `mixed` (half each), shuffled with `seed`."""
    rng = random.Random(seed)
    pools = {"code": _code_texts, "summarization": lambda: _summarization_texts(tokenizer)}
    names = ["code", "summarization"] if dataset == "mixed" else [dataset]
    out: list[str] = []
    for i, name in enumerate(names):
        want = num_samples // len(names) + (1 if i < num_samples % len(names) else 0)
        pool = pools[name]()
        rng.shuffle(pool)
        # Cycle when asked for more samples than the pool holds (HumanEval's hold-out has 64 items).
        out.extend(pool[j % len(pool)] for j in range(want))
    rng.shuffle(out)
    return out


def calibration_dataset(texts: list[str], tokenizer: Any, max_seq_length: int):
    """Tokenized `datasets.Dataset` (input_ids, attention_mask) as llm-compressor's oneshot expects."""
    enc = tokenizer(texts, truncation=True, max_length=max_seq_length, add_special_tokens=False)
    return Dataset.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
