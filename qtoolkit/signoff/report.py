"""Sign-off report: report.json (every figure), report.md (for a code review), report.html (self-contained, plots
embedded as PNG data URIs so the file can be mailed or attached to a release ticket).

report.md is the source of the HTML body: markdown-it-py (CommonMark + tables, raw HTML off) renders it, and a
jinja2 template with autoescaping wraps it, so no text from a gate, an error or a model name is ever markup."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
from markdown_it import MarkdownIt
from markupsafe import Markup
from matplotlib.figure import Figure

from ..bench.ablation import AblationTable
from ..diagnose.result import DiagnoseResult
from ..evals.custom_summary import ItemRegression
from ..evals.results import EvalResults
from ..evals.summary import RoundsRatio, TaskSummary
from ..io import write_json, write_text
from ..quantize.report import QuantizeSummary
from .judge import Gate
from .policy import Policy
from .report_deployment import deployment_lines
from .sequential import design_of
from .speed import speed_answer
from .verdict import KVLayerSection, SignoffReport

_STATUS = {True: "PASS", False: "FAIL"}
_COLORS = {"PASS": "#1a7f37", "FAIL": "#cf222e", "INCONCLUSIVE": "#9a6700"}


def _verdict(g: Gate) -> str:
    """A gate's verdict as shown: PASS / FAIL / INCONCLUSIVE / no evidence."""
    v = g.verdict or _STATUS[g.passed]
    if g.state:  # e.g. "not measurable" on a deployment sign-off
        return f"{v} ({g.state})"
    return "no evidence" + ("" if g.required else " (not required)") if v == "NO EVIDENCE" else v


def table_cell(v: Any) -> str:
    """Text for a Markdown table cell: a `|` would end the cell and a newline the row."""
    return str(v).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def fmt(v: Any, digits: int = 4) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v + 0.0:.{digits}g}"  # + 0.0 turns -0.0 into 0.0
    return str(v)


