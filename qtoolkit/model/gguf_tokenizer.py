"""The tokenizer a GGUF file describes, built to give llama.cpp's token ids for the same text.

transformers' GGUF reader builds every `llama` (SentencePiece) vocabulary as a Unigram model over the pieces'
scores and adds no `<bos>` whatever `tokenizer.ggml.add_bos_token` says, so a real Gemma 3 file, whose pieces
are SentencePiece-BPE merges, splits words into pieces the model never saw and decodes to garbage. Its `gpt2`
(byte-level BPE) tokenizer uses GPT-2's pre-tokenizer whatever `tokenizer.ggml.pre` names (SmolLM2's `smollm`
splits digits one by one).

This module builds a Hugging Face `tokenizers` model from the file's own fields, mirroring llama.cpp's
`llama_vocab::tokenize` (src/llama-vocab.cpp):
- `llama` (llama.cpp's SPM): spaces escaped to `▁`, a `▁` prefixed to each text fragment when
  `add_space_prefix` (llama.cpp's default for SPM), then llama.cpp's merge loop, which joins the adjacent pair
  whose joined text is a token of highest score: a BPE whose merges are every (left, right) split of every
  token into two tokens, ranked by the joined token's score; characters outside the vocabulary fall back to
  `<0xXX>` byte pieces.
- `gpt2` (llama.cpp's BPE): the file's merges in order, over words cut by the regexes llama.cpp runs for the
  file's `tokenizer.ggml.pre`, through GPT-2's byte-to-unicode map; `ignore_merges` where llama.cpp sets it.
- Control, user-defined and unknown tokens are cut out of the text before the model runs (llama.cpp's
  `tokenizer_st_partition` with parse_special, as its server and CLI tokenize prompts); control and unknown ones
  are special (dropped by `skip_special_tokens`, as llama.cpp's detokenizer drops them).
- `<bos>` / `<eos>` are added as `tokenizer.ggml.add_bos_token` / `add_eos_token` say, with llama.cpp's
  defaults where the file is silent.

Why a `tokenizers` model and not llama.cpp's own tokenizer (llama-cpp-python in vocab-only mode): every room
of qtoolkit (engine, server, evals, quantize, the checkpoints it writes for vLLM) reads a Hugging Face
tokenizer folder, the chat template included, and the main install has no llama-cpp-python; a `tokenizer.json`
saved into the converted folder serves all of them, and the slow tests hold its ids equal to llama.cpp's on
real files. Where the two rules cannot agree (llama.cpp breaks equal-score ties by position, a BPE by rank;
llama.cpp cuts the longest special token first, `tokenizers` the leftmost), real vocabularies give no case
in the tested prompts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from gguf import GGUFReader
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from ..errors import ModelSourceError

# llama.cpp's token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp's pre-tokenizer regexes (llm_tokenizer_bpe), by the `tokenizer.ggml.pre` names that select them
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
           r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
          r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")


@dataclass(frozen=True)
class PreTokenizer:
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a word that is itself a token stays whole (llama.cpp's ignore_merges)
    add_bos: bool = False  # llama.cpp's default when the file does not say


PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": PreTokenizer(_DEFAULT),
    **{n: PreTokenizer((_GPT2,)) for n in ("gpt-2", "phi-2", "mpt", "olmo", "jais")},
    **{n: PreTokenizer((r"\p{N}", _GPT2)) for n in ("smollm", "starcoder", "refact", "codeshell", "command-r",
                                                   "exaone", "minerva-7b")},
    **{n: PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
       for n in ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral")},
    **{n: PreTokenizer((_LLAMA3,)) for n in ("dbrx", "smaug-bpe")},
    **{n: PreTokenizer((_QWEN2,)) for n in ("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2")},
}


@dataclass
class GGUFVocab:
    """A GGUF file's tokenizer.* fields, as llama.cpp reads them."""
    model: str  # tokenizer.ggml.model: `llama` (SPM) or `gpt2` (BPE)
    tokens: list[str] = field(repr=False)
    types: list[int] = field(repr=False)
    scores: list[float] = field(repr=False)
    merges: list[str] = field(repr=False)
    pre: str
    bos: int | None
    eos: int | None
    unk: int | None
    pad: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_template: str | None


