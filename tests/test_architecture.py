"""The layers, checked from the source: imports only go down, the planner stays pure, one vocabulary.

Reads every module of ``src/trainfit`` with :mod:`ast` (nothing is imported or run). The rules are the
ones ``docs/architecture.md`` states; a failure names the file, the import and the rule it breaks.
An import is any of three kinds: at module level, inside a function (lazy), or
``importlib.import_module("trainfit....")`` with a literal name (an f-string's literal head, such as
``f"trainfit.commands.{name}"``, stands for every module under it). All three go down and close no cycle.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

from trainfit.vocabulary import PrecisionName, StrategyName

SRC = Path(__file__).resolve().parents[1] / "src" / "trainfit"

# Layer of each module (longest matching prefix wins); a module imports only its own layer or lower ones.
LAYERS = {
    "trainfit.errors": 0, "trainfit.units": 0, "trainfit.vocabulary": 0, "trainfit.presets": 0, "trainfit.outputs": 0,
    "trainfit.progress": 0, "trainfit.gate": 0,
    "trainfit.results": 1, "trainfit.config": 1, "trainfit.checkpoint": 1, "trainfit.data": 1, "trainfit.tasks": 1,
    "trainfit.meters": 2,
    "trainfit.levers": 3, "trainfit.strategies": 3,
    "trainfit.engine": 4,
    "trainfit.run": 5, "trainfit.export": 5,
    "trainfit.train": 6, "trainfit.logs": 6,
    "trainfit.plan": 6,
    "trainfit.probes": 7,
    "trainfit.report": 8,
    "trainfit.front": 9, "trainfit.integrations": 9,
    "trainfit.commands": 10, "trainfit.cli": 10, "trainfit.__main__": 10, "trainfit": 10,
}
MAX_LAZY_IMPORTS = 7
"""Function-local imports allowed in all, each with its reason. 7 since issue 38 (point 4): ``commands/flags.py``
imports the front door's refusals when it makes a config, so that the parsers, which import it, print
``--help`` without numpy (the other way, ``config_from_args`` in a module of its own, moves a name that tests
and ``trainfit.cli`` import from ``flags``)."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[best]


class Imports(ast.NodeVisitor):
    """Module-level imports (run when the module loads, or read for annotations under ``TYPE_CHECKING``: those
    go down too), function-local ones and ``importlib.import_module`` calls, with line numbers; and the names
    each ``from X import name`` takes (for the private-name rule)."""

    def __init__(self) -> None:
        self.top: list[tuple[str, int]] = []
        self.local: list[tuple[str, int]] = []
        self.dynamic: list[tuple[str, int]] = []
        """``import_module`` targets: a module name, or a prefix ending in ``.`` (an f-string's literal head)."""
        self.names: list[tuple[str, str, int]] = []
        """``(module, name, line)`` of every ``from module import name``."""
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
            for a in node.names:  # ``from trainfit.plan import comm`` imports trainfit.plan.comm (kept if a module)
                self.names.append((node.module, a.name, node.lineno))
                self._add(f"{node.module}.{a.name}", node.lineno)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if called == "import_module" and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                self.dynamic.append((arg.value, node.lineno))
            elif isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
                self.dynamic.append((str(arg.values[0].value), node.lineno))  # a prefix: f"trainfit.commands.{x}"
        self.generic_visit(node)


TREES: dict[str, ast.Module] = {}
"""Each module's syntax tree, parsed once."""


def _modules() -> dict[str, tuple[Path, Imports, list[str]]]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        v = Imports()
        TREES[_module_name(path)] = tree = ast.parse(text)
        v.visit(tree)
        out[_module_name(path)] = (path, v, text.splitlines())
    return out


MODULES = _modules()


def _is_module(name: str) -> bool:
    return name in MODULES


def _trainfit(imports: list[tuple[str, int]]) -> list[tuple[str, int]]:
    return [(n, line) for n, line in imports if n.startswith("trainfit") and _is_module(n)]


