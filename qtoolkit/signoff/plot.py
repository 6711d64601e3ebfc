"""`qtool plot FILE.json`: the report's plots for a standalone `qtool eval` or `qtool bench serve` result.

An eval JSON gives the KLD distribution (the report's `plot_kld`) and, per task, each paired delta with its 95% CI
(the report's quality plot, without a policy's limits). A bench JSON gives output tok/s per system over the
concurrency tiers (the report's throughput plot) and TTFT / TPOT medians in milliseconds.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from ..bench.loop import TierRecord
from ..bench.summary import Distribution, TierSummary
from ..errors import DataError
from ..evals.results import EvalResults
from ..evals.summary import PairedDelta, TaskSummary, figure_from_json
from .report import plot_kld, png


def eval_kld_values(evals: EvalResults) -> dict[str, list[float]]:
    """Per-token KLD values of every task (per text set for perplexity), as the report collects them."""
    out: dict[str, list[float]] = {}
    for task, result in evals.tasks.items():
        for text_set, values in result.token_klds().items():
            out.setdefault(f"{task}/{text_set}" if text_set else task, []).extend(values)
    return {k: v for k, v in out.items() if v}


def _deltas(evals: EvalResults) -> list[tuple[str, float, list[float | None]]]:
    rows = []
    for task, result in evals.tasks.items():
        summary = result.summary or TaskSummary.from_json(None)
        # a figure may sit one level down (summary[group][metric]) in a node of another shape
        nested = {f"{k}.{m}": figure_from_json(x) for k, v in summary.entries.items() if isinstance(v, dict)
                  for m, x in v.items()}
        for metric, d in {**summary.deltas(), **nested}.items():
            if isinstance(d, PairedDelta) and d.delta is not None:
                rows.append((f"{task}.{metric}", d.delta, list(d.ci.bounds or (None, None))))
    return rows


def plot_eval_deltas(evals: EvalResults) -> str | None:
    rows = _deltas(evals)
    if not rows:
        return None
    fig = Figure(figsize=(6.5, 0.75 * len(rows) + 0.6))
    axes = fig.subplots(len(rows), 1, squeeze=False)
    for ax, (name, delta, (lo, hi)) in zip(axes[:, 0], rows, strict=True):
        err = [[delta - lo], [hi - delta]] if lo is not None and hi is not None else None
        ax.errorbar([delta], [0], xerr=err, fmt="o", color="tab:blue", capsize=4)
        ax.axvline(0, color="black", linestyle="--", linewidth=1)
        ax.set_yticks([0], [name])
        ax.grid(axis="x", alpha=0.3)
    axes[0, 0].set_title("Candidate - baseline, paired 95% CI (dashed = no change)")
    fig.tight_layout()
    return png(fig)


def _median_ms(d: Distribution) -> float | None:
    return None if d.p50 is None else 1000 * d.p50


# each plot: its name, the figure of a tier summary, the axis label and the title
_BENCH_PLOTS: tuple[tuple[str, Callable[[TierSummary], float | None], str, str], ...] = (
    ("output_tok_per_s", lambda s: s.output_tok_per_s, "output tokens/s", "Throughput per system"),
    ("ttft", lambda s: _median_ms(s.ttft), "median TTFT (ms)", "Time to first token per system"),
    ("tpot", lambda s: _median_ms(s.tpot), "median TPOT (ms)", "Time per output token per system"))


def plot_bench(data: dict[str, Any]) -> dict[str, str | None]:
    """A `qtool bench serve` result's plots: each figure per system over the tiers' concurrency, and the ratios
    over rounds."""
    tiers = data.get("tiers") or []
    if not tiers:
        return {}
    records = [TierRecord.from_json(t) for t in tiers]
    plots: dict[str, str | None] = {}
    for name, figure, label, title in _BENCH_PLOTS:
        series: dict[str, list[tuple[int, float]]] = {}
        for tier in records:
            for system, r in tier.results.items():
                if (value := figure(r)) is not None:
                    series.setdefault(system, []).append((tier.concurrency, value))
        if not series:
            continue
        fig = Figure(figsize=(6.5, 3.6))
        ax = fig.subplots()
        for system, pts in series.items():
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o", label=system)
        _concurrency_axes(ax, label, title)
        plots[name] = png(fig)
    if ratios := _bench_ratios_over_rounds(tiers):
        plots["ratios"] = ratios
    return plots


def _bench_ratios_over_rounds(tiers: list[dict[str, Any]]) -> str | None:
    """`bench serve --rounds N`: each ratio per concurrency with its 95% interval over the rounds."""
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, float, list[float] | None]]] = {}
    for tier in tiers:
        for key, r in (tier.get("ratios_rounds") or {}).items():
            series.setdefault(key, []).append((tier["concurrency"], r["ratio"], r.get("ci95")))
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for key, pts in series.items():
        xs = [c for c, _, _ in pts]
        ys = [v for _, v, _ in pts]
        err = [[v - ci[0] if ci else 0.0 for _, v, ci in pts], [ci[1] - v if ci else 0.0 for _, v, ci in pts]]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=key)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    _concurrency_axes(ax, "ratio of output tokens/s", "Ratios over rounds, 95% CI")
    return png(fig)


def _concurrency_axes(ax: Any, ylabel: str, title: str) -> None:
    """A bench plot's axes: concurrency on a log2 scale, one line per system."""
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot_file(path: str | Path, output: str | Path | None = None) -> list[Path]:
    """Write the plots of an eval or bench result JSON as PNGs next to it (or into `output`)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"{path} not found: pass the JSON that qtool eval or qtool bench serve wrote") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path} is not JSON ({e}): pass the JSON that qtool eval or qtool bench serve wrote") \
            from None
    if isinstance(data, dict) and "tasks" in data:
        try:
            evals = EvalResults.from_json(data)
        except DataError as e:
            raise DataError(f"{path}: {e}") from None
        plots = {"kld": plot_kld(eval_kld_values(evals)), "quality": plot_eval_deltas(evals)}
    elif isinstance(data, dict) and "tiers" in data:
        plots = plot_bench(data)
    else:
        raise DataError(f"{path} is neither a qtool eval result (`tasks`) nor a bench serve result (`tiers`): "
                        "pass one of those")
    folder = Path(output) if output else path.parent
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, data_b64 in plots.items():
        if data_b64:
            out = folder / f"{path.stem}.{name}.png"
            out.write_bytes(base64.b64decode(data_b64))
            written.append(out)
    if not written:
        raise DataError(f"{path} holds nothing to plot yet (no finished task or tier): rerun when it has")
    return written
