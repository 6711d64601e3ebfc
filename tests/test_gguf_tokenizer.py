"""qtoolkit/model/gguf_tokenizer.py: a GGUF's tokenizer built to give llama.cpp's ids. The rules on hand-made
vocabularies (SPM merges by score, byte fallback, add_bos/add_eos, special and user-defined tokens), then the
project's tiny files (an SPM and a BPE vocabulary) against llama.cpp's own tokenizer where llama-cpp-python is
installed. Real files: tests/test_gguf_real.py (slow)."""

from __future__ import annotations

import pytest
from gguf_files import FAMILIES, build_model, write_gguf

from qtoolkit.errors import ModelSourceError
from qtoolkit.model.gguf_tokenizer import (
    BYTE,
    CONTROL,
    NORMAL,
    UNKNOWN,
    USER_DEFINED,
    GGUFVocab,
    build_tokenizer,
    read_vocab,
)
from qtoolkit.peers.gguf_parity import TOKEN_PROMPTS

SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]


def spm(pieces: dict[str, float], *, add_bos=True, add_eos=False, prefix=False, user=()) -> GGUFVocab:
    tokens = SPECIAL + BYTES + list(user) + list(pieces)
    types = [CONTROL, CONTROL, CONTROL, UNKNOWN] + [BYTE] * 256 + [USER_DEFINED] * len(user) + [NORMAL] * len(pieces)
    scores = [-1000.0] * 4 + [0.0] * 256 + [-1000.0] * len(user) + list(pieces.values())
    return GGUFVocab(model="llama", tokens=tokens, types=types, scores=scores, merges=[], pre="default", bos=2,
                     eos=1, unk=3, pad=0, add_bos=add_bos, add_eos=add_eos, add_space_prefix=prefix,
                     chat_template=None)


def pieces(tok, ids: list[int]) -> list[str]:
    return tok.convert_ids_to_tokens(ids)


def test_spm_joins_the_pair_whose_token_scores_highest():
    """llama.cpp's SPM loop: the adjacent pair whose joined text is the best-scored token first."""
    base = {"a": -10.0, "b": -11.0, "c": -12.0, "\u2581": -13.0}
    bc_first = build_tokenizer(spm({**base, "ab": -2.0, "bc": -1.0}, add_bos=False))
    assert pieces(bc_first, bc_first("abc").input_ids) == ["a", "bc"]
    ab_first = build_tokenizer(spm({**base, "ab": -1.0, "bc": -2.0}, add_bos=False))
    assert pieces(ab_first, ab_first("abc").input_ids) == ["ab", "c"]
    chained = build_tokenizer(spm({**base, "ab": -1.0, "bc": -2.0, "abc": -5.0}, add_bos=False))
    assert pieces(chained, chained("abc").input_ids) == ["abc"]


def test_bos_eos_bytes_and_special_tokens_as_the_file_says():
    vocab = {"a": -1.0, "b": -2.0, "\u2581": -3.0, "\u2581a": -0.5}
    tok = build_tokenizer(spm(vocab, add_bos=True, add_eos=True, user=["  "]))
    ids = tok("a é<eos>b  a").input_ids
    assert pieces(tok, ids) == ["<bos>", "a", "\u2581", "<0xC3>", "<0xA9>", "<eos>", "b", "  ", "a", "<eos>"]
    assert tok.decode(ids, skip_special_tokens=True) == "a éb  a"
    plain = build_tokenizer(spm(vocab, add_bos=False))
    assert pieces(plain, plain("a").input_ids) == ["a"]
    prefixed = build_tokenizer(spm(vocab, add_bos=False, prefix=True))  # llama.cpp's add_space_prefix
    assert pieces(prefixed, prefixed("a<eos>a").input_ids) == ["\u2581a", "<eos>", "\u2581a"]


def test_an_unknown_pre_tokenizer_is_refused_in_one_line(tmp_path, tokenizer_dir):
    import gguf

    model, _ = build_model("llama3", tokenizer_dir, **FAMILIES["llama3"])
    path = write_gguf(model, tmp_path / "f.gguf")
    fields = {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items() if k.startswith("tokenizer.")}
    assert fields["tokenizer.ggml.pre"] in ("smollm",)  # the default model's, copied by the writer
    w = gguf.GGUFWriter(str(tmp_path / "odd.gguf"), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("no-such-pre")
    w.add_token_list(["a", "b"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with pytest.raises(ModelSourceError, match="no-such-pre") as err:
        read_vocab(tmp_path / "odd.gguf")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("family", ["gemma3_text", "llama3"])  # `llama` SPM with scores, `gpt2` BPE (`smollm`)
def test_tiny_files_tokenize_as_llama_cpp(family, tmp_path, tokenizer_dir):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (the `llamacpp` extra) is the reference")
    model, _ = build_model(family, tokenizer_dir, **FAMILIES[family])
    path = write_gguf(model, tmp_path / f"{family}.gguf")
    tok = build_tokenizer(read_vocab(path))
    ref = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    for text in TOKEN_PROMPTS:
        assert tok(text).input_ids == ref.tokenize(text.encode(), add_bos=True, special=True), text