# ---- plots ---------------------------------------------------------------------------------------------------
def png(fig: Figure) -> str:
    """A figure as base64 PNG; figures are built without pyplot, so no GUI backend and no global state."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def plot_throughput(ablation: AblationTable | None) -> str | None:
    if ablation is None or not ablation.tiers:
        return None
    fig = Figure(figsize=(6.5, 3.6))
    ax = fig.subplots()
    series: dict[str, list[tuple[int, float]]] = {}
    for tier in ablation.tiers:
        for step in tier.steps:
            series.setdefault(step.label, []).append((tier.concurrency, step.output_tok_per_s))
    for label, pts in series.items():
        xs, ys = zip(*pts, strict=True)
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Throughput per ablation step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return png(fig)


def plot_quality(gates: list[Gate], policy: Policy) -> str | None:
    gates = [g for g in gates if g.task in ("code", "summarization")]
    if not gates:
        return None
    fig = Figure(figsize=(6.5, 0.75 * len(gates) + 0.6))
    axes = fig.subplots(len(gates), 1, squeeze=False)
    for ax, g in zip(axes[:, 0], gates, strict=True):
        bound = policy.tasks[g.task][g.metric]
        limit = bound.max if bound.max is not None else bound.min
        color = {"PASS": "tab:green", "FAIL": "tab:red"}.get(g.verdict or _STATUS[g.passed], "tab:orange")
        if g.point is not None:
            lo, hi = sorted((g.point, g.judged))
            ax.errorbar([g.point], [0], xerr=[[g.point - lo], [hi - g.point]], fmt="o", color=color, capsize=4)
            ax.plot([g.judged], [0], marker="|", markersize=14, color=color)
        ax.axvline(limit, color="black", linestyle="--", linewidth=1)
        ax.set_yticks([0], [g.name])
        ax.grid(axis="x", alpha=0.3)
    axes[0, 0].set_title("Quality: point estimate to the judged CI bound, dashed = policy limit")
    fig.tight_layout()
    return png(fig)


def plot_kld(eval_records: dict[str, list[float]]) -> str | None:
    if not eval_records:
        return None
    fig = Figure(figsize=(6.5, 3.2))
    ax = fig.subplots()
    for task, values in eval_records.items():
        v = np.clip(np.asarray(values), 1e-6, None)
        ax.hist(v, bins=np.logspace(-6, 1.5, 50), alpha=0.55, label=f"{task} ({v.size} tokens)")
    ax.set_xscale("log")
    ax.set_xlabel("per-token KL divergence (nats)")
    ax.set_ylabel("tokens")
    ax.set_title("KLD of candidate vs baseline next-token distributions")
    ax.legend(fontsize=8)
    return png(fig)


def plot_memory(s: QuantizeSummary | None) -> str | None:
    if s is None:
        return None
    t = s.totals
    labels = ["source (fp32)", "bf16", f"{s.recipe.name}"]
    values = [t.linear_source_bytes / 2**20, t.linear_bf16_bytes / 2**20, t.linear_quantized_bytes / 2**20]
    fig = Figure(figsize=(6.5, 2.6))
    ax = fig.subplots()
    bars = ax.barh(labels, values, color=["tab:gray", "tab:blue", "tab:green"])
    ax.bar_label(bars, fmt="%.1f MiB", fontsize=8)
    ax.set_xlabel("Linear-layer weight bytes (MiB)")
    ax.set_title("Memory: weights of the quantized layers")
    return png(fig)


def plot_roofline(d: DiagnoseResult | None) -> str | None:
    if d is None:
        return None
    fig = Figure(figsize=(6.5, 3.4))
    ax = fig.subplots()
    batches = [r.batch for r in d.decode]
    ax.plot(batches, [r.tokens_per_s for r in d.decode], marker="o", label="decode achieved")
    ax.plot(batches, [d.roofline[b].decode_attainable_tok_s for b in batches], linestyle="--",
            label="decode roofline (bandwidth / compute)")
    ax.axhline(d.prefill_attainable_tok_s, color="tab:red", linestyle=":", label="prefill compute roofline")
    for p in d.prefill:
        ax.plot([1], [p.tokens_per_s], marker="s", color="tab:red")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("decode batch size (prefill points at x=1)")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"Roofline on this machine: bottleneck = {d.bottleneck}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    return png(fig)


def kld_values(folder: Path) -> dict[str, list[float]]:
    """Per-token KLD values from the eval records (for the distribution plot), every text set of a task together."""
    path = folder / "eval.json"
    if not path.is_file():
        return {}
    out = {}
    for task, result in EvalResults.load(path).tasks.items():
        vals = [x for values in result.token_klds().values() for x in values]
        if vals:
            out[task] = vals
    return out


def _method_cell(gate: Gate) -> str:
    """The interval's method and its simulated coverage at the sample size used (evals/stats/ci_coverage_table.py)."""
    if not gate.ci_method:
        return ""
    cov = gate.ci_coverage
    return f" ({gate.ci_method}{'' if cov is None else f', simulated coverage {cov:.1%}'})"


def look_level(limit: int | None, max_items: int | None, items: int | None) -> float:
    """The confidence level (in %) of the look that drew `items`: the error-spending design of the sign-off's
    --limit and --max-items (qtoolkit/signoff/error_spending.py); 95 when judged once."""
    if not limit or not items:
        return 95.0
    return 100 * design_of(limit, max_items).level_at(items)


