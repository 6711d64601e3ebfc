"""The one summarization prompt: every use of an ACLSum abstract (the eval, lm-eval's task, GPTQ calibration, the
bench's summarization traffic) asks the same question, so what is calibrated, measured and served is one thing.

No heavy imports: the load generator (qtoolkit/bench/workloads.py) builds its prompts from here.
"""

from __future__ import annotations

QUESTIONS = {
    "challenge": "What problem or challenge does the paper address?",
    "approach": "What approach or method does the paper propose?",
    "outcome": "What is the main outcome or result of the paper?",
}


def user_message(abstract: str, aspect: str) -> str:
    return (f"Read this abstract of a research paper.\n\n{abstract}\n\n{QUESTIONS[aspect]} "
            "Answer in one sentence.")
