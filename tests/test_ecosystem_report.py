"""The report is rendered by markdown-it + an autoescaping jinja2 template; `qtool plot` draws eval/bench JSON."""

from __future__ import annotations

import json
import shutil
import subprocess
from html.parser import HTMLParser

import pytest
from PIL import Image

from qtoolkit.bench.load_client import RequestResult, summarize
from qtoolkit.cli import main
from qtoolkit.signoff.report import html_report, markdown
from qtoolkit.signoff.verdict import SignoffReport

DETAIL = "kld 0.5 | limit 0.1 < judged & <b>not bold</b>"


def _report() -> dict:
    return {"config": {"model": "m<1>", "recipe": "r&d"}, "verdict": "FAIL", "policy": {"name": "p", "tasks": {}},
            "created": "now", "reasons": [f"code.kld_mean: {DETAIL}"],
            "gates": [{"name": "code.kld_mean", "passed": False, "point": 0.5, "judged": 0.6, "detail": DETAIL},
                      {"name": "code.pass_at_1", "passed": True, "point": 0.0, "judged": -0.1, "detail": "ok"}],
            "steps": {"quantize": {"status": "error", "seconds": 1.0, "error": "bad | worse\nthird line"}},
            "inputs": {}, "versions": {}, "machine": {}}


class _Cells(HTMLParser):
    """Rows of every table as lists of cell texts, and the tags seen."""

    def __init__(self):
        super().__init__()
        self.rows: list[list[str]] = []
        self.tags: list[str] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.rows[-1].append("".join(self._cell).strip())
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def test_markdown_escapes_pipes_in_cells():
    md = markdown(SignoffReport.from_json(_report()))
    row = next(line for line in md.splitlines() if line.startswith("| code.kld_mean"))
    assert row.count(" | ") == 5 and "\\|" in row  # six cells; the detail's pipe escaped


@pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian's chromium is not installed")
def test_gate_detail_with_pipe_lt_amp_renders_in_chromium(tmp_path):
    r = _report()
    page = tmp_path / "report.html"
    page.write_text(html_report(r["verdict"], markdown(SignoffReport.from_json(r)), {}))
    dom = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
                          "--disable-background-networking", f"--user-data-dir={tmp_path / 'profile'}",
                          page.as_uri()], check=True, timeout=120, capture_output=True, text=True).stdout
    cells = _Cells()
    cells.feed(dom)
    gate = next(row for row in cells.rows if row and row[0] == "code.kld_mean")
    assert gate == ["code.kld_mean", "FAIL", "0.5", "0.6", DETAIL, ""]  # one cell, text exactly as written
    step = next(row for row in cells.rows if row and row[0] == "quantize")
    assert step[-1] == "bad | worse third line"
    assert "b" not in cells.tags  # `<b>` in a detail or reason stays text
    assert "m&lt;1&gt;" in dom and "r&amp;d" in dom


def _bench_json() -> dict:
    def res(c: int, tps: float) -> dict:
        reqs = [RequestResult(i, True, prompt_tokens=10, output_tokens=8, ttft=0.05 * c, latency=0.05 * c + 0.4,
                              itl=[0.05] * 7) for i in range(4)]
        return summarize(reqs, duration=32 / tps).to_json()

    return {"tiers": [{"concurrency": c, "num_requests": 4,
                       "results": {"continuous": res(c, 40.0 * c), "static": res(c, 30.0 * c)}} for c in (1, 2, 4)]}


def _eval_json() -> dict:
    recs = {f"code/{i}": {"text_set": "code", "token_record": {"kld": [0.001 * (i + 1) * k for k in range(1, 50)]}}
            for i in range(3)}
    summary = {"code": {"mean_nll": {"candidate": 1.2, "baseline": 1.0, "delta": 0.2, "ci95": [0.1, 0.3]}}}
    return {"tasks": {"perplexity": {"records": recs, "summary": summary}}}


@pytest.mark.parametrize("make, names", [(_bench_json, ["output_tok_per_s", "ttft", "tpot"]),
                                         (_eval_json, ["kld", "quality"])])
def test_plot_command_draws_eval_and_bench_results(make, names, tmp_path, capsys):
    src = tmp_path / "result.json"
    src.write_text(json.dumps(make()))
    assert main(["plot", str(src), "-o", str(tmp_path / "plots"), "-q"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(tmp_path / "plots" / f"result.{n}.png") for n in names]
    for path in printed:
        img = Image.open(path).convert("RGB")
        colored = sum(1 for r, g, b in img.getdata() if max(r, g, b) - min(r, g, b) > 80)
        assert colored > 200, (path, colored)  # lines, markers or bars were drawn


@pytest.mark.parametrize("text, words", [("not json", "is not JSON"), ('{"x": 1}', "neither a qtool eval"),
                                         ('{"tiers": []}', "nothing to plot")])
def test_plot_refuses_what_it_cannot_draw(text, words, tmp_path, capsys):
    src = tmp_path / "x.json"
    src.write_text(text)
    assert main(["plot", str(src)]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err
