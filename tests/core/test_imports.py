"""The package's import structure: the layers (nothing imports upward), no import cycle, the core apart from
the apps.

The import graph is read from the source with :mod:`ast` (nothing is executed): every
``import gpubuf.x``, ``from gpubuf.x import y`` and ``from gpubuf import x`` (and relative forms), at module
level and inside functions, except under ``if TYPE_CHECKING:``. ``from p import m`` counts as an import of
the submodule ``p.m`` when there is one, else of ``p``. A module's own parent packages, which Python
initialises first, are not counted as its imports (else every module ``gpubuf/__init__.py`` imports would
form a cycle with it).
"""

import ast
import importlib.util
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import gpubuf

# Modules that ``import gpubuf`` must not load: they load when used (gpubuf/__init__.py's __getattr__).
APPS = ("gpubuf.apps", "gpubuf.sources", "gpubuf.planning", "gpubuf.replay.sharded")
# The layers, lowest first: a module imports modules of its own package and of lower layers only (packages
# in one layer are independent of each other). The root package, the facade, re-exports from every layer.
LAYERS = (("gpubuf.kernels",), ("gpubuf._core", "gpubuf._deprecated"), ("gpubuf.ops",),
          ("gpubuf.replay", "gpubuf.history"),
          ("gpubuf.sources", "gpubuf.planning", "gpubuf.torchrl"), ("gpubuf.apps",))
# Third-party packages of the apps and the extras, which neither ``import gpubuf`` nor a core module may
# load.
OPTIONAL = ("envpool", "gymnasium", "matplotlib", "tqdm", "tensordict", "scipy", "torchrl", "numba")
# The done-when check, verbatim.
DONE_WHEN = ("import gpubuf, sys; print([m for m in sys.modules if m.split('.')[0] in ('matplotlib', 'tqdm', "
             "'envpool') or m == 'gpubuf.replay.sharded'])")
LAZY_NAMES = ("EnvPoolSource", "ShardedBuffer", "Planner", "CEMSolver", "PlanConfig", "Step", "StepStager")


def is_app(module: str) -> bool:
    return any(module == app or module.startswith(app + ".") for app in APPS)


def package_modules() -> dict[str, Path]:
    """Every module of the gpubuf package (gpubuf.kernels, which lives in kernels/, included) -> its file."""
    roots = [("gpubuf.", gpubuf.__path__)]
    kernels = importlib.util.find_spec("gpubuf.kernels")  # finds it without running it (no triton import)
    if kernels is not None:
        roots.append(("gpubuf.kernels.", kernels.submodule_search_locations))
    modules = {"gpubuf": Path(gpubuf.__file__)}
    if kernels is not None:
        modules["gpubuf.kernels"] = Path(kernels.origin)
    for prefix, path in roots:
        for info in pkgutil.walk_packages(list(path), prefix):
            leaf = info.name.rsplit(".", 1)[1]
            base = Path(info.module_finder.path) / leaf
            modules[info.name] = base / "__init__.py" if info.ispkg else base.with_suffix(".py")
    return modules


class Imports(ast.NodeVisitor):
    """The gpubuf modules one module imports: (target, line, module level or in a function)."""

    def __init__(self, name: str, is_package: bool, known: set[str]):
        self.package = name if is_package else name.rpartition(".")[0]
        self.known = known
        self.depth = 0
        self.found: list[tuple[str, int, bool]] = []

    def add(self, target: str, line: int) -> None:
        if target == "gpubuf" or target.startswith("gpubuf."):
            while target not in self.known and "." in target:  # an attribute path: its module
                target = target.rpartition(".")[0]
            self.found.append((target, line, self.depth == 0))

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            for child in node.orelse:  # only what runs
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_FunctionDef(self, node) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_Lambda = visit_FunctionDef

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.package.split(".")
            base = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
        else:
            base = node.module
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            self.add(sub if sub in self.known else base, node.lineno)


def import_graph() -> dict[str, dict[str, list[tuple[int, bool]]]]:
    """module -> {imported gpubuf module -> [(line, module level?)]} for every module of the package."""
    modules = package_modules()
    known = set(modules)
    graph = {}
    for name, path in modules.items():
        visitor = Imports(name, path.name == "__init__.py", known)
        visitor.visit(ast.parse(path.read_text(), str(path)))
        edges = {}
        for target, line, top in visitor.found:
            if target == name or name.startswith(target + "."):
                continue  # itself, or its parents (they run first anyway)
            where = edges.setdefault(target, [])
            if (line, top) not in where:  # one entry per import line, however many names it takes
                where.append((line, top))
        graph[name] = edges
    return graph