# ---- text ----------------------------------------------------------------------------------------------------
def markdown(report: SignoffReport) -> str:
    """report.md: the verdict and why, the gates, the steps, then each section the evidence holds."""
    cfg, ev = report.config, report.evidence
    lines = [f"# Release sign-off: {report.verdict}", "",
             f"Model `{cfg['model']}` with recipe `{cfg['recipe']}` under policy `{report.policy.name}` "
             f"({report.provenance.get('created')}).", ""]
    lines += speed_answer(ev.speed.figures if ev.speed else [], ev.speed.pair if ev.speed else None,
                          ev.speed.slo if ev.speed else None)
    if report.reasons:
        why = {"FAIL": "Why it fails", "INCONCLUSIVE": "Why it is inconclusive"}.get(report.verdict, "Why")
        lines += [f"## {why}", ""] + [f"- {r}" for r in report.reasons] + [""]
    lines += ["## Gates", "", "| gate | result | point | judged (CI bound) | detail | could detect |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {g.name} | {_verdict(g)} | {fmt(g.point)} | {fmt(g.judged)} | {table_cell(g.detail)} | "
              f"{table_cell(g.resolution)}{_method_cell(g)} |" for g in report.gates]
    if report.reading:
        lines += ["", "## How to read this verdict", ""] + [f"- {n}" for n in report.reading]
    lines += ["", "## Steps", "", "| step | status | seconds | note |", "|---|---|---|---|"]
    for name, s in ev.steps.items():  # steps.json's entries
        note = s.error or s.reason or ("reused" if s.reused else "")
        lines.append(f"| {name} | {s.status} | {fmt(s.seconds)} | {table_cell(note)} |")
    lines += deployment_lines(report.deployment)  # endpoints, their bench tiers, what they cannot give
    lines += ablation_lines(ev.ablation) + kv_layer_lines(ev.kv_layer)
    evals = ev.evals or EvalResults({})
    limit, max_items = cfg.get("limit"), cfg.get("max_items")  # a deployment's config, like a local one's
    lines += quality_lines(evals, lambda items: look_level(limit, max_items, items)) + custom_regression_lines(evals)
    if ev.quant is not None:
        t = ev.quant.totals
        lines += ["## Memory", "", f"Linear weights: {t.linear_quantized_bytes / 2**20:.1f} MiB quantized vs "
                  f"{t.linear_bf16_bytes / 2**20:.1f} MiB in bf16 ({t.linear_ratio_vs_bf16}x); checkpoint "
                  f"{t.checkpoint_bytes / 2**20:.1f} MiB (source {t.source_checkpoint_bytes / 2**20:.1f} MiB).", ""]
    d = ev.diagnose
    if d is not None:
        lines += ["## Bottleneck", "", f"**{d.bottleneck}** — bandwidth "
                  f"{d.machine_ceilings.memory_bandwidth_gb_s} GB/s, fp32 GEMM "
                  f"{d.machine_ceilings.fp32_gemm_gflop_s} GFLOP/s.", ""]
        lines += [f"{i}. {lever}" for i, lever in enumerate(d.levers, 1)] + [""]
    provenance = {k: report.provenance.get(k) for k in ("inputs", "versions", "machine")}
    lines += ["## Provenance", "", "```json", json.dumps(provenance, indent=2), "```", ""]
    return "\n".join(lines)


def ablation_lines(ablation: AblationTable | None) -> list[str]:
    """Per tier: each stacked layer's tok/s and marginal gain, each layer alone, and the repeated rounds."""
    if ablation is None:
        return []
    lines = ["", "## Ablation: output tok/s per layer (marginal gain over the layer above)", ""]
    for tier in ablation.tiers:
        alone = ", ".join(f"{k} {v:.2f}x" for k, v in tier.alone_speedup.items()) or "-"
        lines.append(f"**concurrency {tier.concurrency}** — stacked {fmt(tier.total_speedup, 3)}x; "
                     f"each layer alone over the baseline: {alone}; stacking efficiency "
                     f"{fmt(tier.stacking_efficiency, 3)} (1 = the layers compound, < 1 = they overlap)")
        lines += ["", "| layer | tok/s | marginal |", "|---|---|---|"]
        lines += [f"| {s.label} | {s.output_tok_per_s:.1f} | {fmt(s.marginal_gain, 3)} |" for s in tier.steps]
        lines.append("")
        for rounds, what in ((tier.total_speedup_rounds, "full stack"),
                             (tier.quantization_speedup_rounds, "quantization alone")):
            r = RoundsRatio.from_json(rounds)
            if r is not None:
                b = r.ci.bounds
                ci = f"95% CI [{fmt(b[0], 3)}, {fmt(b[1], 3)}]" if b is not None else "no CI"
                per = ", ".join(f"{v:.3f}" for v in r.per_round)
                lines += [f"Repeated rounds, {what} over the baseline: {fmt(r.ratio, 3)}x, {ci} over "
                          f"{r.rounds} rounds of fresh requests (per round: {per}).", ""]
    return lines


