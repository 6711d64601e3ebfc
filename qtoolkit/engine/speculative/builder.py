"""`--speculative VALUE` -> a proposer: validated before anything loads, built at start-up, one-line errors."""

from __future__ import annotations

from transformers import AutoTokenizer

from ...draft.format import load_head
from ...model.llama import LlamaModel
from ...model.loader import load_model
from ...model.sources import resolve_model
from ..model_runner import ModelRunner
from .base import MAX_SPECULATIVE_TOKENS, Proposer, SpeculativeConfigError
from .draft import DraftModelProposer
from .eagle3 import Eagle3Proposer
from .ngram import NgramProposer
from .self_draft import quantize_copy
from .shared_kv import SharedKVDraftProposer, shares_kv_layout

USAGE = "use ngram, draft:PATH, self-int4, self-fp8, self:PATH, eagle3:DIR (a `qtool train-draft` head) or none"


def check_speculative_args(speculative: str | None, num_speculative_tokens: int) -> str | None:
    """Validate the flags before anything loads; returns the normalized proposer spec (None = off)."""
    if speculative is None or speculative.strip().lower() in ("", "none", "off"):
        return None
    spec = speculative.strip()
    kind, _, path = spec.partition(":")
    if not (spec in ("ngram", "self-int4", "self-fp8") or (kind in ("draft", "self", "eagle3") and path)):
        raise SpeculativeConfigError(f"--speculative {speculative!r} is unknown: {USAGE}")
    if isinstance(num_speculative_tokens, bool) or not isinstance(num_speculative_tokens, int) \
            or not 1 <= num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
        raise SpeculativeConfigError(f"--num-speculative-tokens {num_speculative_tokens!r} is out of range: give "
                                     f"an integer from 1 to {MAX_SPECULATIVE_TOKENS}")
    return spec


def _load_draft(path: str, target: LlamaModel, tokenizer, dtype: str) -> LlamaModel:
    try:
        source = resolve_model(path)
        model = load_model(source, dtype)
    except Exception as e:  # any failure to read it is the user's draft, not our bug: name it
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SpeculativeConfigError(f"draft model {path} failed to load ({first}): pass a LLaMA-family HF folder "
                                     "or a qtool quantize checkpoint") from None
    if model.config.vocab_size != target.config.vocab_size:
        raise SpeculativeConfigError(f"draft model {path} has a vocabulary of {model.config.vocab_size} tokens but "
                                     f"the target has {target.config.vocab_size}: the draft must use the target's "
                                     "tokenizer")
    if any(source.path.glob("tokenizer*")):
        draft_vocab = AutoTokenizer.from_pretrained(source.path).get_vocab()
        if draft_vocab != tokenizer.get_vocab():
            raise SpeculativeConfigError(f"draft model {path} uses a different tokenizer than the target: pick a "
                                         "draft from the same model family (same tokenizer)")
    return model


def build_proposer(spec: str, target: LlamaModel, tokenizer, *, num_blocks: int, block_size: int,
                   dtype: str = "auto", target_runner: ModelRunner | None = None) -> Proposer:
    """The proposer for a spec accepted by check_speculative_args. A self-draft (the target quantized, in memory
    or from a checkpoint) reads the target's KV cache through `target_runner`; a `draft:` model keeps a cache
    of its own with as many blocks as the target's; an `eagle3:` head reads the target's hidden states and is
    refused (DraftHeadError, one line) when its hidden size, vocabulary or taps do not fit the target."""
    if spec == "ngram":
        return NgramProposer()
    if spec.startswith("eagle3:"):
        return Eagle3Proposer(load_head(spec.partition(":")[2], target.config, dtype=target.dtype), target, spec)
    if spec in ("self-int4", "self-fp8"):
        draft = quantize_copy(target, spec.removeprefix("self-"))
    else:
        draft = _load_draft(spec.partition(":")[2], target, tokenizer, dtype)
        if spec.startswith("self:") and not shares_kv_layout(draft, target):
            raise SpeculativeConfigError(f"--speculative {spec}: the checkpoint's layers, KV heads or dtype differ "
                                         "from the target's, so it cannot read the target's cache: pass it as "
                                         "draft:PATH")
    if spec.startswith("self") and target_runner is not None:
        return SharedKVDraftProposer(draft, target_runner, name=spec)
    return DraftModelProposer(draft, num_blocks, block_size, name=spec)
