"""One place decides what runs: the backend table (``gpubuf.ops.backends``). No module of the buffers, sources,
adapters or apps asks "Triton? numba? compiling?" itself (read from the source with :mod:`ast`); the table is
chosen once per deciding inputs and answers the report."""

import ast
import copy
import pickle
from pathlib import Path

import pytest
import torch
from fixtures import make_transition

import gpubuf
from gpubuf.ops import backend_table, host_loops
from gpubuf.ops.registry import OPS

ROOT = Path(gpubuf.__file__).parent
# the packages around the ops: they call the table (or are handed its answers), never choose
CALLERS = ("_core", "replay", "history", "sources", "torchrl", "apps", "planning")
# names whose use is a choice of implementation: the tracing check, the numba loops, Triton's reach
DECIDING = {"is_compiling", "host_loops", "triton_runs_on", "interpreting", "backend_for", "route", "numba"}
BACKEND_NAMES = {"torch", "triton"}


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | \
        {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def deciding_lines(path: Path) -> list[str]:
    """``"line: what"`` for each place of ``path`` that asks which implementation runs, in source order."""
    found = []
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        what = None
        if isinstance(node, ast.Attribute) and node.attr in DECIDING - {"route"}:
            what = node.attr
        elif isinstance(node, ast.Name) and node.id in DECIDING - {"route"}:
            what = node.id
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            module = getattr(node, "module", None) or ""
            imported = {a.name for a in node.names}
            if "numba" in {module.split(".")[0]} | {a.split(".")[0] for a in imported} \
                    or (module.startswith("gpubuf.ops") and imported & DECIDING):
                what = "import " + ", ".join(sorted(imported))
        elif isinstance(node, ast.Compare):  # backend == "torch" and the like
            sides = [node.left, *node.comparators]
            constants = {s.value for s in sides if isinstance(s, ast.Constant)}
            if constants & BACKEND_NAMES and any("backend" in _names(s) for s in sides):
                what = "a comparison of a backend name"
        if what is not None:
            found.append((node.lineno, what))
    return [f"{line}: {what}" for line, what in sorted(found)]


def test_no_module_above_the_ops_asks_what_runs():
    found = [f"{path.relative_to(ROOT.parent)}:{line}" for package in CALLERS
             for path in sorted((ROOT / package).rglob("*.py")) for line in deciding_lines(path)]
    assert not found, "\n".join(found)


def test_the_check_finds_each_question(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import torch\nfrom gpubuf.ops import host_loops\nimport numba\n"
                     "a = torch.compiler.is_compiling()\nb = self.backend == 'triton'\n")
    assert deciding_lines(probe) == ["2: import host_loops", "3: import numba", "4: is_compiling",
                                     "5: a comparison of a backend name"]


def test_one_table_per_deciding_inputs(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("GPUBUF_BACKEND", raising=False)
    table = backend_table(cpu)
    assert backend_table(cpu) is table and backend_table(cpu, "torch") is table
    assert backend_table(cpu, env_major=True) is not table and backend_table(cpu, env_major=True).window_gather is None
    monkeypatch.setattr(host_loops, "ENABLED", not host_loops.ENABLED)
    assert backend_table(cpu) is not table
    with pytest.raises(ValueError, match="name: expected one of"):
        backend_table(cpu, "cuda")


def test_a_buffer_and_its_parts_share_one_table(monkeypatch):
    monkeypatch.delenv("GPUBUF_BACKEND", raising=False)
    buf = gpubuf.PrioritizedTransitionBuffer(20, 4, make_transition(0, 1, 2), device="cpu")
    assert buf.backend == buf.table.name == "torch"
    assert buf.sampler.table is buf.reader.table is buf.table and buf.storage.table is buf.table
    buf.insert(make_transition(0, 5, 2))
    buf.sample(unit=gpubuf.Unit.window())
    assert buf.sampler.tree(0).table is buf.table


def test_the_report_is_the_tables_answer(monkeypatch):
    monkeypatch.delenv("GPUBUF_BACKEND", raising=False)
    table = backend_table(torch.device("cpu"))
    report = gpubuf.info("cpu")["ops"]
    assert report == table.implementations() and set(OPS) <= set(report)
    assert not table.kernels and table.window_tables is None and not table.fixed_tables and table.host_gather


def test_a_copied_or_pickled_table_is_the_table_of_its_inputs(monkeypatch):
    monkeypatch.delenv("GPUBUF_BACKEND", raising=False)
    table = backend_table(torch.device("cpu"), env_major=True)
    assert copy.deepcopy(table) is table and pickle.loads(pickle.dumps(table)) is table