def _resolved(dynamic: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """``import_module`` targets as modules: a full name as it is, a prefix as every module under it."""
    out = []
    for name, line in dynamic:
        if not name.startswith("trainfit"):
            continue
        if name.endswith("."):
            out += [(m, line) for m in MODULES if m.startswith(name)]
        elif _is_module(name):
            out.append((name, line))
    return out


def _all_imports(v: Imports) -> list[tuple[str, int]]:
    """Every trainfit module a module imports: at module level, lazily or through importlib."""
    return _trainfit(v.top) + _trainfit(v.local) + _resolved(v.dynamic)


def test_the_source_was_found():
    assert len(MODULES) > 60 and "trainfit.run" in MODULES and "trainfit.vocabulary" in MODULES


def test_imports_only_go_down():
    bad = []
    for mod, (path, v, _) in MODULES.items():
        if mod == "trainfit":
            continue  # the package face re-exports the public API
        for name, line in _all_imports(v):
            if _layer(name) > _layer(mod):
                bad.append(f"{path.relative_to(SRC.parent)}:{line} imports {name} (layer {_layer(name)} > "
                           f"{_layer(mod)})")
    assert not bad, "\n".join(bad)


def test_meters_know_nothing_of_a_run():
    forbidden = ("trainfit.engine", "trainfit.run", "trainfit.train", "trainfit.probes", "trainfit.plan")
    bad = [f"{mod} imports {name}" for mod, (_, v, _) in MODULES.items() if mod.startswith("trainfit.meters")
           for name, _ in v.top + v.local if name.startswith(forbidden)]
    assert not bad, bad


LEVER_RULES = ("trainfit.levers.offload_rules", "trainfit.levers.checkpointing_rules")
"""The torch-free halves of the levers: their rules, which the planner imports instead of restating them."""


def test_plan_is_pure():
    """plan/ reads facts from the vocabulary and the levers' torch-free rules: no torch.distributed, no run, engine,
    probe or torch shell. The lever rules it reads import only the foundation themselves (nor does the levers
    package, which importing them runs)."""
    allowed = ("trainfit.errors", "trainfit.units", "trainfit.vocabulary", "trainfit.presets", "trainfit.plan",
               "trainfit.gate", *LEVER_RULES)  # the gate: the standard library's bounded reader of documents
    bad = []
    for mod, (_, v, _) in MODULES.items():
        if mod == "trainfit.levers" or mod in LEVER_RULES:
            bad += [f"{mod}:{line} imports {name}" for name, line in v.top + v.local
                    if name.startswith("torch") or (name.startswith("trainfit") and not name.startswith(allowed[:4]))]
            continue
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
    """No cycle of any kind: a lazy or importlib import that closes a loop is a cycle too (it only hides it
    from the loader until the function runs)."""
    edges = {mod: {n for n, _ in _all_imports(v) if n != mod and not mod.startswith(n + ".")}
             for mod, (_, v, _) in MODULES.items()}
    cycles = _cycles(edges)
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_import_reader_sees_lazy_and_importlib_imports():
    """What the cycle and layer rules read: a function-local import and importlib's literal and f-string names."""
    v = Imports()
    v.visit(ast.parse("import importlib\nfrom trainfit import run\n"
                      "def f(name):\n    from trainfit.probes.calibrate import report_basis\n"
                      "    importlib.import_module('trainfit.engine')\n"
                      "    importlib.import_module(f'trainfit.commands.{name}')\n"))
    assert ("trainfit.run", 2) in _trainfit(v.top)
    assert _trainfit(v.local) == [("trainfit.probes.calibrate", 4)]
    resolved = {n for n, _ in _resolved(v.dynamic)}
    assert "trainfit.engine" in resolved and "trainfit.commands.plan" in resolved and "trainfit.cli" not in resolved
    assert ("trainfit.probes.calibrate", "report_basis", 4) in v.names
    TREES["<test>"] = ast.parse("import trainfit.probes.verify as verify\nverify._x\n")
    try:
        assert _module_attributes("<test>") == [("trainfit.probes.verify", "_x", 2)]
    finally:
        del TREES["<test>"]


def _package(mod: str) -> str:
    """The package a module belongs to: itself for a package or a module directly under ``trainfit/`` (each of
    those is a part of its own: run, engine, cli), else its parent."""
    path = MODULES[mod][0]
    return mod if path.name == "__init__.py" or path.parent == SRC else mod.rsplit(".", 1)[0]


def _module_attributes(mod: str) -> list[tuple[str, str, int]]:
    """``(module, name, line)`` for ``alias.name`` where ``alias`` is a trainfit module imported whole
    (``import trainfit.probes.verify as verify``, ``from trainfit.probes import verify``)."""
    aliases = {}
    for node in ast.walk(TREES[mod]):
        if isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names if a.asname and _is_module(a.name)})
        elif isinstance(node, ast.ImportFrom) and node.module:
            aliases.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names
                            if _is_module(f"{node.module}.{a.name}")})
    return [(aliases[n.value.id], n.attr, n.lineno) for n in ast.walk(TREES[mod])
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in aliases]


