"""The package's shape, checked from its source: no import cycle, short functions, imports at the top, and no
comment or string that points outside the repository."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# folder -> the package it installs as (setup.py's ROOTS)
PACKAGES = {"qtoolkit": "qtoolkit", "evals": "qtoolkit.evals", "kernels": "qtoolkit.kernels"}
MAX_FUNCTION_LINES = 80
# the top level of qtoolkit/ is the foundation every room stands on, and the CLI; everything else lives in a room
FOUNDATION = {"__init__", "__main__", "cli", "errors", "io", "launch", "progress", "provenance", "yaml_safe"}
# split by another change in flight; removed when that change lands
LONG_FUNCTIONS_ALLOWED: set[str] = set()
# Imports inside functions are allowed where start-up time demands them (`qtool --help` builds every command's
# parser, so commands import their work when they run) or the imported package is optional.
LAZY_IMPORT_FILES = {"qtoolkit/cli.py"}
LAZY_IMPORT_DIRS = ("qtoolkit/commands/",)
OPTIONAL_PACKAGES = {"triton", "llama_cpp", "bitsandbytes", "lm_eval", "vllm", "sglang"}
# every other import inside a function is counted; this number only goes down
MAX_OTHER_LAZY_IMPORTS = 37


def _files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the three packages."""
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


MODULES = _files()


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module, type_checking: bool = False):
    """(import node, inside a function?) for every import; TYPE_CHECKING blocks only when `type_checking`."""
    def walk(body, in_function):
        for node in body:
            if isinstance(node, ast.If) and _is_type_checking(node) and not type_checking:
                yield from walk(node.orelse, in_function)
                continue
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield node, in_function
            inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            for field in ("body", "orelse", "finalbody", "handlers"):
                sub = getattr(node, field, None)
                if isinstance(sub, list):
                    yield from walk(sub, inner)
    yield from walk(tree.body, False)


def _targets(module: str, path: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The dotted names an import reaches (absolute), before mapping them to our modules."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        package = package[:len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    return [base] + [f"{base}.{a.name}" for a in node.names]


def _ours(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        # TYPE_CHECKING imports count: a cycle closed only for the type checker is still a cycle in the design
        for node, in_function in _imports(ast.parse(path.read_text()), type_checking=True):
            if in_function:
                continue
            for name in _targets(module, path, node):
                target = _ours(name)
                # a package's own __init__ is reached by importing any of its modules: not an edge
                if target and target != module and not module.startswith(target + "."):
                    graph[module].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    assert _cycles(_graph()) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_function_over_80_lines():
    long = set()
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                    long.add(f"{_rel(path)}:{node.name}")
    assert long - LONG_FUNCTIONS_ALLOWED == set()


OUTSIDE = re.compile(r"MEASUREMENTS\.md|\.\./shared\b|(?<![\w.])/work/")


def test_nothing_cites_a_file_outside_the_repository():
    hits = []
    for path in [*MODULES.values(), ROOT / "ARCHITECTURE.md", *sorted((ROOT / "recipes").rglob("*.yaml"))]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{_rel(path)}:{n}: {line.strip()}")
    assert hits == []


def _needs_optional(module: str, path: Path) -> bool:
    """Whether a module imports an optional package when it is imported (kernels/int4_matmul.py: triton)."""
    return any(t.split(".")[0] in OPTIONAL_PACKAGES for node, in_function in _imports(ast.parse(path.read_text()))
               if not in_function for t in _targets(module, path, node))


def _optional(module: str, path: Path, node: ast.Import | ast.ImportFrom) -> bool:
    for name in _targets(module, path, node):
        ours = _ours(name)
        if name.split(".")[0] in OPTIONAL_PACKAGES or (ours and _needs_optional(ours, MODULES[ours])):
            return True
    return False


def _lazy_imports() -> list[str]:
    out = []
    for module, path in MODULES.items():
        rel = _rel(path)
        if rel in LAZY_IMPORT_FILES or rel.startswith(LAZY_IMPORT_DIRS):
            continue
        for node, in_function in _imports(ast.parse(path.read_text())):
            if in_function and not _optional(module, path, node):
                out.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_imports_inside_functions_are_capped():
    lazy = _lazy_imports()
    assert len(lazy) <= MAX_OTHER_LAZY_IMPORTS, "\n".join(lazy)


def test_architecture_lists_every_module_and_only_those():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    modules = {_rel(p) for p in MODULES.values() if p.name not in ("__init__.py", "__main__.py")}
    listed = set(re.findall(r"`((?:qtoolkit|evals|kernels)/[\w/]+\.py)`", text))
    assert sorted(modules - listed) == [] and sorted(p for p in listed if not (ROOT / p).is_file()) == []


def test_top_level_holds_only_the_foundation():
    top = {p.stem for p in (ROOT / "qtoolkit").glob("*.py")}
    assert sorted(top - FOUNDATION) == []


def test_every_room_says_what_it_is_for():
    """Each subpackage's __init__ opens with a docstring naming its responsibility."""
    missing = [_rel(p) for p in MODULES.values() if p.name == "__init__.py" and p.parent != ROOT / "qtoolkit"
               and not ast.get_docstring(ast.parse(p.read_text()))]
    assert missing == []


def test_measurements_hold_evidence_not_code():
    """measurements/ holds results (JSON, MD, plots) and the commands behind them, no Python reaching into the
    package: a check that asserts an outcome is a test, a re-runnable benchmark is a `qtool` command."""
    assert sorted(_rel(p) for p in (ROOT / "measurements").rglob("*.py")) == []


# ---- the evidence's types: signoff/ and bench/ hand each other objects, not dicts read by key path ----------
TYPED_ROOMS = ("qtoolkit/signoff/", "qtoolkit/bench/")
# `dict[str, Any]` in the signatures (parameters and returns) of signoff/ and bench/ outside the JSON
# (de)serialisers (to_json / from_json); this number only goes down (144 counting the serialisers at the start, 103
# before a bench tier became a TierSummary, a step's outcome a StepOutcome and sequential.json a SequentialRecord)
MAX_DICT_ANY_IN_SIGNATURES = 60


def _our_modules_bound(module: str, path: Path, tree: ast.Module) -> set[str]:
    """Names a module binds to one of our modules (`from . import verdicts`, `import qtoolkit.io`)."""
    bound = set()
    for node, _ in _imports(tree, type_checking=True):
        if isinstance(node, ast.Import):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names if _ours(a.name)}
            continue
        base = _targets(module, path, node)[0]
        bound |= {a.asname or a.name for a in node.names if f"{base}.{a.name}" in MODULES}
    return bound


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_uses() -> list[str]:
    """`from .x import _name` and `x._name` where x is another of our modules: its private names are its own."""
    out = []
    for module, path in MODULES.items():
        if not _rel(path).startswith("qtoolkit/"):
            continue
        tree = ast.parse(path.read_text())
        bound = _our_modules_bound(module, path, tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and _ours(_targets(module, path, node)[0]):
                out += [f"{_rel(path)}:{node.lineno}: {a.name}" for a in node.names if _private(a.name)]
            elif (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                  and node.value.id in bound):
                out.append(f"{_rel(path)}:{node.lineno}: {node.value.id}.{node.attr}")
    return out


def test_no_module_uses_another_modules_private_names():
    assert _private_uses() == []


def _get_or_empty(node: ast.AST) -> bool:
    """`x.get(...) or {}`."""
    return (isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or) and isinstance(node.values[-1], ast.Dict)
            and not node.values[-1].keys and any(isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute)
                                                 and v.func.attr == "get" for v in node.values[:-1]))


