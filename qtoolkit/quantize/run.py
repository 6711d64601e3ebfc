"""Recipe + model -> quantized checkpoint (compressed-tensors, safetensors) + quantize_report.json.

RTN and GPTQ run through llm-compressor's `oneshot`; the output is what vLLM and transformers load unchanged.
The `BitsAndBytes` peer recipe goes through transformers' bitsandbytes integration. Everything is written to a
temp folder, reloaded with transformers as a smoke test, and only then renamed into place.
"""

from __future__ import annotations

import json
import os
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.utils import match_named_modules
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

from ..errors import QToolError, RecipeError
from ..io import atomic_dir, check_output, write_json
from ..model.sources import ModelSource, resolve_model
from ..progress import bar, status
from ..provenance import provenance
from .calibration import calibration_dataset, calibration_texts
from .plausibility import check_source
from .recipe import BnbOptions, Recipe, check_against_model, load_recipe
from .report import LayerBytes, QuantizeReport, QuantizeTotals, RecipeRecord, SmokeTest, Timings

SMOKE_PROMPT = "Write a Python function that returns the largest number in a list."


@dataclass
class QuantizeResult:
    output: Path
    report: QuantizeReport = field(repr=False)


def safetensors_sizes(folder: Path) -> dict[str, int]:
    """Tensor name -> stored bytes, read from the safetensors headers (no tensor is loaded)."""
    sizes: dict[str, int] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                start, end = meta["data_offsets"]
                sizes[name] = end - start
    return sizes


def _apply_overrides(r: Recipe, calibration: str | None, num_samples: int | None) -> Recipe:
    if calibration is None and num_samples is None:
        return r
    if r.calibration is None:
        raise RecipeError(f"recipe {r.name} uses no calibration data: drop --calibration/--num-samples "
                          "or use a GPTQ recipe such as int4-gptq")
    cal = r.calibration.model_copy(update={k: v for k, v in
                                           {"dataset": calibration, "num_samples": num_samples}.items()
                                           if v is not None})
    if cal.dataset not in ("code", "summarization", "mixed"):
        raise RecipeError(f"unknown calibration set {calibration!r}: use code, summarization or mixed")
    if cal.num_samples <= 0:
        raise RecipeError(f"--num-samples must be positive, got {cal.num_samples}")
    return r.model_copy(update={"calibration": cal})


def _targeted_linears(model, r: Recipe) -> dict[str, tuple[int, int]]:
    q = r.quantization
    return {name: (m.out_features, m.in_features)
            for name, m in match_named_modules(model, q.targets, q.ignore)
            if isinstance(m, torch.nn.Linear)}


def _build_modifier(r: Recipe):
    q = r.quantization
    resolved = r.resolved_scheme()

    def args(d: dict[str, Any] | None) -> QuantizationArgs | None:
        if d is None:
            return None
        d = {k: v for k, v in d.items() if v is not None}
        if "scale_dtype" in d:
            d["scale_dtype"] = getattr(torch, d["scale_dtype"])
        return QuantizationArgs(**d)

    groups = {"group_0": QuantizationScheme(targets=q.targets, weights=args(resolved["weights"]),
                                            input_activations=args(resolved["input_activations"]))}
    head = r.resolved_head()
    if head:  # an exact module name outranks a class target in compressed-tensors' matching
        groups["group_head"] = QuantizationScheme(targets=["lm_head"], weights=args(head["weights"]),
                                                  input_activations=args(head["input_activations"]))
    # llm-compressor calibrates the KV scales on the recipe's data and saves them as self_attn.k_scale / v_scale
    kv = {"kv_cache_scheme": QuantizationArgs(**q.kv_cache_scheme.model_dump())} if q.kv_cache_scheme else {}
    if q.modifier == "GPTQModifier":
        extra = {k: v for k, v in {"dampening_frac": q.dampening_frac, "block_size": q.block_size}.items()
                 if v is not None}
        return GPTQModifier(config_groups=groups, ignore=q.body_ignore(), **extra, **kv)

    return QuantizationModifier(config_groups=groups, ignore=q.body_ignore(), **kv)


