"""A GGUF source that decodes to garbage is refused before it is quantized or signed off.

The source's own perplexity is measured on a short packaged text (HumanEval's first problem with its solution,
then the first ACLSum test abstract: English prose and Python) and stated; it is refused when it needs more
than MAX_BITS_PER_BYTE bits a byte of that text. The bound is per byte, not per token, because a wrong
tokenizer hides behind small pieces: the real Gemma 3 270M Q4_K_M file read with transformers' GGUF tokenizer
(no `<bos>`, words cut into pieces the model never saw; it decodes to `1 1 1 1`) scores a per-token
perplexity of 111, far below any vocabulary-relative bound (262,144 tokens), yet needs 3.23 bits a byte where
the same file tokenized as llama.cpp does needs 0.77 and SmolLM2-135M 0.82
(measurements/2026-12-04/issue45/source-perplexity.json). 2 bits a byte is 2.4x the smallest real model at hand
and below what order-0 statistics of the text itself need (4.5): a model past it does not predict its language.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from qtoolkit.evals.data import aclsum_items, humaneval_problems
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..errors import ModelSourceError
from ..model.sources import ModelSource, cache_dir
from ..progress import status

MAX_BITS_PER_BYTE = 2.0
TOKENS = 256
VERSION = 1  # of the text and the measure: cached figures of another version are measured again


@dataclass(frozen=True)
class SourcePerplexity:
    tokens: int  # scored tokens (the first one is context only)
    bytes: int  # of text those tokens cover
    perplexity: float  # per token
    bits_per_byte: float

    @property
    def plausible(self) -> bool:
        return self.bits_per_byte <= MAX_BITS_PER_BYTE

    def describe(self) -> str:
        return (f"perplexity {self.perplexity:.1f} a token, {self.bits_per_byte:.2f} bits a byte on {self.tokens} "
                f"tokens of packaged text (HumanEval, ACLSum)")


def sample_text() -> str:
    p = humaneval_problems()[0]
    return p["prompt"] + p["canonical_solution"] + "\n\n" + aclsum_items("test")[0]["abstract"]


@torch.inference_mode()
def measure(folder: Path) -> SourcePerplexity:
    """Teacher-forced NLL of the model in `folder` (fp32, as the converted GGUF holds it) on sample_text()."""
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, use_safetensors=True).eval()
    ids = tok(sample_text()).input_ids[:TOKENS]
    logprobs = model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    nll = -float(logprobs.gather(1, torch.tensor(ids[1:])[:, None]).sum())
    covered = len(tok.decode(ids[1:], skip_special_tokens=True).encode())
    n = len(ids) - 1
    return SourcePerplexity(n, covered, math.exp(nll / n), nll / math.log(2) / max(covered, 1))


def _cached(src: ModelSource) -> SourcePerplexity:
    """measure(src.path), memoised by the source's hash (a sign-off of a GGUF measures it once)."""
    path = cache_dir() / "source-perplexity.json"
    key = f"{src.sha256}:{VERSION}"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return SourcePerplexity(**known[key])
    result = measure(src.path)
    known[key] = asdict(result)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(known))
    os.replace(tmp, path)
    return result


def check_source(src: ModelSource) -> SourcePerplexity | None:
    """State a GGUF source's own perplexity and refuse it (ModelSourceError) past MAX_BITS_PER_BYTE; None for
    other sources (a Hugging Face folder is read as its authors wrote it)."""
    if src.kind not in ("gguf", "default"):
        return None
    result = _cached(src)
    status(f"{src.name if src.kind == 'default' else src.spec}: {result.describe()}")
    if not result.plausible:
        raise ModelSourceError(
            f"{src.spec} does not predict text as a language model: {result.describe()}, beyond the plausible "
            f"{MAX_BITS_PER_BYTE:.0f} bits a byte; check it with llama.cpp (llama-perplexity) or convert the "
            "Hugging Face folder instead")
    return result