def _chained_gets() -> list[str]:
    """`(x.get(a) or {}).get(b)` and `(x.get(a) or {})[b]`: a dict read by key path, its absences papered over."""
    out = []
    for path in MODULES.values():
        if not _rel(path).startswith("qtoolkit/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr == "get" or isinstance(node, ast.Subscript)) \
                    and _get_or_empty(node.value):
                out.append(f"{_rel(path)}:{node.lineno}: {ast.unparse(node)[:80]}")
    return out


def test_no_chained_get_or_empty():
    assert _chained_gets() == []


def _serialiser(name: str) -> bool:
    """A JSON (de)serialiser: the one place a dict of the file's shape is the right type."""
    return name in ("to_json", "from_json") or name.endswith(("_to_json", "_from_json"))


def _dict_any_in_signatures() -> list[str]:
    out = []
    for path in MODULES.values():
        if not _rel(path).startswith(TYPED_ROOMS):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _serialiser(node.name):
                a = node.args
                for ann in [x.annotation for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]] + [node.returns]:
                    if ann is not None:
                        out += [f"{_rel(path)}:{node.lineno}: {node.name}"] * ast.unparse(ann).count("dict[str, Any]")
    return out


def test_dict_any_in_signoff_and_bench_signatures_is_capped():
    found = _dict_any_in_signatures()
    assert len(found) <= MAX_DICT_ANY_IN_SIGNATURES, "\n".join(found)


# functions that turn JSON into objects and back: the only places a dict may be read by key path
SERIALISERS = ("to_json", "from_json")
# dict key-path reads (`x["a"]["b"]`, `x.get("a")["b"]`) in signoff/ and bench/ outside the serialisers: none (a
# bench tier's figures are a TierSummary, a step's outcome a StepOutcome, a custom item's answer an AnswerSide)
MAX_KEY_PATH_READS = 0


def _key_path(node: ast.AST) -> bool:
    def str_key(n: ast.AST) -> bool:
        return isinstance(n, ast.Constant) and isinstance(n.value, str)

    if not (isinstance(node, ast.Subscript) and str_key(node.slice)):
        return False
    v = node.value
    return (isinstance(v, ast.Subscript) and str_key(v.slice)) or (
        isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr == "get")


