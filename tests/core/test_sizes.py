"""The package's size rules: no class over 300 lines and no function over 50, except the named exceptions below;
``gpubuf.replay`` laid out in folders, with few top-level modules.

A definition's lines run from its ``def``/``class`` line to its last line, docstring included, decorators not; they
are read with :mod:`ast` from the source of every module of the package (``gpubuf.kernels`` included), nothing is
executed. Nested definitions count on their own as well (``module.Class.method``, ``module.function.inner``).
"""

import ast
import importlib.util
import pkgutil
from collections.abc import Iterator

from test_imports import package_modules

LIMITS = {"class": 300, "function": 50}
# Definitions over the rule, by qualified name: (the most lines each may have, why). An entry that is no longer over
# the rule fails the suite, so the list holds only what is still needed.
EXCEPTIONS: dict[str, tuple[int, str]] = {}
# gpubuf.replay: at most this many modules beside its folders and __init__.py
REPLAY_TOP_MODULES = 8
# the name prefixes that stood for folders in the flat layout of gpubuf.replay
FLAT_PREFIXES = ("storage", "shard")


def definitions(source: str, module: str) -> Iterator[tuple[str, str, int]]:
    """``(kind, qualified name, lines)`` of every class (kind ``"class"``) and function (``"function"``) defined in
    ``source``, the module ``module``, nested ones included."""

    def walk(node: ast.AST, prefix: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}.{child.name}"
                kind = "class" if isinstance(child, ast.ClassDef) else "function"
                yield kind, name, child.end_lineno - child.lineno + 1
                yield from walk(child, name)
            else:
                yield from walk(child, prefix)

    yield from walk(ast.parse(source), module)


def oversized(sources: dict[str, str]) -> dict[str, tuple[int, int]]:
    """Qualified name -> ``(lines, limit)`` of every definition over its kind's limit, of modules ``sources``
    (module name -> source)."""
    return {name: (lines, LIMITS[kind]) for module, source in sources.items()
            for kind, name, lines in definitions(source, module) if lines > LIMITS[kind]}


def violations(over: dict[str, tuple[int, int]], exceptions: dict[str, tuple[int, str]]) -> list[str]:
    """The definitions of ``over`` (as :func:`oversized` gives them) that no entry of ``exceptions`` allows."""
    return [f"{name}: {lines} lines (limit {exceptions.get(name, (limit,))[0]})"
            for name, (lines, limit) in sorted(over.items()) if lines > exceptions.get(name, (limit,))[0]]


def unneeded(over: dict[str, tuple[int, int]], exceptions: dict[str, tuple[int, str]]) -> list[str]:
    """The entries of ``exceptions`` that name no definition over the rule (it shrank, moved or went away)."""
    return sorted(name for name in exceptions if name not in over)


def folder_prefixes(modules: list[str], folders: list[str]) -> list[str]:
    """The names of ``modules`` whose first word (``storage`` of ``storage_files``) stands for a folder: it starts
    the name of one of ``folders`` (``shard`` of ``sharded``), or it is one of :data:`FLAT_PREFIXES`."""
    found = []
    for module in modules:
        words = module.strip("_").split("_")
        if len(words) > 1 and (words[0] in FLAT_PREFIXES or any(f.startswith(words[0]) for f in folders)):
            found.append(module)
    return found


SOURCES = {name: path.read_text() for name, path in package_modules().items()}
OVERSIZED = oversized(SOURCES)


def test_the_walk_sees_the_package_and_the_kernels():
    assert {"gpubuf", "gpubuf.replay.buffer", "gpubuf.kernels.prefix_tree", "gpubuf.apps.cli"} <= set(SOURCES)


def test_no_class_over_300_lines_and_no_function_over_50():
    bad = violations(OVERSIZED, EXCEPTIONS)
    assert not bad, "definitions over the size rules (split them by job):\n" + "\n".join(bad)


def test_every_exception_is_still_needed():
    gone = unneeded(OVERSIZED, EXCEPTIONS)
    assert not gone, "exceptions no longer over the size rules (remove them from EXCEPTIONS): " + ", ".join(gone)


def test_the_size_check_can_fail():
    def function(name: str, lines: int, indent: str = "") -> str:
        return "\n".join([f"{indent}def {name}():", f'{indent}    """Doc."""']
                         + [f"{indent}    x = {i}" for i in range(lines - 2)])

    def cls(name: str, lines: int) -> str:  # a method of 50 lines, then attributes
        return "\n".join([f"class {name}:", function("method", 50, "    ")]
                         + [f"    y{i} = {i}" for i in range(lines - 51)])

    source = "\n".join(["@decorator", function("fits", 50), function("too_long", 51), "def outer():",
                        function("inner", 51, "    "), cls("Fits", 300), cls("Big", 301)])
    over = oversized({"m": source})
    assert over == {"m.too_long": (51, 50), "m.outer": (52, 50), "m.outer.inner": (51, 50), "m.Big": (301, 300)}
    assert violations(over, {"m.too_long": (51, "why"), "m.outer": (51, "why")}) == [
        "m.Big: 301 lines (limit 300)", "m.outer: 52 lines (limit 51)", "m.outer.inner: 51 lines (limit 50)"]
    assert unneeded(over, {"m.fits": (60, "why"), "m.Big": (301, "why"), "m.gone": (90, "why")}) == [
        "m.fits", "m.gone"]


def replay_layout() -> tuple[list[str], list[str]]:
    """``(modules, folders)``: the names of gpubuf.replay's modules beside ``__init__.py``, and of its folders."""
    replay = importlib.util.find_spec("gpubuf.replay")
    found = list(pkgutil.iter_modules(replay.submodule_search_locations))
    return [m.name for m in found if not m.ispkg], [m.name for m in found if m.ispkg]


def test_replay_is_laid_out_in_folders():
    """At most 8 top-level modules in gpubuf.replay, and no module in it (folders included) named with a prefix
    that stands for a folder."""
    modules, folders = replay_layout()
    assert len(modules) <= REPLAY_TOP_MODULES, f"gpubuf.replay: {len(modules)} top-level modules: {sorted(modules)}"
    every = [name.rsplit(".", 1)[1] for name in SOURCES if name.startswith("gpubuf.replay.")]
    assert folder_prefixes(every, folders) == []


def test_the_layout_check_can_fail():
    folders = ["sampling", "storage", "sharded", "feeds"]
    names = ["storage_files", "shard_windows", "feed_export", "sampling_tree", "sample_args", "writer_hub",
             "buffer_state", "ring", "_private"]
    assert folder_prefixes(names, folders) == ["storage_files", "shard_windows", "feed_export", "sampling_tree"]
    assert folder_prefixes(["storage_dir"], []) == ["storage_dir"]
    modules, folders = replay_layout()
    assert {"buffer", "ring"} <= set(modules) and {"sampling", "storage", "sharded", "feeds"} <= set(folders)
