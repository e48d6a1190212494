"""Every benchmark script imports against the library as it is now: a module moved or renamed in gpubuf
breaks its benchmark here, not on the next quiet machine that runs it."""

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

_IMPORT_ALL = """
import importlib.util, sys
sys.path.insert(0, {where!r})
for path in sys.argv[1:]:
    spec = importlib.util.spec_from_file_location("bench_" + path.rsplit("/", 1)[-1][:-3], path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
"""


def test_every_benchmark_script_imports():
    scripts = sorted(str(p) for p in BENCHMARKS.glob("*.py"))
    assert len(scripts) >= 10
    done = subprocess.run([sys.executable, "-c", _IMPORT_ALL.format(where=str(BENCHMARKS)), *scripts],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
