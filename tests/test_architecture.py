"""The layers, checked from the source: imports only go down, the planner stays pure, one vocabulary.

Reads every module of ``src/trainfit`` with :mod:`ast` (nothing is imported or run). The rules are the
ones ``docs/architecture.md`` states; a failure names the file, the import and the rule it breaks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from trainfit.vocabulary import PrecisionName, StrategyName

SRC = Path(__file__).resolve().parents[1] / "src" / "trainfit"

# Layer of each module (longest matching prefix wins); a module imports only its own layer or lower ones.
LAYERS = {
    "trainfit.errors": 0, "trainfit.units": 0, "trainfit.vocabulary": 0, "trainfit.presets": 0, "trainfit.outputs": 0,
    "trainfit.results": 1, "trainfit.config": 1, "trainfit.checkpoint": 1, "trainfit.data": 1, "trainfit.tasks": 1,
    "trainfit.meters": 2,
    "trainfit.levers": 3, "trainfit.strategies": 3,
    "trainfit.engine": 4,
    "trainfit.run": 5, "trainfit.export": 5,
    "trainfit.train": 6, "trainfit.logs": 6,
    "trainfit.plan": 6,
    "trainfit.probes": 7,
    "trainfit.report": 8,
    "trainfit.commands": 9, "trainfit.cli": 9, "trainfit.__main__": 9, "trainfit": 9,
    "trainfit.integrations": 9,
}
MAX_LAZY_IMPORTS = 6


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[best]


class Imports(ast.NodeVisitor):
    """Module-level imports (run when the module loads, or read for annotations under ``TYPE_CHECKING``: those
    go down too) and function-local ones, with line numbers."""

    def __init__(self) -> None:
        self.top: list[tuple[str, int]] = []
        self.local: list[tuple[str, int]] = []
        self._depth = 0

    def _func(self, node) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = _func

    def _add(self, name: str, line: int) -> None:
        (self.local if self._depth else self.top).append((name, line))

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            self._add(a.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module:
            self._add(node.module, node.lineno)
            if node.module == "trainfit" or node.module.endswith(".plan") or node.module.endswith(".probes"):
                for a in node.names:  # ``from trainfit.plan import comm`` imports trainfit.plan.comm
                    self._add(f"{node.module}.{a.name}", node.lineno)


def _modules() -> dict[str, tuple[Path, Imports, list[str]]]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        v = Imports()
        v.visit(ast.parse(text))
        out[_module_name(path)] = (path, v, text.splitlines())
    return out


MODULES = _modules()


def _is_module(name: str) -> bool:
    return name in MODULES


def _trainfit(imports: list[tuple[str, int]]) -> list[tuple[str, int]]:
    return [(n, line) for n, line in imports if n.startswith("trainfit") and _is_module(n)]


def test_the_source_was_found():
    assert len(MODULES) > 60 and "trainfit.run" in MODULES and "trainfit.vocabulary" in MODULES


def test_imports_only_go_down():
    bad = []
    for mod, (path, v, _) in MODULES.items():
        if mod == "trainfit":
            continue  # the package face re-exports the public API
        for name, line in _trainfit(v.top):
            if _layer(name) > _layer(mod):
                bad.append(f"{path.relative_to(SRC.parent)}:{line} imports {name} (layer {_layer(name)} > "
                           f"{_layer(mod)})")
    assert not bad, "\n".join(bad)


def test_meters_know_nothing_of_a_run():
    forbidden = ("trainfit.engine", "trainfit.run", "trainfit.train", "trainfit.probes", "trainfit.plan")
    bad = [f"{mod} imports {name}" for mod, (_, v, _) in MODULES.items() if mod.startswith("trainfit.meters")
           for name, _ in v.top + v.local if name.startswith(forbidden)]
    assert not bad, bad


def test_plan_is_pure():
    """plan/ reads facts from the vocabulary: no torch.distributed, no run, engine, probe or torch shell."""
    allowed = ("trainfit.errors", "trainfit.units", "trainfit.vocabulary", "trainfit.presets", "trainfit.plan")
    bad = []
    for mod, (_, v, _) in MODULES.items():
        if not mod.startswith("trainfit.plan"):
            continue
        for name, line in v.top + v.local:
            if name.startswith("torch") or (name.startswith("trainfit") and not name.startswith(allowed)):
                bad.append(f"{mod}:{line} imports {name}")
    assert not bad, bad


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    edges = {mod: {n for n, _ in _trainfit(v.top) if n != mod and not mod.startswith(n + ".")}
             for mod, (_, v, _) in MODULES.items()}
    assert _cycles(edges) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_few_lazy_imports_each_with_its_reason():
    lazy = [(mod, name, line, lines) for mod, (_, v, lines) in MODULES.items() for name, line in _trainfit(v.local)]
    listing = "\n".join(f"{mod}:{line} {name}" for mod, name, line, _ in lazy)
    assert len(lazy) <= MAX_LAZY_IMPORTS, listing
    for mod, name, line, lines in lazy:
        here, above = lines[line - 1], lines[line - 2]
        assert "#" in here or above.strip().startswith("#"), f"{mod}:{line} lazy import of {name} says not why"


@pytest.mark.parametrize("name", [*PrecisionName, *StrategyName], ids=str)
def test_a_lever_name_is_spelled_in_few_files(name):
    """The quoted name appears as a string constant in at most 3 files; everything else reads the vocabulary."""
    files = []
    for mod, (path, _, _) in MODULES.items():
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.Constant) and n.value == str(name) for n in ast.walk(tree)):
            files.append(str(path.relative_to(SRC)))
    assert len(files) <= 3, files


def test_the_first_hour_needs_only_core_dependencies():
    """After ``pip install -e .`` alone, ``--report`` and ``trainfit report`` draw their charts (matplotlib)."""
    import tomllib

    project = tomllib.loads((SRC.parents[1] / "pyproject.toml").read_text())["project"]
    core = {d.split(">")[0].split("=")[0].split("[")[0].strip().lower() for d in project["dependencies"]}
    plotting = {name.split(".")[0] for name, _ in MODULES["trainfit.report.plots"][1].top
                + MODULES["trainfit.report.plots"][1].local}
    assert "matplotlib" in plotting and "matplotlib" in core


def test_report_imports_nothing_that_runs_a_step():
    """report/ reads typed results and draws: only the foundation's data modules, never torch."""
    allowed = ("trainfit.errors", "trainfit.units", "trainfit.vocabulary", "trainfit.presets", "trainfit.results",
               "trainfit.report")
    bad = [f"{mod}:{line} imports {name}" for mod, (_, v, _) in MODULES.items() if mod.startswith("trainfit.report")
           for name, line in v.top + v.local
           if name.startswith("torch") or (name.startswith("trainfit") and not name.startswith(allowed))]
    assert not bad, bad