def _get(reader: GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_vocab(path: Path, reader: GGUFReader | None = None) -> GGUFVocab:
    """The tokenizer fields of the GGUF at `path`, with llama.cpp's defaults (llama_vocab::impl::load)."""
    reader = reader or GGUFReader(path)
    model = _get(reader, "tokenizer.ggml.model")
    tokens = _get(reader, "tokenizer.ggml.tokens")
    if model not in ("llama", "gpt2") or not tokens:
        raise ModelSourceError(f"cannot load {path}: its tokenizer model {model!r} is not one llama.cpp tokenizes "
                               "as SPM (`llama`) or BPE (`gpt2`): convert the Hugging Face folder instead")
    n = len(tokens)
    pre = _get(reader, "tokenizer.ggml.pre") or "default"
    if model == "gpt2" and pre not in PRE_TOKENIZERS:
        raise ModelSourceError(f"cannot load {path}: its pre-tokenizer {pre!r} is not one qtoolkit reproduces "
                               f"({', '.join(sorted(PRE_TOKENIZERS))}): convert the Hugging Face folder instead")
    types = list(_get(reader, "tokenizer.ggml.token_type") or [NORMAL] * n)
    scores = [float(s) for s in (_get(reader, "tokenizer.ggml.scores") or [0.0] * n)]

    def special(name: str) -> int | None:
        v = _get(reader, f"tokenizer.ggml.{name}_token_id")
        return int(v) if v is not None and 0 <= int(v) < n else None

    spm = model == "llama"
    default_bos = True if spm else PRE_TOKENIZERS[pre].add_bos
    return GGUFVocab(
        model=model, tokens=list(tokens), types=types, scores=scores,
        merges=list(_get(reader, "tokenizer.ggml.merges") or []), pre=pre,
        bos=special("bos"), eos=special("eos"), unk=special("unknown"), pad=special("padding"),
        add_bos=bool(_get(reader, "tokenizer.ggml.add_bos_token", default_bos)),
        add_eos=bool(_get(reader, "tokenizer.ggml.add_eos_token", False)),
        add_space_prefix=bool(_get(reader, "tokenizer.ggml.add_space_prefix", spm)) if spm else False,
        chat_template=_get(reader, "tokenizer.chat_template"))


def spm_merges(vocab: GGUFVocab) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, ranked as llama.cpp's SPM loop picks them: by the joined token's
    score, highest first (ties: the lower id, then the shorter left part)."""
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    ranked = []
    for i, tok in enumerate(vocab.tokens):
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in ids and right in ids:
                ranked.append((-vocab.scores[i], i, cut, left, right))
    ranked.sort(key=lambda r: r[:3])
    return [(left, right) for *_, left, right in ranked]


def _spm(vocab: GGUFVocab) -> Tokenizer:
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    unk = vocab.tokens[vocab.unk] if vocab.unk is not None else None
    tok = Tokenizer(models.BPE(vocab=ids, merges=spm_merges(vocab), unk_token=unk, byte_fallback=True,
                               fuse_unk=False))
    steps = [normalizers.Replace(" ", "\u2581")]
    if vocab.add_space_prefix:  # each fragment between special tokens, as llama.cpp prefixes each
        steps.insert(0, normalizers.Prepend(" "))
    tok.normalizer = normalizers.Sequence(steps)
    dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(dec)
    return tok


def _bpe(vocab: GGUFVocab) -> Tokenizer:
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    merges = [tuple(m.split(" ", 1)) for m in vocab.merges]
    pre = PRE_TOKENIZERS[vocab.pre]
    tok = Tokenizer(models.BPE(vocab=ids, merges=merges, ignore_merges=pre.ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def build_tokenizer(vocab: GGUFVocab) -> PreTrainedTokenizerFast:
    """A Hugging Face fast tokenizer that gives llama.cpp's ids for `vocab` (see the module's docstring)."""
    tok = _spm(vocab) if vocab.model == "llama" else _bpe(vocab)
    # llama.cpp cuts these out of the text first (longest first); control/unknown ones are special
    tok.add_tokens([AddedToken(t, special=ty != USER_DEFINED, normalized=False)
                    for t, ty in zip(vocab.tokens, vocab.types, strict=True) if ty in (CONTROL, USER_DEFINED, UNKNOWN)])
    bos = vocab.bos if vocab.add_bos else None
    eos = vocab.eos if vocab.add_eos else None
    ends = [(vocab.tokens[i], i) for i in dict.fromkeys((bos, eos)) if i is not None]
    head = [vocab.tokens[bos]] if bos is not None else []
    tail = [vocab.tokens[eos]] if eos is not None else []
    tok.post_processor = processors.TemplateProcessing(
        single=head + ["$A"] + tail, pair=head + ["$A"] + tail + head + ["$B:1"] + tail, special_tokens=ends)

    def token(i: int | None) -> str | None:
        return None if i is None else vocab.tokens[i]

    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=token(vocab.bos), eos_token=token(vocab.eos), unk_token=token(vocab.unk),
        pad_token=token(vocab.pad), chat_template=vocab.chat_template, clean_up_tokenization_spaces=False)


def gguf_tokenizer(path: Path, reader: GGUFReader | None = None) -> PreTrainedTokenizerFast:
    return build_tokenizer(read_vocab(path, reader))
