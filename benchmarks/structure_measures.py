"""The structure of a gpubuf checkout, measured: where implementations are chosen, sizes, layout, sample() arity.

    python benchmarks/structure_measures.py [ROOT]     # ROOT: a checkout (default: this one)

Prints the lines outside ``gpubuf/ops`` that ask "Triton? numba? compiling?" (the text search below; the sharded
transport's ``route`` is a message router, not a choice), the ``is_compiling`` uses and numba importers outside
``gpubuf/ops``, the three largest classes and functions (lines from ``def``/``class`` to the end, docstring
included), ``graph_sampler.py``'s length, ``gpubuf/replay``'s top modules and folders, the size of ``gpubuf/`` and
``kernels/`` (lines: code, docstring, comment, blank; code tokens without docstrings, comments and layout; docstring
words) and ``sample()``'s parameters (run with ROOT first on ``sys.path``: the checkout's ``gpubuf/kernels`` must
exist, as a link to ``kernels/``).
"""

import ast
import inspect
import io
import re
import sys
import tokenize
import warnings
from pathlib import Path

DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
DECIDING = re.compile(r'is_compiling|host_loops|triton_runs_on|interpreting\(|\broute\(|backend_for|backend ?[!=]= ?"')


def sources(root: Path) -> dict[str, str]:
    """``{path relative to root: text}`` of the package's modules (the kernels left out)."""
    package = root / "gpubuf"
    return {str(p.relative_to(root)): p.read_text() for p in sorted(package.rglob("*.py"))
            if "kernels" not in p.relative_to(package).parts[:1]}


def outside_ops(texts: dict[str, str]) -> dict[str, str]:
    return {path: text for path, text in texts.items() if not path.startswith("gpubuf/ops/")}


def deciding_lines(texts: dict[str, str]) -> dict[str, list[int]]:
    return {path: lines for path, text in outside_ops(texts).items() if "transport" not in path
            and (lines := [i for i, line in enumerate(text.splitlines(), 1) if DECIDING.search(line)])}


def definitions(texts: dict[str, str]) -> list[tuple[int, str, str]]:
    """``(lines, "class" or "def", qualified name)`` of every class and function."""
    found = []

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                kind = "class" if isinstance(child, ast.ClassDef) else "def"
                found.append((child.end_lineno - child.lineno + 1, kind, prefix + child.name))
                walk(child, prefix + child.name + ".")

    for path, text in texts.items():
        walk(ast.parse(text), path[:-3].replace("/", ".") + ".")
    return found


def size(root: Path) -> dict[str, int]:
    """Lines of ``gpubuf/`` and ``kernels/`` by kind, code tokens (docstrings, comments and layout left out) and
    docstring words."""
    layout = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    count = dict.fromkeys(("lines", "code", "docstring", "comment", "blank", "code tokens", "docstring words"), 0)
    for path in sorted(root.glob("gpubuf/**/*.py")) + sorted(root.glob("kernels/**/*.py")):
        if path.parent.name == "kernels" and path.parent.is_symlink():
            continue
        text = path.read_text()
        docs = [n.body[0] for n in ast.walk(ast.parse(text)) if isinstance(n, DOCUMENTED) and ast.get_docstring(n)]
        doc_lines = {i for d in docs for i in range(d.lineno, d.end_lineno + 1)}
        starts = {(d.lineno, d.col_offset) for d in docs}
        lines = text.splitlines()
        comment = sum(line.strip().startswith("#") for i, line in enumerate(lines, 1) if i not in doc_lines)
        blank = sum(not line.strip() for i, line in enumerate(lines, 1) if i not in doc_lines)
        count["lines"] += len(lines)
        count["docstring"] += len(doc_lines)
        count["comment"] += comment
        count["blank"] += blank
        count["code"] += len(lines) - len(doc_lines) - comment - blank
        count["docstring words"] += sum(len(ast.literal_eval(d.value).split()) for d in docs)
        count["code tokens"] += sum(t.type not in layout and not (t.type == tokenize.STRING and t.start in starts)
                                    for t in tokenize.generate_tokens(io.StringIO(text).readline))
    return count


def main(root: Path) -> None:
    texts = sources(root)
    sites = deciding_lines(texts)
    print("deciding lines outside ops/:", sum(map(len, sites.values())), "in", len(sites), "files", sites)
    others = outside_ops(texts)
    compiling = {p: t.count("is_compiling") for p, t in others.items() if "is_compiling" in t}
    print("is_compiling outside ops/:", sum(compiling.values()), compiling)
    numba = [p for p, t in others.items() if re.search(r"host_loops|import numba|from numba", t)]
    print("numba / host_loops importers outside ops/:", len(numba), numba)
    found = definitions(texts)
    for kind in ("class", "def"):
        print(f"largest {kind}:", sorted((d for d in found if d[1] == kind), reverse=True)[:3])
    replay = root / "gpubuf" / "replay"
    sampler = next(replay.rglob("graph_sampler.py"))
    print("graph_sampler.py lines:", len(sampler.read_text().splitlines()))
    print("replay top modules:", sorted(p.name for p in replay.glob("*.py") if p.name != "__init__.py"),
          "folders:", sorted(p.name for p in replay.iterdir() if p.is_dir() and p.name != "__pycache__"))
    print("size of gpubuf/ and kernels/:", size(root))
    sys.path.insert(0, str(root))
    warnings.simplefilter("ignore")
    import gpubuf

    params = list(inspect.signature(gpubuf.TransitionBuffer.sample).parameters)[1:]
    print("sample() parameters:", len(params), params)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent.parent).resolve())