def simple_cycles(graph) -> list[tuple[str, ...]]:
    """Every elementary cycle, each rotated to start at its smallest module name."""
    order = sorted(graph)
    cycles = []

    def walk(start, node, path, allowed):
        for nxt in sorted(graph[node]):
            if nxt == start:
                cycles.append(tuple(path))
            elif nxt in allowed and nxt not in path:
                walk(start, nxt, path + [nxt], allowed)

    for i, start in enumerate(order):
        walk(start, start, [start], set(order[i + 1:]))
    return cycles


def describe(cycle, graph) -> str:
    """``a -> b (line 3, in a function) -> a (line 14)``."""
    steps = []
    for a, b in zip(cycle, cycle[1:] + cycle[:1], strict=True):
        where = ", ".join(f"line {line}{'' if top else ' in a function'}" for line, top in graph[a][b])
        steps.append(f"{a} -> {b} ({where})")
    return "; ".join(steps)


GRAPH = import_graph()
CYCLES = simple_cycles(GRAPH)


def layer_of(module: str) -> tuple[int, str] | None:
    """(layer, package) of a module; None for the root package."""
    for level, packages in enumerate(LAYERS):
        for package in packages:
            if module == package or module.startswith(package + "."):
                return level, package
    return None


def test_every_module_is_in_a_layer():
    assert [m for m in GRAPH if m != "gpubuf" and layer_of(m) is None] == []


def test_nothing_imports_upward_or_sideways():
    """Every import (module level and in functions) goes to the module's own package or a lower layer; the
    kernels import nothing of gpubuf, and only gpubuf.ops imports them."""
    bad = []
    for name, edges in GRAPH.items():
        if name == "gpubuf":
            continue
        level, package = layer_of(name)
        for target, where in edges.items():
            to = layer_of(target)
            lines = ", ".join(str(line) for line, _ in where)
            if to is None or (to[1] != package and to[0] >= level):
                bad.append(f"{name} -> {target} (line {lines})")
            elif to[1] == "gpubuf.kernels" and package not in ("gpubuf.ops", "gpubuf.kernels"):
                bad.append(f"{name} -> {target} (line {lines}): only gpubuf.ops launches kernels")
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_the_layer_check_can_fail():
    assert layer_of("gpubuf.replay.buffer") == (3, "gpubuf.replay") and layer_of("gpubuf") is None
    assert layer_of("gpubuf.sources.envpool")[0] > layer_of("gpubuf.history.buffer")[0]


def test_earlier_module_paths_are_the_new_modules_with_a_deprecation_warning():
    """``import gpubuf.envpool`` and the other paths of the layout before 0.2.0 give the module that holds them
    now, which keeps its own name and spec, and warn naming the new path and the release that removes them."""
    import importlib

    from gpubuf import _deprecated

    for old, new in _deprecated.MOVED.items():
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match=rf"{old} is deprecated .* removed in 0\.3\.0: import {new}"):
            module = importlib.import_module(old)
        assert module is importlib.import_module(new) and module.__spec__.name == new
    run_python("import gpubuf.envpool, gpubuf.distributed; from gpubuf.mbrl import MBRLAgent; "
               "from gpubuf.wrappers import ActionRepeatWrapper; print(gpubuf.envpool.EnvPoolSource)")


def test_the_public_surface_is_all_and_nothing_legacy():
    """Every name of ``gpubuf.__all__`` resolves; ``dir(gpubuf)`` lists the API and the public subpackages, no
    earlier module path."""
    from gpubuf import _deprecated

    for name in gpubuf.__all__:
        assert getattr(gpubuf, name) is not None, name
    shown = set(dir(gpubuf))
    assert set(gpubuf.__all__) <= shown
    assert not {old.split(".", 1)[1] for old in _deprecated.MOVED} & (shown - {"history", "replay", "planning"})
    assert {"Mixture", "Recency", "Online", "Fifo", "Lifo", "WriterDied", "RateLimiter", "export", "info"} <= shown