def _cast_scales(model, r: Recipe) -> None:
    """Store int scales in the recipe's `scale_dtype` when it differs from the precision quantization ran in.

    compressed-tensors keeps int scales in the weights' dtype. GPTQ runs in float32 here (bf16 matmuls crawl on
    CPUs without native bf16), so its scales come out fp32 (0.31x of bf16 bytes at INT4 g32). Casting them to
    bf16 before the checkpoint is packed is exact for the stored integers: packing re-rounds w/s with the cast
    scale, and |q| <= 8 times a relative change of <= 2^-9 stays far below half a step.
    """
    name = r.weight_args().get("scale_dtype")
    if not name:
        return
    dtype = getattr(torch, name)
    for _, module in match_named_modules(model, r.quantization.targets, r.quantization.ignore):
        scale = getattr(module, "weight_scale", None)
        if scale is not None and scale.dtype != dtype:
            scale.data = scale.data.to(dtype)


def _load_model(src: ModelSource, r: Recipe):
    tok = AutoTokenizer.from_pretrained(src.path)
    if r.method == "bnb":
        b = r.quantization.bnb or BnbOptions()
        cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=b.quant_type,
                                 bnb_4bit_compute_dtype=getattr(torch, b.compute_dtype),
                                 bnb_4bit_use_double_quant=b.double_quant,
                                 llm_int8_skip_modules=list(r.quantization.ignore))
        model = AutoModelForCausalLM.from_pretrained(src.path, quantization_config=cfg, device_map="cpu",
                                                         use_safetensors=True)
    else:
        model = AutoModelForCausalLM.from_pretrained(src.path, dtype=getattr(torch, r.precision),
                                                         use_safetensors=True)
    return model.eval(), tok


