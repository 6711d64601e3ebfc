"""`qtool quantize` on a tiny local model: the checkpoint is what the recipe says, and bad input writes nothing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from qtoolkit.cli import main
from qtoolkit.quantize.report import QuantizeReport
from qtoolkit.quantize.run import quantize


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for p in folder.glob("*.safetensors"):
        with safe_open(p, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _dequantized_linears(folder: Path) -> dict[str, torch.Tensor]:
    """Weights as transformers reconstructs them from the compressed checkpoint (the consumer's view)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                 quantization_config=CompressedTensorsConfig(dequantize=True))
    return {n: m.weight.detach().float() for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n != "lm_head"}


@pytest.fixture(scope="module")
def rtn_dir(tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("q") / "int4-rtn"
    quantize(tiny_model_dir, "int4-rtn", out, verify=True)
    return out


def test_int4_rtn_checkpoint_is_compressed_tensors(rtn_dir):
    cfg = json.loads((rtn_dir / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "pack-quantized"
    w = cfg["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["group_size"], w["symmetric"]) == (4, 32, True)
    t = _tensors(rtn_dir)
    assert t["model.layers.0.mlp.up_proj.weight_packed"].dtype == torch.int32
    report = QuantizeReport.load(rtn_dir / "quantize_report.json")
    assert report.provenance["schema_version"] == 1 and report.model["sha256"]
    assert report.totals.linear_ratio_vs_bf16 <= 0.30
    assert report.smoke_test.completion  # transformers reloaded it and generated
    assert (rtn_dir / "tokenizer.json").is_file() and (rtn_dir / "qtoolkit_recipe.yaml").is_file()
    mask = os.umask(0o022)
    os.umask(mask)
    assert rtn_dir.stat().st_mode & 0o777 == 0o777 & ~mask  # not mkdtemp's 0700
    assert (rtn_dir / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask  # not the temp file's 0600


def test_report_round_trips_through_its_type(rtn_dir):
    """The file quantize writes is exactly what QuantizeReport writes back, key order included."""
    raw = json.loads((rtn_dir / "quantize_report.json").read_text())
    report = QuantizeReport.load(rtn_dir / "quantize_report.json")
    assert report.to_json() == raw and list(report.to_json()) == list(raw)
    assert QuantizeReport.from_json(json.loads(json.dumps(report.to_json()))) == report
    assert report.totals.linear_layers == len(report.layers) == 14
    assert report.totals.linear_quantized_bytes == sum(x.quantized_bytes for x in report.layers)
    assert report.timings.verify_s is not None and report.output == str(rtn_dir.resolve())


def test_cli_summary_is_the_report_s_figures(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "rtn"
    assert main(["quantize", "--model", str(tiny_model_dir), "--recipe", "int4-rtn", "--output", str(out),
                 "--no-verify"]) == 0
    summary = json.loads(capsys.readouterr().out)
    report = QuantizeReport.load(out / "quantize_report.json")
    assert summary == {"output": str(out), "recipe": "int4-rtn",
                       "linear_ratio_vs_bf16": report.totals.linear_ratio_vs_bf16,
                       "linear_quantized_bytes": report.totals.linear_quantized_bytes,
                       "checkpoint_bytes": report.totals.checkpoint_bytes, "seconds": report.timings.total_s,
                       "smoke_test": None}
    assert report.smoke_test is None and "verify_s" not in report.to_json()["timings"]


def test_int4_dequantized_within_half_a_step(rtn_dir, tiny_model_dir):
    """RTN: every dequantized weight is within half a quantization step (+ bf16 rounding) of the original."""
    orig = _tensors(tiny_model_dir)
    scales = _tensors(rtn_dir)
    for name, dq in _dequantized_linears(rtn_dir).items():
        w = orig[f"{name}.weight"].to(torch.bfloat16).float()  # the recipe quantizes in bfloat16
        s = scales[f"{name}.weight_scale"].float().repeat_interleave(32, dim=1)
        err = (dq - w).abs()
        # half a step from rounding, plus bf16 rounding of the dequantized product (2^-8 relative)
        assert torch.all(err <= 0.5 * s + 2**-8 * w.abs() + 1e-6), (name, (err / s).max())
        assert err.max() > 0  # it really was quantized


def test_gptq_has_lower_output_error_than_rtn(tiny_model_dir, rtn_dir, tmp_path):
    """On its calibration data, GPTQ's model output is closer to the original's than RTN's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qtoolkit.quantize.calibration import calibration_texts

    gptq = tmp_path / "gptq"
    quantize(tiny_model_dir, "int4-gptq", gptq, num_samples=16, verify=False)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = calibration_texts("mixed", 16, tok, seed=0)
    ids = [tok(t, return_tensors="pt", truncation=True, max_length=128).input_ids for t in texts[:8]]

    def hidden(folder: Path) -> list[torch.Tensor]:
        m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            return [m(x, output_hidden_states=True).hidden_states[-1] for x in ids]

    ref = hidden(tiny_model_dir)
    err = {name: sum(((h - r) ** 2).mean().item() for h, r in zip(hidden(d), ref, strict=True))
           for name, d in (("rtn", rtn_dir), ("gptq", gptq))}
    assert err["gptq"] < err["rtn"], err


def test_fp8_dynamic_and_weight_only(tiny_model_dir, tmp_path):
    for recipe, has_act in (("fp8-dynamic", True), ("fp8-weight", False)):
        out = tmp_path / recipe
        res = quantize(tiny_model_dir, recipe, out, verify=False)
        grp = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
        assert (grp["input_activations"] is not None) == has_act
        assert _tensors(out)["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
        assert res.report.totals.linear_ratio_vs_bf16 <= 0.52


def _run_cli(capsys, *args: str) -> tuple[int, str]:
    code = main(["quantize", *args])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def test_bad_inputs_exit_2_and_write_nothing(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    notmodel = tmp_path / "notes.gguf"
    notmodel.write_text("hello")
    truncated = tmp_path / "trunc"
    truncated.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (truncated / f).write_bytes((tiny_model_dir / f).read_bytes())
    data = (tiny_model_dir / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("name: x\nquantization: [\n")
    cases = [
        ((f"--model={tmp_path / 'missing'}", "--recipe=int4-rtn"), "not found"),
        ((f"--model={notmodel}", "--recipe=int4-rtn"), "not a GGUF file"),
        ((f"--model={truncated}", "--recipe=int4-rtn"), "truncated"),
        ((f"--model={tiny_model_dir}", "--recipe=int5-magic"), "unknown recipe"),
        ((f"--model={tiny_model_dir}", f"--recipe={bad_yaml}"), "malformed YAML"),
    ]
    for args, words in cases:
        code, msg = _run_cli(capsys, *args, f"--output={out}")
        assert code == 2 and words in msg and msg.startswith("qtool: error:"), (args, msg)
        assert not out.exists()
    out.mkdir()
    code, msg = _run_cli(capsys, f"--model={tiny_model_dir}", "--recipe=int4-rtn", f"--output={out}")
    assert code == 2 and "already exists" in msg
    assert list(tmp_path.glob(".out.tmp-*")) == []


def test_failure_midway_leaves_no_partial_output(tiny_model_dir, tmp_path, monkeypatch):
    import qtoolkit.quantize.run as qmod

    def boom(folder):
        raise RuntimeError("simulated crash while verifying")

    monkeypatch.setattr(qmod, "_smoke_generate", boom)
    with pytest.raises(RuntimeError):
        quantize(tiny_model_dir, "int4-rtn", tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_int8_weight_and_bnb_nf4_peer(tiny_model_dir, tmp_path):
    res = quantize(tiny_model_dir, "int8-weight", tmp_path / "int8", verify=False)
    grp = json.loads((tmp_path / "int8" / "config.json").read_text())["quantization_config"]["config_groups"]
    assert grp["group_0"]["weights"]["num_bits"] == 8 and grp["group_0"]["weights"]["strategy"] == "channel"
    assert res.report.totals.linear_ratio_vs_bf16 <= 0.55
    # the peer: transformers' bitsandbytes NF4 serialization, reloaded and run by transformers
    res = quantize(tiny_model_dir, "bnb-nf4", tmp_path / "nf4")
    cfg = json.loads((tmp_path / "nf4" / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "bitsandbytes" and cfg["bnb_4bit_quant_type"] == "nf4"
    # NF4 is 4 bits + absmax per 64; on 64-wide toy layers bnb's fixed tables (quant maps) add ~0.1
    assert res.report.totals.linear_ratio_vs_bf16 <= 0.45
    assert res.report.smoke_test is not None


HEAD8 = """version: 1
name: int4-head8
quantization:
  modifier: QuantizationModifier
  scheme: W4A16_ASYM
  weights: {group_size: 32}
  ignore: [lm_head]
  head: {scheme: W8A16, weights: {strategy: channel}}
"""


def test_head_section_quantizes_a_tied_lm_head_on_its_own_grid(tiny_model_dir, tmp_path):
    """INT4 body + INT8 head (the GGUF Q4 mix): the head is untied from the bf16 embedding, stored INT8 per
    channel, and the engine computes the same logits as transformers' own reading of the checkpoint."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    from qtoolkit.engine import Engine
    from qtoolkit.model.quant_linear import QuantLinear

    recipe = tmp_path / "int4-head8.yaml"
    recipe.write_text(HEAD8)
    out = tmp_path / "head8"
    res = quantize(tiny_model_dir, recipe, out, verify=True)
    cfg = json.loads((out / "config.json").read_text())
    groups = {tuple(g["targets"]): g for g in cfg["quantization_config"]["config_groups"].values()}
    assert groups[("lm_head",)]["weights"]["num_bits"] == 8 and groups[("Linear",)]["weights"]["num_bits"] == 4
    t = _tensors(out)
    head = t.get("lm_head.weight_packed", t.get("lm_head.weight"))
    assert head is not None and head.dtype in (torch.int8, torch.int32)
    assert t["model.embed_tokens.weight"].dtype == torch.bfloat16  # the lookup table stays full precision
    assert not cfg.get("tie_word_embeddings", False)
    layers = {x.name: x for x in res.report.layers}
    assert layers["lm_head"].ratio_vs_bf16 < 0.55  # INT8 + per-channel scales
    assert res.report.recipe.head["weights"]["num_bits"] == 8

    engine = Engine(str(out), kv_cache_memory="2MiB", block_size=4)
    assert isinstance(engine.model.lm_head, QuantLinear) and engine.model.lm_head.kind == "int8"
    ref_model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                     quantization_config=CompressedTensorsConfig(dequantize=True))
    ids = torch.randint(0, 1000, (23,), generator=torch.Generator().manual_seed(0)).tolist()
    (got,) = engine.score([ids])
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=1e-3)