def _private_imports() -> list[tuple[str, str, str, int]]:
    """``(importer, module, name, line)`` for every underscore name taken from another package's module, by
    ``from module import _name`` or as ``module._name``."""
    out = []
    for mod, (_, v, _) in MODULES.items():
        for src, name, line in v.names + _module_attributes(mod):
            private = name.startswith("_") and not name.startswith("__")
            if private and _is_module(src) and _package(src) != _package(mod):
                out.append((mod, src, name, line))
    return out


def test_no_private_name_crosses_a_package():
    """A name with a leading underscore is its module's own: siblings in one package may share it (the
    precision policies share ``_Base``), another package imports only public names."""
    bad = [f"{mod}:{line} imports {name} from {src}" for mod, src, name, line in _private_imports()]
    assert not bad, "\n".join(bad)


def test_private_name_rule_tells_siblings_from_other_packages():
    assert _package("trainfit.levers.precision.fp32") == _package("trainfit.levers.precision.base")
    assert _package("trainfit.levers.precision") == "trainfit.levers.precision"
    assert _package("trainfit.engine") != _package("trainfit.run")
    assert _package("trainfit.integrations.frameworks") != _package("trainfit.probes.verify")


def test_few_lazy_imports_each_with_its_reason():
    # one entry per import statement (``from trainfit.tasks import hf`` names the package and the module)
    lazy = {(mod, line): (name, lines) for mod, (_, v, lines) in MODULES.items() for name, line in _trainfit(v.local)}
    listing = "\n".join(f"{mod}:{line} {name}" for (mod, line), (name, _) in lazy.items())
    assert len(lazy) <= MAX_LAZY_IMPORTS, listing
    for (mod, line), (name, lines) in lazy.items():
        here, above = lines[line - 1], lines[line - 2]
        assert "#" in here or above.strip().startswith("#"), f"{mod}:{line} lazy import of {name} says not why"


@functools.cache
def _strings(mod: str) -> frozenset[str]:
    """Every string constant in a module (walked once for all the names below)."""
    return frozenset(n.value for n in ast.walk(TREES[mod]) if isinstance(n, ast.Constant) and isinstance(n.value, str))


@pytest.mark.parametrize("name", [*PrecisionName, *StrategyName], ids=str)
def test_a_lever_name_is_spelled_in_few_files(name):
    """The quoted name appears as a string constant in at most 3 files; everything else reads the vocabulary."""
    files = [str(path.relative_to(SRC)) for mod, (path, _, _) in MODULES.items() if str(name) in _strings(mod)]
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
               "trainfit.report", "trainfit.gate")
    bad = [f"{mod}:{line} imports {name}" for mod, (_, v, _) in MODULES.items() if mod.startswith("trainfit.report")
           for name, line in v.top + v.local
           if name.startswith("torch") or (name.startswith("trainfit") and not name.startswith(allowed))]
    assert not bad, bad


