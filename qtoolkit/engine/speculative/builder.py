"""A parsed `--speculative` value (SpeculativeSpec) -> a proposer: the flags checked before anything loads, the proposer built at start-up, one-line errors."""

from __future__ import annotations

from transformers import AutoTokenizer

from ...draft.format import load_head
from ...model.llama import LlamaModel
from ...model.loader import load_model
from ...model.sources import resolve_model
from ..model_runner import ModelRunner
from ..speculative_spec import SpeculativeConfigError, SpeculativeSpec
from .base import MAX_SPECULATIVE_TOKENS, Proposer
from .draft import DraftModelProposer
from .eagle3 import Eagle3Proposer
from .layer_skip import LayerSkipProposer, auto_depths
from .ngram import NgramProposer
from .self_draft import quantize_copy
from .shared_kv import SharedKVDraftProposer, shares_kv_layout


def check_speculative_args(speculative: str | SpeculativeSpec | None,
                           num_speculative_tokens: int) -> SpeculativeSpec | None:
    """Validate the flags before anything loads; returns the parsed proposer (None = off)."""
    spec = speculative if isinstance(speculative, SpeculativeSpec) else SpeculativeSpec.parse(speculative)
    if spec is None:
        return None
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


def build_proposer(spec: SpeculativeSpec, target: LlamaModel, tokenizer, *, num_blocks: int, block_size: int,
                   dtype: str = "auto", target_runner: ModelRunner | None = None) -> Proposer:
    """The proposer for a parsed spec. A self-draft (the target quantized, in memory or from a checkpoint) reads
    the target's KV cache through `target_runner`; a `draft:` model keeps a cache of its own with as many blocks
    as the target's; an `eagle3:` head reads the target's hidden states and is refused (DraftHeadError, one line)
    when its hidden size, vocabulary or taps do not fit the target."""
    name = str(spec)
    if spec.kind == "ngram":
        return NgramProposer()
    if spec.kind == "eagle3":
        return Eagle3Proposer(load_head(str(spec.path), target.config, dtype=target.dtype), target, name)
    if spec.kind == "self-skip":
        if target_runner is None:
            raise SpeculativeConfigError(f"--speculative {name} reads the target's KV cache: it needs the engine's "
                                         "model runner")
        depths = [spec.skip_layers] if spec.skip_layers is not None else auto_depths(target.config.num_layers)
        return LayerSkipProposer(target, target_runner, name, depths)
    if (fmt := spec.self_draft_format) is not None:
        draft = quantize_copy(target, fmt)
    else:
        draft = _load_draft(str(spec.path), target, tokenizer, dtype)
        if spec.kind == "self" and not shares_kv_layout(draft, target):
            raise SpeculativeConfigError(f"--speculative {name}: the checkpoint's layers, KV heads or dtype differ "
                                         "from the target's, so it cannot read the target's cache: pass it as "
                                         "draft:PATH")
    if spec.shares_target_kv and target_runner is not None:
        return SharedKVDraftProposer(draft, target_runner, name=name)
    return DraftModelProposer(draft, num_blocks, block_size, name=name)