def _key_path_reads(tree: ast.AST, where: str) -> list[str]:
    out = []

    def walk(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if _key_path(child) and function not in SERIALISERS:
                out.append(f"{where}:{child.lineno}: {function}: {ast.unparse(child)[:80]}")
            walk(child, name)

    walk(tree, "")
    return out


def test_key_path_reads_in_signoff_and_bench_are_capped():
    found = [hit for path in MODULES.values() if _rel(path).startswith(TYPED_ROOMS)
             for hit in _key_path_reads(ast.parse(path.read_text()), _rel(path))]
    assert len(found) <= MAX_KEY_PATH_READS, "\n".join(found)


def _renamed_module_imports() -> list[str]:
    """`from . import x as y` in signoff/ and bench/ where x is one of our modules: a module read under another
    name than its file's hides what it holds (gates.py was imported `as verdicts`: it is verdicts.py now)."""
    out = []
    for module, path in MODULES.items():
        if not _rel(path).startswith(TYPED_ROOMS):
            continue
        for node, _ in _imports(ast.parse(path.read_text()), type_checking=True):
            if isinstance(node, ast.ImportFrom):
                base = _targets(module, path, node)[0]
                out += [f"{_rel(path)}:{node.lineno}: {a.name} as {a.asname}" for a in node.names
                        if a.asname and a.asname != a.name and f"{base}.{a.name}" in MODULES]
    return out


# none: signoff/workload.py is imported as `workload` (it was `as custom_signoff` in run.py, deployment.py, sweep.py)
MAX_RENAMED_MODULE_IMPORTS = 0


def test_signoff_and_bench_modules_are_imported_under_their_own_names():
    found = _renamed_module_imports()
    assert not any(" verdicts as " in f or " as verdicts" in f for f in found)
    assert len(found) <= MAX_RENAMED_MODULE_IMPORTS, "\n".join(found)


# ---- the sign-off's mode is its configuration's type (signoff/config.py), never read off which fields are set -----
MODE_FILES = ("qtoolkit/signoff/", "qtoolkit/commands/signoff.py")
MODE_FIELDS = {"candidate_endpoint", "baseline_endpoint"}
CONFIG_NAME = re.compile(r"(^|[._])(cfg|config)$")


def _tested_expressions(tree: ast.AST) -> list[ast.AST]:
    """Every expression a branch turns on: if/while/assert/ternary tests, comprehension and match guards, and
    the operands of `and`, `or`, `not`."""
    out: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)):
            out.append(node.test)
        elif isinstance(node, ast.comprehension):
            out += node.ifs
        elif isinstance(node, ast.match_case) and node.guard is not None:
            out.append(node.guard)
        elif isinstance(node, ast.BoolOp):
            out += node.values
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            out.append(node.operand)
    return out


def _mode_by_field(tree: ast.AST, where: str) -> list[str]:
    """`if cfg.candidate_endpoint or cfg.baseline_endpoint:`, `hasattr(cfg, "baseline_endpoint")`: a mode picked
    by testing a configuration's fields (the CLI's `args.*` flags are what it builds the type from: not counted)."""
    hits = set()
    for test in _tested_expressions(tree):
        for node in ast.walk(test):
            field = None
            if isinstance(node, ast.Attribute) and node.attr in MODE_FIELDS:
                field = node.attr if CONFIG_NAME.search(ast.unparse(node.value)) else None
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                  and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in MODE_FIELDS):
                field = node.args[1].value
            if field:
                hits.add(f"{where}:{node.lineno}: {field}")
    return sorted(hits)


def test_no_sign_off_picks_its_mode_by_testing_a_configs_fields():
    found = [hit for path in MODULES.values() if _rel(path).startswith(MODE_FILES)
             for hit in _mode_by_field(ast.parse(path.read_text()), _rel(path))]
    assert found == []


def test_the_guards_find_what_they_guard():
    """Each guard on a snippet that breaks it (so a guard cannot pass by finding nothing)."""
    tree = ast.parse("(a.get('x') or {}).get('y')\n(a.get('x') or {})['y']\nb.get('x') or {}\n")
    hits = [n for n in ast.walk(tree) if (isinstance(n, ast.Attribute) and n.attr == "get"
                                         or isinstance(n, ast.Subscript)) and _get_or_empty(n.value)]
    assert len(hits) == 2
    assert _private("_load") and not _private("__all__") and not _private("load")
    snippet = "def f(x):\n    return x['a']['b'], x.get('a')['b'], x['a'], x[0]['b']\n" \
              "def to_json(x):\n    return x['a']['b']\n"
    assert len(_key_path_reads(ast.parse(snippet), "snippet")) == 2
    snippet = ("if cfg.candidate_endpoint or cfg.baseline_endpoint:\n    pass\n"
               "x = c.cfg.candidate_endpoint if hasattr(cfg, 'baseline_endpoint') else None\n"
               "url = cfg.candidate_endpoint\nif args.candidate_endpoint:\n    pass\n")
    assert len(_mode_by_field(ast.parse(snippet), "snippet")) == 3