# ---- one home per lever: code reads a strategy's or precision's row, it does not ask which one it is ----------
LEVER_HOMES = ("strategies/", "levers/", "vocabulary.py")
"""Where a strategy's or precision's identity may be tested: its implementation, the levers, its row."""
IDENTITY_ALLOWED: set[tuple[str, str]] = set()
"""Identity branches allowed outside the lever homes, each with its reason: none left."""


def _names_a_lever(node: ast.AST, aliases: set[str]) -> bool:
    """``StrategyName.X`` / ``PrecisionName.X``, their string values, a tuple/list/set holding one, or a module-level
    name bound to such a collection (``_FSDP = (StrategyName.ZERO2, StrategyName.ZERO3)``)."""
    values = {str(v) for v in [*StrategyName, *PrecisionName]}
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return node.value.id in ("StrategyName", "PrecisionName")
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value in values
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_lever(e, aliases) for e in node.elts)
    return isinstance(node, ast.Name) and node.id in aliases


def identity_branches(root: Path = SRC) -> list[tuple[str, int, str]]:
    """Comparisons and membership tests against a strategy's or precision's identity outside :data:`LEVER_HOMES`:
    (file, line, the comparison's source)."""
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(LEVER_HOMES):
            continue
        tree = ast.parse(path.read_text())
        aliases = {t.id for n in tree.body if isinstance(n, ast.Assign)
                   and isinstance(n.value, (ast.Tuple, ast.List, ast.Set)) and _names_a_lever(n.value, set())
                   for t in n.targets if isinstance(t, ast.Name)}
        out += [(rel, n.lineno, ast.unparse(n)) for n in ast.walk(tree) if isinstance(n, ast.Compare)
                and any(_names_a_lever(x, aliases) for x in [n.left, *n.comparators])]
    return out


def test_no_identity_branches_outside_lever_homes():
    """Strategy- and precision-dependent behaviour reads the row (shards, fsdp, offload_parts, the tools' names);
    16 such branches were found before this rule (plan/offload.py 5, plan/rules.py 1, integrations/export_plan.py 7,
    integrations/frameworks.py 1, commands/plan.py 2)."""
    found = identity_branches()
    left = [f"{f}:{line}: {src}" for f, line, src in found if (f, src) not in IDENTITY_ALLOWED]
    assert not left, "branch on a strategy's/precision's identity; read its row instead:\n" + "\n".join(left)


def test_identity_branch_finder_finds_each_kind(tmp_path):
    (tmp_path / "a.py").write_text(
        "_FSDP = (StrategyName.ZERO2, StrategyName.ZERO3)\n"
        "def f(s, p, c):\n"
        "    return s == StrategyName.ZERO1, s in _FSDP, p != 'fp32', c.strategy in ('ddp', 'x'), s == 'other'\n")
    (tmp_path / "vocabulary.py").write_text("x = s == StrategyName.ZERO1\n")
    assert [src for _, _, src in identity_branches(tmp_path)] == [
        "s == StrategyName.ZERO1", "s in _FSDP", "p != 'fp32'", "c.strategy in ('ddp', 'x')"]


# ---- a function takes the config sections it reads, not the whole RunConfig (issue #29) ----------------------
WHOLE_CONFIG_ALLOWED: dict[str, str] = {}
"""``file:function`` allowed to take a whole RunConfig while reading one or two of its sections, each with why."""