def kv_layer_lines(layer: KVLayerSection | None) -> list[str]:
    """The ablation's KV cache layer: the candidate with the unquantized and the quantized cache at one budget
    where the unquantized cache is the limit (bench_kv.json)."""
    if layer is None:
        return []
    row, cfg = layer.row, layer.config
    base, quant = "kv_auto", f"kv_{row.kv_cache_dtype}"
    lines = ["", f"## Ablation: KV cache layer ({row.kv_cache_dtype} vs the unquantized cache)", "",
             f"The candidate at concurrency {cfg.get('concurrency')} on the `{cfg.get('workload')}` workload, "
             f"--kv-cache-memory {cfg.get('kv_cache_memory')} bytes for both caches, one server at a time.", "",
             "| KV cache | tokens that fit | preemptions | output tok/s |", "|---|---|---|---|"]
    for name in (base, quant):
        lines.append(f"| {name.removeprefix('kv_')} | {row.capacity_tokens.get(name, '-')} | "
                     f"{fmt(row.preemptions.get(name))} | {fmt(row.output_tok_per_s.get(name), 4)} |")
    lines += ["", f"Tokens that fit: {fmt(row.capacity_ratio, 3)}x; output tok/s: "
              f"{fmt(row.throughput_ratio, 3)}x in the tier's own measurement."]
    r = RoundsRatio.from_json(row.throughput_ratio_rounds)
    if r is not None:
        b = r.ci.bounds
        ci = f"95% CI [{fmt(b[0], 3)}, {fmt(b[1], 3)}]" if b is not None else "no CI"
        lines.append(f"Over {r.rounds} interleaved rounds of fresh requests: {fmt(r.ratio, 3)}x, {ci} (per round: "
                     f"{', '.join(f'{v:.3f}' for v in r.per_round)}).")
    return lines + [""]


def quality_lines(evals: EvalResults, level_at: Callable[[int | None], float] = lambda items: 95.0) -> list[str]:
    """Per task: each paired delta and token statistic, candidate against baseline with its interval at the level
    of the task's last look (`level_at(items)`, in %)."""
    if not evals.tasks:
        return []
    lines = ["## Quality per task (candidate vs baseline, paired CI at the level of the task's last look)", ""]
    for task, result in evals.tasks.items():
        s = result.summary or TaskSummary.from_json(None)
        lines.append(f"**{task}** ({result.items} items)")
        lines += ["", f"| metric | candidate | baseline | delta | CI (look error {100 - level_at(result.items):.2f}%) |",
                  "|---|---|---|---|---|"]
        for k, d in s.deltas().items():
            lo, hi = d.ci.bounds or (None, None)
            lines.append(f"| {k} | {fmt(d.candidate)} | {fmt(d.baseline)} | {fmt(d.delta)} | "
                         f"[{fmt(lo)}, {fmt(hi)}] |")
        ts = s.text_stats
        for k in ("kld", "ppl_ratio", "same_top1", "delta_p"):
            t = None if ts is None else ts.figure(k)
            if t is not None:
                lo, hi = t.ci.bounds or (None, None)
                lines.append(f"| {k} | {fmt(t.mean)} ± {fmt(t.se, 2)} | | | [{fmt(lo)}, {fmt(hi)}] |")
        lines.append("")
    return lines


