"""`qtool bench serve --rounds N`: every spec / plain and continuous / static ratio with a 95% interval over
rounds of fresh requests, in the JSON and the printout; a bad --rounds is one line and exit 2."""

from __future__ import annotations

import json

import pytest

from qtoolkit.bench.serve import _ratio_pairs
from qtoolkit.bench.systems import System, serve_systems
from qtoolkit.cli import main
from qtoolkit.signoff.plot import plot_file


def test_systems_are_values_whose_labels_are_the_json_keys():
    systems = serve_systems(["static", "continuous"], ["ngram"])
    assert [s.label for s in systems] == ["static", "static+ngram", "continuous", "continuous+ngram"]
    assert systems[3].plain == System("continuous")
    assert [p.key for p in _ratio_pairs(systems)] == ["continuous_over_static", "static+ngram_over_static",
                                                       "continuous+ngram_over_continuous"]
    assert System("continuous", "ngram", quant="candidate").label == "candidate_continuous_spec"


@pytest.mark.parametrize("bad", ["0", "-1", "two"])
def test_bad_rounds_is_one_line_and_exit_2(bad, tmp_path, capsys):
    rc = main(["bench", "serve", "--rounds", bad, "--output", str(tmp_path / "b.json")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "--rounds" in err, err
    assert not (tmp_path / "b.json").exists()


def test_rounds_give_each_ratio_an_interval(tiny_model_dir, tmp_path, capsys):
    """Two servers (plain and ngram), one tier, two rounds: the JSON fields and the printout."""
    out = tmp_path / "bench.json"
    rc = main(["bench", "serve", "--model", str(tiny_model_dir), "--concurrency", "1", "--num-requests", "2",
               "--workload", "code", "--mean-output-tokens", "4",
               "--max-output-tokens", "6", "--kv-cache-memory", "16MiB", "--speculative", "ngram", "--rounds", "2",
               "--output", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["config"]["rounds"] == 2 and report["inputs"]["rounds_workload_sha256"]
    assert report["config"]["engine"]["kv_cache_memory"] == "16MiB"
    (tier,) = report["tiers"]
    assert set(tier["rounds"]) == {"continuous", "continuous+ngram"}
    assert all(len(v) == 2 and min(v) > 0 for v in tier["rounds"].values())
    keys = {"continuous+ngram_over_continuous"}  # continuous / static is the same pairing (the test above)
    assert set(tier["ratios_rounds"]) == keys
    for key in keys:
        r = tier["ratios_rounds"][key]
        assert r["rounds"] == 2 and len(r["per_round"]) == 2
        assert r["ci95"][0] <= r["ratio"] <= r["ci95"][1]
        # round 1 is the tier's own measurement
        assert r["per_round"][0] == pytest.approx(tier["ratios"][key])
    assert report["speculative_curve"]["continuous+ngram"][0]["ci95"] == \
        tier["ratios_rounds"]["continuous+ngram_over_continuous"]["ci95"]
    assert "over 2 rounds" in capsys.readouterr().out
    assert any(p.name == "bench.ratios.png" for p in plot_file(out))  # `qtool plot`: the intervals drawn
