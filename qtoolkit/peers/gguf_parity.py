"""qtool against llama.cpp on the same GGUF file: token ids, greedy text and next-token distributions.

llama.cpp runs the file as it is (its own kernels on the quantized blocks) through the `llama-cpp-python` peer;
qtool runs what `qtool generate --model FILE` runs (the file dequantized to fp32 by the resolver). The mean
KL divergence is llama-perplexity's `--kl-divergence` figure with llama.cpp as the base: the mean over scored
tokens of sum_v p_llama.cpp(v) (log p_llama.cpp(v) - log p_qtool(v)); the reverse direction is reported too.

    python -m qtoolkit.peers.gguf_parity FILE.gguf --out parity.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..engine import Engine
from ..engine.params import SamplingParams
from ..evals.data import aclsum_items, humaneval_problems
from ..io import write_json

# token-id prompts: code, prose, unicode, whitespace runs, special-token text
TOKEN_PROMPTS = (
    "The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,",
    "  two leading spaces", "trailing spaces   ", "tabs\tand\t\tmore\t", "a\n\n\nb\n", "x" * 50,
    "    " * 10 + "deep", "Unicode: naïve café, Straße, 日本語のテキスト, emoji 😀🚀, Ελληνικά, русский",
    "price $1,234.56 vs 7890123 and 3.14159", "<start_of_turn>user\nhi<end_of_turn>\n<im_start>",
    "html <b>bold</b> <table><tr><td>1</td></tr>", "import numpy as np\nx = np.arange(10)\nprint(x[::2])",
    "I'm sure they'll say we've done it, don't you?", "   ", "\n", "a  b   c    d",
    "\t\tindented\n\t\t\tmore", "CamelCaseIdentifierWithNumbers123", "zero\u200bwidth and \u00a0nbsp",
    "🙂🙂🙂", "class Stack:\n    def __init__(self):\n        self.items = []\n", "Ünïcödé ÀÉÎÕÜ ĳ ﬁ ½ ²",
)
# greedy-text prompts: prose
PROSE_PROMPTS = (
    "The capital of France is", "Once upon a time, in a small village,", "The most important thing about science is",
    "Yesterday I went to the market and", "Water boils at a temperature of",
)
GREEDY_TOKENS = 8


@dataclass
class TokenCase:
    text: str
    llama_cpp: list[int]
    qtool: list[int]

    @property
    def equal(self) -> bool:
        return self.llama_cpp == self.qtool


@dataclass
class GreedyCase:
    prompt: str
    llama_cpp: list[int]
    qtool: list[int]
    # where they part: llama.cpp's logit of its own token minus that of qtool's, from llama.cpp's batched
    # evaluation of the prompt and the common prefix (negative: batched llama.cpp picks qtool's token)
    llama_cpp_gap: float | None = None

    @property
    def equal(self) -> bool:
        return self.llama_cpp == self.qtool


@dataclass
class ParityReport:
    file: str
    sha256: str
    token_cases: list[TokenCase] = field(repr=False)
    greedy_cases: list[GreedyCase] = field(repr=False)
    kld_text: str = ""
    kld_tokens: int = 0
    mean_kld: float = float("nan")  # KL(llama.cpp || qtool), llama-perplexity's direction
    mean_kld_reverse: float = float("nan")  # KL(qtool || llama.cpp)
    max_kld: float = float("nan")
    same_top: float = float("nan")  # share of positions where both pick the same next token

    def to_json(self) -> dict:
        out = asdict(self)
        out["token_ids_equal"] = sum(c.equal for c in self.token_cases)
        out["greedy_equal"] = sum(c.equal for c in self.greedy_cases)
        return out


def kld_text() -> str:
    """Real text shipped by packages: the first HumanEval problem with its solution, then ACLSum test abstracts."""
    p = humaneval_problems()[0]
    parts = [p["prompt"] + p["canonical_solution"]] + [d["abstract"] for d in aclsum_items("test")[:6]]
    return "\n\n".join(parts)


def _llama(path: Path, **kw):
    import llama_cpp  # optional peer: only this check needs llama.cpp

    return llama_cpp.Llama(str(path), verbose=False, n_threads=max(1, min(2, os.cpu_count() or 1)), seed=0, **kw)


def kl_divergence(base_logits: torch.Tensor, new_logits: torch.Tensor, rows: int = 64) -> torch.Tensor:
    """Per row sum_v p_base(v) (log p_base(v) - log p_new(v)), in nats; `rows` at a time in float64 (a 262k
    vocabulary makes a few hundred rows gigabytes)."""
    out = []
    for i in range(0, base_logits.shape[0], rows):
        lb = base_logits[i:i + rows].double().log_softmax(-1)
        ln = new_logits[i:i + rows].double().log_softmax(-1)
        out.append((lb.exp() * (lb - ln)).sum(-1))
    return torch.cat(out)


def run(path: Path, max_kld_tokens: int = 320) -> ParityReport:
    engine = Engine(str(path), kv_cache_memory="64MiB")
    tok = engine.tokenizer
    vocab = _llama(path, vocab_only=True)
    token_cases = [TokenCase(t, vocab.tokenize(t.encode(), add_bos=True, special=True), tok(t).input_ids)
                   for t in TOKEN_PROMPTS]
    del vocab
    ids = tok(kld_text()).input_ids[:max_kld_tokens]
    llm = _llama(path, logits_all=True, n_ctx=max(512, len(ids) + 2 * GREEDY_TOKENS + 16), n_batch=512)
    greedy = []
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0)
    for prompt in PROSE_PROMPTS:
        prompt_ids = tok(prompt).input_ids
        llm.reset()
        # llm.generate never ends by itself: take GREEDY_TOKENS of its stream
        want = list(itertools.islice(llm.generate(prompt_ids, temp=0.0, top_k=1, reset=True), GREEDY_TOKENS))
        got = engine.generate([prompt_ids], params)[0].token_ids
        case = GreedyCase(prompt, [int(t) for t in want], [int(t) for t in got])
        if not case.equal and len(got) == len(want):
            j = next(i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b)
            llm.reset()
            llm.eval(prompt_ids + case.llama_cpp[:j])
            row = np.asarray(llm.scores[len(prompt_ids) + j - 1])
            case.llama_cpp_gap = float(row[want[j]] - row[got[j]])
        greedy.append(case)
    llm.reset()
    llm.eval(ids)
    ref = torch.from_numpy(np.asarray(llm.scores[:len(ids)], dtype=np.float32))
    ours = engine.score([ids])[0].float()
    kld = kl_divergence(ref, ours)
    rev = kl_divergence(ours, ref)
    same = (ref.argmax(-1) == ours.argmax(-1)).double().mean()
    return ParityReport(str(path), engine.source.sha256, token_cases, greedy,
                        kld_text=kld_text()[:120] + "...", kld_tokens=len(ids), mean_kld=float(kld.mean()),
                        mean_kld_reverse=float(rev.mean()), max_kld=float(kld.max()), same_top=float(same))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qtoolkit.peers.gguf_parity", description=__doc__.split("\n")[0])
    p.add_argument("gguf", type=Path)
    p.add_argument("--out", type=Path, help="write the report as JSON here")
    p.add_argument("--tokens", type=int, default=320, help="tokens of real text scored for the KL divergence")
    args = p.parse_args(argv)
    report = run(args.gguf, args.tokens)
    data = report.to_json()
    if args.out:
        write_json(args.out, data)
    print(json.dumps({k: v for k, v in data.items() if k not in ("token_cases", "greedy_cases")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
