"""One EngineConfig: validated once, built from the CLI, carried whole to a `qtool serve` subprocess."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from qtoolkit.cli import main
from qtoolkit.engine.config import EngineConfig, add_engine_args
from qtoolkit.engine.params import EngineInputError
from qtoolkit.engine.speculative import SpeculativeConfigError
from qtoolkit.engine.speculative.policy import DEFAULT_MAX_VERIFY_TOKENS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p


def test_the_cli_builds_the_config_and_a_subprocess_reads_back_the_same():
    config = EngineConfig(kv_cache_memory="16MiB", block_size=8, max_num_seqs=3, batching="static",
                          enable_prefix_caching=False, max_model_len=256, speculative="ngram",
                          num_speculative_tokens=2, max_verify_tokens=5)
    assert EngineConfig.from_args(_parser().parse_args(config.to_cli_args())) == config
    assert EngineConfig.from_args(_parser().parse_args([])) == EngineConfig()
    # every field is a flag: a new engine option needs no other signature
    flags = {a.dest for a in _parser()._actions}
    assert {f.name for f in dataclasses.fields(EngineConfig)} <= flags
    assert EngineConfig().max_verify_tokens == DEFAULT_MAX_VERIFY_TOKENS


def test_speculative_is_normalized_and_none_means_off():
    assert EngineConfig(speculative=" ngram ").speculative == "ngram"
    assert EngineConfig(speculative="none").speculative is None


@pytest.mark.parametrize(("options", "error", "words"), [
    ({"batching": "dynamic"}, EngineInputError, "batching 'dynamic' is unknown"),
    ({"block_size": 0}, EngineInputError, "must be positive"),
    ({"max_num_seqs": -1}, EngineInputError, "must be positive"),
    ({"kv_cache_memory": "lots"}, EngineInputError, "cannot read memory size"),
    ({"max_model_len": 0}, EngineInputError, "max_model_len"),
    ({"speculative": "magic"}, SpeculativeConfigError, "is unknown"),
    ({"speculative": "ngram", "num_speculative_tokens": 0}, SpeculativeConfigError, "out of range"),
    ({"max_verify_tokens": 0}, SpeculativeConfigError, "max_verify_tokens must be positive"),
])
def test_bad_options_fail_with_one_line(options, error, words):
    with pytest.raises(error) as e:
        EngineConfig(**options)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_bad_engine_flag_is_one_cli_error_before_anything_loads(capsys):
    assert main(["generate", "--prompt", "hi", "--kv-cache-memory", "lots"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot read memory size" in err