def test_an_earlier_path_runs_as_a_script():
    """``python -m gpubuf.cli`` (the earlier path of ``gpubuf.apps.cli``) runs the CLI."""
    proc = subprocess.run([sys.executable, "-m", "gpubuf.cli", "--version"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == f"gpubuf {gpubuf.__version__}"


def test_the_walk_sees_the_package():
    assert {"gpubuf", "gpubuf.replay.buffer", "gpubuf.history.buffer", "gpubuf.apps.cli",
            "gpubuf.apps.benchmarking.timing"} <= set(GRAPH)
    assert "gpubuf.history" in GRAPH["gpubuf"]  # a module-level edge of __init__
    assert not any(GRAPH["gpubuf"].get(app) for app in APPS)  # the TYPE_CHECKING imports do not count
    assert simple_cycles({"a": {"b": 0}, "b": {"c": 0, "a": 0}, "c": {"a": 0}}) == [("a", "b"), ("a", "b", "c")]


def test_no_import_cycle():
    """No cycle among the package's modules, module-level and function-level imports alike."""
    new = [describe(c, GRAPH) for c in CYCLES]
    assert not new, "import cycles:\n" + "\n".join(new)


def test_core_modules_import_no_app_and_no_optional_package_at_module_level():
    """The apps may import the core; the core (every module but the apps) imports no app at module level,
    and neither does any module import an optional package (tqdm, matplotlib, envpool, ...) at module level
    except the modules that exist to wrap one (gpubuf.sources.wrappers: gymnasium; gpubuf.torchrl: torchrl
    and its tensordict)."""
    bad = [f"{name} -> {target} (line {line})" for name, edges in GRAPH.items() if not is_app(name)
           for target, where in edges.items() if is_app(target) for line, top in where if top]
    assert not bad, "core modules importing apps at module level:\n" + "\n".join(bad)
    modules = package_modules()
    optional = []
    for name, path in modules.items():
        for node in ast.parse(path.read_text()).body:  # module-level statements
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            optional += [f"{name} -> {n} (line {node.lineno})" for n in names if n.split(".")[0] in OPTIONAL
                         and not (name == "gpubuf.sources.wrappers" and n.startswith("gymnasium"))
                         and not (name.startswith("gpubuf.torchrl") and n.startswith(("torchrl", "tensordict")))]
    assert not optional, "optional packages imported at module level:\n" + "\n".join(optional)


def run_python(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_import_gpubuf_loads_the_core_only():
    """In a fresh process: what ``import gpubuf`` adds to what torch and numpy load themselves holds no app
    and no optional package. (torch.hub imports tqdm whenever it is installed, so with the test extra the
    issue's check, run as is, lists tqdm's modules, loaded by ``import torch``; the next test runs it as is
    on an install without the apps extra.)"""
    new = json.loads(run_python(
        "import json, sys; import numpy, torch; before = set(sys.modules); import gpubuf; "
        "print(json.dumps(sorted(set(sys.modules) - before)))"))
    assert "gpubuf.replay.buffer" in new and "gpubuf.history.buffer" in new
    assert [m for m in new if is_app(m)] == []
    assert [m for m in new if m.split(".")[0] in OPTIONAL] == []


def test_done_when_check_prints_nothing_without_the_apps_extra():
    """The issue's check, verbatim, where tqdm, matplotlib and envpool cannot be imported (an install of gpubuf
    without its extras): ``import gpubuf`` works and loads none of them; the lazy names still resolve."""
    block = ("import importlib.machinery, sys\n"
             "class NoExtras:  # finds them, and fails to import them as an absent package does\n"
             "    def find_spec(self, name, path=None, target=None):\n"
             "        if name.split('.')[0] in ('tqdm', 'matplotlib', 'envpool'):\n"
             "            return importlib.machinery.ModuleSpec(name, self)\n"
             "    def create_module(self, spec):\n"
             "        raise ModuleNotFoundError(f'No module named {spec.name!r}', name=spec.name)\n"
             "    def exec_module(self, module):\n"
             "        pass\n"
             "sys.meta_path.insert(0, NoExtras())\n"
             "import torch\n"
             "assert 'tqdm' not in sys.modules and torch.hub.tqdm.__name__ == '_Faketqdm'\n")
    assert run_python(block + DONE_WHEN) == "[]"
    lazy = f"from gpubuf import {', '.join(LAZY_NAMES)}; print('ok')"
    assert run_python(block + lazy) == "ok"


def test_lazy_names_resolve_and_are_listed():
    from gpubuf.planning import CEMSolver, PlanConfig, Planner
    from gpubuf.replay.sharded.buffer import ShardedBuffer
    from gpubuf.sources.envpool import EnvPoolSource, Step, StepStager

    want = {"EnvPoolSource": EnvPoolSource, "ShardedBuffer": ShardedBuffer, "Planner": Planner,
            "CEMSolver": CEMSolver, "PlanConfig": PlanConfig, "Step": Step, "StepStager": StepStager}
    assert {name: getattr(gpubuf, name) for name in LAZY_NAMES} == want
    assert set(LAZY_NAMES) <= set(gpubuf.__all__) <= set(dir(gpubuf))
    assert all(hasattr(gpubuf, name) for name in gpubuf.__all__)
    assert {"planning", "apps", "export"} <= set(dir(gpubuf)) and not {"envpool", "cli"} & set(dir(gpubuf))
    with pytest.warns(DeprecationWarning, match="gpubuf.mbrl is deprecated"):
        sys.modules.pop("gpubuf.mbrl", None), vars(gpubuf).pop("mbrl", None)  # as in a fresh process
        assert gpubuf.mbrl.__name__ == "gpubuf.apps.mbrl"
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        gpubuf.no_such_name  # noqa: B018


def test_a_missing_optional_dependency_names_the_extra():
    from gpubuf.apps.demo import require

    with pytest.raises(ImportError, match=r'pip install "gpubuf\[apps\]"'):
        require("gpubuf_no_such_module", "a test")