def _names_run_config(annotation: ast.AST | None) -> bool:
    """``RunConfig``, ``config.RunConfig``, ``"RunConfig"`` or a union holding one (``RunConfig | None``)."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return False
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        return _names_run_config(annotation.left) or _names_run_config(annotation.right)
    return (isinstance(annotation, ast.Name) and annotation.id == "RunConfig") or (
        isinstance(annotation, ast.Attribute) and annotation.attr == "RunConfig")


def _params(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> list[ast.arg]:
    a = node.args
    return [*a.posonlyargs, *a.args, *a.kwonlyargs, *(x for x in (a.vararg, a.kwarg) if x is not None)]


class _ConfigUses(ast.NodeVisitor):
    """The RunConfig fields read as ``name.field`` in a function's body, and whether ``name`` is used whole:
    passed on, compared, rebound, or any other attribute (``cfg.to_dict()``, ``cfg.section(...)``)."""

    def __init__(self, name: str, fields: frozenset[str]) -> None:
        self.name, self.known = name, fields
        self.fields: set[str] = set()
        self.whole = False

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.value, ast.Name) and node.value.id == self.name:
            if node.attr in self.known and isinstance(node.ctx, ast.Load):
                self.fields.add(node.attr)
            else:
                self.whole = True
            return
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if node.id == self.name:
            self.whole = True

    def _scope(self, node) -> None:
        """A nested function or lambda: its own parameter of the same name hides this one (defaults do not)."""
        if self.name in {p.arg for p in _params(node)}:
            for default in [*node.args.defaults, *node.args.kw_defaults]:
                if default is not None:
                    self.visit(default)
            return
        self.generic_visit(node)

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _scope


def whole_config_takers(root: Path = SRC) -> list[tuple[str, str, tuple[str, ...]]]:
    """Functions with a RunConfig parameter that read fields of only one or two sections through it and never
    use it whole: (file, qualified function name, the sections read)."""
    from trainfit.config import FIELDS, SECTION_OF, SECTIONS

    known = frozenset(FIELDS)
    out = []

    def walk(node: ast.AST, rel: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                for p in _params(child):
                    if not _names_run_config(p.annotation):
                        continue
                    uses = _ConfigUses(p.arg, known)
                    for stmt in child.body:
                        uses.visit(stmt)
                    sections = {SECTION_OF[f] for f in uses.fields}
                    if not uses.whole and 1 <= len(sections) <= 2:
                        out.append((rel, name, tuple(s for s in SECTIONS if s in sections)))
                walk(child, rel, name + ".")
            elif isinstance(child, ast.ClassDef):
                walk(child, rel, prefix + child.name + ".")
            else:
                walk(child, rel, prefix)

    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        walk(ast.parse(path.read_text()), rel, "")
    return out


def test_a_function_takes_the_config_sections_it_reads():
    """A function that reads one or two sections of a RunConfig and never hands the config on takes those
    sections (``cfg.section("levers")``, :data:`trainfit.config.SECTIONS`), not the whole 48-field config."""
    found = whole_config_takers()
    left = [f"{f}:{name} reads only [{', '.join(secs)}]" for f, name, secs in found
            if f"{f}:{name}" not in WHOLE_CONFIG_ALLOWED]
    assert not left, "take the section(s), not the whole config:\n" + "\n".join(left)


def test_whole_config_finder_tells_a_section_reader_from_a_whole_config_user(tmp_path):
    (tmp_path / "a.py").write_text(
        "def one(cfg: RunConfig, n: int):\n    return cfg.precision, cfg.accumulation\n"
        "def two(c: 'RunConfig'):\n    return c.strategy if c.lr else c.devices\n"
        "def three(cfg: RunConfig | None):\n    return cfg.precision, cfg.lr, cfg.seed\n"
        "def passed_on(cfg: config.RunConfig):\n    return cfg.precision, g(cfg)\n"
        "def method(cfg: RunConfig):\n    return cfg.steps, cfg.to_dict()\n"
        "def none(cfg: RunConfig, other):\n    return other.lr\n"
        "def plain(cfg):\n    return cfg.lr\n"
        "class K:\n    def m(self, cfg: RunConfig):\n        def inner(cfg):\n            return cfg\n"
        "        return cfg.seed, (lambda: cfg.memory_cap)()\n"
        "def outer(cfg: RunConfig):\n    def inner(c: RunConfig):\n        return c.lr, cfg.strategy\n"
        "    return inner\n")
    assert whole_config_takers(tmp_path) == [
        ("a.py", "one", ("levers",)), ("a.py", "two", ("distribution", "schedule")), ("a.py", "K.m", ("run",)),
        ("a.py", "outer", ("distribution",)), ("a.py", "outer.inner", ("schedule",))]