def _smoke_generate(folder: Path, max_new_tokens: int = 40) -> str:
    """Reload the written checkpoint with plain transformers and generate greedily: proves it loads and runs."""
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, device_map="cpu", use_safetensors=True).eval()
    if tok.chat_template:
        ids = tok.apply_chat_template([{"role": "user", "content": SMOKE_PROMPT}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tok(SMOKE_PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def _layer_bytes(shapes: dict[str, tuple[int, int]], src_sizes: dict[str, int],
                 out_sizes: dict[str, int]) -> tuple[list[LayerBytes], QuantizeTotals]:
    layers = []
    for name, (n, k) in bar(shapes.items(), desc="layer sizes", unit="layer"):
        after = sum(v for key, v in out_sizes.items() if key.startswith(f"{name}.") and not key.endswith(".bias"))
        layers.append(LayerBytes.measured(name, (n, k), src_sizes.get(f"{name}.weight", n * k * 4), after))
    return layers, QuantizeTotals.of(layers, sum(out_sizes.values()), sum(src_sizes.values()))


def _quantized_shapes(mdl, r: Recipe) -> dict[str, tuple[int, int]]:
    """(out, in) of every Linear the recipe quantizes, checked against the recipe's group sizes."""
    if r.method == "bnb":
        import bitsandbytes as bnb

        shapes = {n: (m.out_features, m.in_features) for n, m in mdl.named_modules()
                  if isinstance(m, bnb.nn.Linear4bit)}
    else:
        shapes = _targeted_linears(mdl, r)
    check_against_model(r, shapes)
    if r.quantization.head is not None:  # its own group: counted in the byte table, not the group-size check
        shapes["lm_head"] = (mdl.lm_head.out_features, mdl.lm_head.in_features)
    return shapes


def _apply_recipe(mdl, tok, r: Recipe) -> None:
    """Run llm-compressor's `oneshot` with the recipe's modifier (and calibration data), in place."""
    # llm-compressor's loguru sinks are left as the application set them: `qtool` picks their level through
    # llm-compressor's own LLM_COMPRESSOR_LOG_LEVEL and keeps them off its stdout (see qtoolkit/cli.py)
    kwargs: dict[str, Any] = {}
    if r.calibration is not None:
        c = r.calibration
        status(f"calibration: {c.num_samples} {c.dataset} samples, up to {c.max_seq_length} tokens")
        texts = calibration_texts(c.dataset, c.num_samples, tok, c.seed)
        kwargs = {"dataset": calibration_dataset(texts, tok, c.max_seq_length),
                  "num_calibration_samples": c.num_samples, "max_seq_length": c.max_seq_length,
                  "shuffle_calibration_samples": False}
    try:
        oneshot(model=mdl, recipe=[_build_modifier(r)], **kwargs)
    except Exception as e:  # llm-compressor raises plain ValueErrors for scheme/model mismatches
        raise RecipeError(f"{r.source}: llm-compressor could not apply the recipe ({type(e).__name__}: {e})") \
            from e
    _cast_scales(mdl, r)


def quantize(model: str | os.PathLike = "default", recipe: str | os.PathLike = "int4-rtn",
             output: str | os.PathLike = "out/quantized", *, calibration: str | None = None,
             num_samples: int | None = None, overwrite: bool = False, verify: bool = True) -> QuantizeResult:
    """Quantize `model` with `recipe` into `output` (a compressed-tensors folder with quantize_report.json)."""
    t0 = time.perf_counter()
    r = _apply_overrides(load_recipe(recipe), calibration, num_samples)
    output = Path(output)
    check_output(output, overwrite)  # fail before minutes of work, not after
    src = resolve_model(model)
    if src.quantization_config:
        raise QToolError(f"{src.spec} is already quantized ({src.quantization_config.get('quant_method')}): "
                         "pass the unquantized model")
    check_source(src)  # a GGUF read wrong decodes to garbage: refused before it is quantized
    timings: dict[str, float] = {}

    status(f"loading {src.name} for recipe {r.name}")
    t = time.perf_counter()
    mdl, tok = _load_model(src, r)
    timings["load_s"] = time.perf_counter() - t
    shapes = _quantized_shapes(mdl, r)
    t = time.perf_counter()
    if r.method != "bnb":  # bitsandbytes quantized the weights as they loaded
        _apply_recipe(mdl, tok, r)
    timings["quantize_s"] = time.perf_counter() - t

    with atomic_dir(output, overwrite=overwrite) as tmp:
        t = time.perf_counter()
        status(f"writing {output}")
        if r.method == "bnb":
            mdl.save_pretrained(tmp)
        else:
            mdl.save_pretrained(tmp, save_compressed=True)
        tok.save_pretrained(tmp)
        (tmp / "qtoolkit_recipe.yaml").write_text(Path(r.source).read_text() if Path(r.source).is_file() else "")
        timings["save_s"] = time.perf_counter() - t
        del mdl
        sample = None
        if verify:
            t = time.perf_counter()
            status("reloading the checkpoint with transformers (smoke test)")
            sample = _smoke_generate(tmp)
            timings["verify_s"] = time.perf_counter() - t
        layers, totals = _layer_bytes(shapes, safetensors_sizes(src.path), safetensors_sizes(tmp))
        timings["total_s"] = time.perf_counter() - t0
        smoke = SmokeTest(SMOKE_PROMPT, sample) if sample is not None else None
        report = _report(r, src, output, timings, totals, layers, smoke)
        write_json(tmp / "quantize_report.json", report.to_json())
    status(f"done in {timings['total_s']:.1f}s: linear weights {totals.linear_ratio_vs_bf16:.3f}x of bf16 "
           f"-> {output}")
    return QuantizeResult(output, report)


def _recipe_record(r: Recipe) -> RecipeRecord:
    q = r.quantization
    return RecipeRecord(name=r.name, sha256=r.sha256, description=r.description, method=r.method,
                        modifier=q.modifier, scheme=q.scheme, resolved=r.resolved_scheme(), head=r.resolved_head(),
                        targets=q.targets, ignore=q.ignore,
                        kv_cache_scheme=q.kv_cache_scheme.model_dump() if q.kv_cache_scheme else None,
                        calibration=r.calibration.model_dump() if r.calibration else None)


def _report(r: Recipe, src: ModelSource, output: Path, timings: dict[str, float], totals: QuantizeTotals,
            layers: list[LayerBytes], smoke: SmokeTest | None) -> QuantizeReport:
    """quantize_report.json: what was quantized how, bytes per layer before/after, timings, the smoke completion."""
    t = {k: round(v, 2) for k, v in timings.items()}
    return QuantizeReport(
        provenance=provenance(model=src.describe(), recipe={"name": r.name, "path": r.source, "sha256": r.sha256}),
        recipe=_recipe_record(r), model=src.describe(), output=str(output.resolve()),
        timings=Timings(t["load_s"], t["quantize_s"], t["save_s"], t["total_s"], t.get("verify_s")),
        totals=totals, smoke_test=smoke, layers=layers)