def custom_regression_lines(evals: EvalResults) -> list[str]:
    """Per workload file (custom:NAME): the items whose answers changed most, so a reader sees which prompts."""
    def cell(text: Any) -> str:
        return " ".join(str(text).split()).replace("|", "¦")[:80] or "-"

    lines: list[str] = []
    for task, result in evals.tasks.items():
        worst = None if result.summary is None else result.summary.get("worst_items")
        if not task.startswith("custom:") or worst is None:
            continue
        lines += [f"## Worst regressions: {task}", "",
                  f"Items whose greedy answer changed, worst first (a lost test pass, then the ROUGE-L drop, then "
                  f"the mean KLD on the baseline's answer); {len(worst)} shown.", ""]
        if not worst:
            lines += ["No item's answer changed.", ""]
            continue
        lines += ["| line | id | kind | prompt | tests (cand/base) | ROUGE-L drop | mean KLD | NLL delta | "
                  "tokens (cand/base) | candidate answer | baseline answer |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for x in map(ItemRegression.from_json, worst):
            passed = "-" if x.passed is None else "/".join("pass" if p else "fail" for p in x.passed)
            lines.append(f"| {x.line} | {cell(x.id)} | {x.kind} | {cell(x.prompt)} | {passed} | "
                         f"{fmt(x.rougeL_drop)} | {fmt(x.kld_mean)} | {fmt(x.nll_delta)} | "
                         f"{x.tokens[0]}/{x.tokens[1]} | {cell(x.candidate)} | {cell(x.baseline)} |")
        lines.append("")
    return lines


_MD = MarkdownIt("commonmark", {"html": False}).enable("table")

_TEMPLATE = jinja2.Environment(autoescape=True).from_string("""<!doctype html>
<html><head><meta charset="utf-8"><title>Sign-off {{ verdict }}</title>
<style>
body { font-family: system-ui, sans-serif; max-width: 980px; margin: 2em auto; color: #1f2328; }
h1 { color: {{ color }}; } table { border-collapse: collapse; margin: 0.5em 0; }
td, th { border: 1px solid #d0d7de; padding: 3px 8px; font-size: 13px; } th { background: #f6f8fa; }
pre { background: #f6f8fa; padding: 8px; font-size: 12px; overflow-x: auto; }
figure { display: inline-block; margin: 6px; }
.verdict { display: inline-block; color: white; font-weight: bold; padding: 4px 14px; border-radius: 4px; }
</style></head><body>
<div class="verdict" id="verdict" style="background:{{ color }}">{{ verdict }}</div>
{{ head }}
<section id="plots">{% for name, data in plots %}<figure><img alt="{{ name }}" id="plot-{{ name }}"
src="data:image/png;base64,{{ data }}"/></figure>{% endfor %}</section>
{{ rest }}
</body></html>
""")


def _md_to_html(md: str) -> str:
    """report.md as HTML: markdown-it escapes every `<`, `&` and `|` in the text; raw HTML is not passed through."""
    return _MD.render(md)


def html_report(verdict: str, md: str, plots: dict[str, str | None]) -> str:
    body = _md_to_html(md)
    head, _, rest = body.partition("</h1>")  # the plots sit under the verdict heading
    return _TEMPLATE.render(verdict=verdict, color=_COLORS.get(verdict, "#cf222e"),
                            head=Markup(head + "</h1>" if rest else head),
                            rest=Markup(rest),
                            plots=[(name, data) for name, data in plots.items() if data])


def write_reports(folder: Path, signoff: SignoffReport) -> dict[str, Any]:
    """Write report.json, report.md and report.html; returns what report.json holds."""
    ev = signoff.evidence
    plots = {"throughput": plot_throughput(ev.ablation), "quality": plot_quality(signoff.gates, signoff.policy),
             "kld": plot_kld(kld_values(folder)), "memory": plot_memory(ev.quant), "roofline": plot_roofline(ev.diagnose)}
    report = signoff.to_json() | {"plots": sorted(k for k, v in plots.items() if v)}
    md = markdown(signoff)
    write_json(folder / "report.json", report)
    write_text(folder / "report.md", md)
    write_text(folder / "report.html", html_report(signoff.verdict, md, plots))
    return report
