"""The draft head's data is offline and never the eval items: stdlib files split by path, ACLSum's test split
refused, and a corpus holding a HumanEval prompt or an ACLSum test abstract refused."""

from __future__ import annotations

import pytest
from qtoolkit.evals.data import aclsum_items, humaneval_problems
from transformers import AutoTokenizer

from qtoolkit.draft.data import (
    CODE,
    Sample,
    check_clean,
    eval_texts,
    function_stubs,
    stdlib_files,
    summary_prompts,
)
from qtoolkit.draft.vocab import choose_size, coverage_table, token_counts, top_tokens
from qtoolkit.errors import DataError


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def test_stdlib_split_is_disjoint_and_held_out_is_about_a_tenth():
    train, held = set(stdlib_files("train")), set(stdlib_files("heldout"))
    assert train and held and not train & held
    assert 0.05 < len(held) / (len(train) + len(held)) < 0.15
    assert not any("test" in p.parts for p in train | held)


def test_function_stubs_end_at_the_docstring():
    stubs = function_stubs(stdlib_files("heldout"), 5)
    assert len(stubs) == 5
    for s in stubs:
        assert s.startswith(("def ", "async def ")) and s.rstrip()[-1] in "\"'"


def test_aclsum_test_split_is_refused_and_eval_items_in_a_corpus_are_caught(tok):
    with pytest.raises(DataError):
        summary_prompts("test", tok)
    clean = [Sample(CODE, "x", tok("def f(x):\n    return x\n").input_ids)]
    check_clean(clean, tok)
    for poisoned_text in (humaneval_problems()[7]["prompt"], "Intro. " + aclsum_items("test")[3]["abstract"]):
        poisoned = clean + [Sample(CODE, "y", tok(poisoned_text).input_ids)]
        with pytest.raises(DataError, match="eval item"):
            check_clean(poisoned, tok)
    assert len(eval_texts()) == len(humaneval_problems()) + len(aclsum_items("test"))


def test_vocabulary_is_the_most_frequent_tokens_and_coverage_grows():
    samples = [Sample(CODE, "a", [5] * 10 + [7] * 5 + [9], 0)]
    counts = token_counts(samples, 20)
    assert top_tokens(counts, 2).tolist() == [5, 7]
    held = {CODE: [Sample(CODE, "h", [1, 5, 5, 7, 9, 3], prompt_len=1)]}
    rows = coverage_table(counts, held, hidden=8, body_params=100, sizes=(1, 2, 3), target_params=10_000)
    assert [r.coverage[CODE] for r in rows] == pytest.approx([0.4, 0.6, 0.8, 1.0])
    assert rows[0].lm_head_params == 8
    assert choose_size(rows) == 20  # cheap LM head: full coverage pays
    pricey = coverage_table(counts, held, hidden=8, body_params=100, sizes=(1, 2, 3), target_params=300)
    assert choose_size(pricey) < 20  # an LM head near the target's size: fewer tokens pay
    assert [r.modeled_speedup for r in rows] == sorted(r.modeled_speedup for r in rows)
