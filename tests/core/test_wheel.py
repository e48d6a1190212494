"""The wheel users install holds every package of the source tree: ``pip wheel --no-deps`` of this tree, its
packages against every ``__init__.py`` under ``gpubuf/`` and ``kernels/`` (shipped as ``gpubuf.kernels``)."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "setup.py", "README.md", "gpubuf", "kernels")


def source_packages() -> set[str]:
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "gpubuf").rglob("__init__.py")
             if "__pycache__" not in p.parts and not p.is_relative_to(ROOT / "gpubuf" / "kernels")}
    found |= {".".join(("gpubuf", *p.parent.relative_to(ROOT).parts)) for p in (ROOT / "kernels").rglob("__init__.py")}
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tree = tmp_path_factory.mktemp("tree")
    for name in SOURCES:  # a copy: the build leaves the checkout as it was (a gpubuf/kernels link stays out)
        src, skip = ROOT / name, ("__pycache__", "kernels") if name == "gpubuf" else ("__pycache__",)
        if src.is_dir():
            shutil.copytree(src, tree / name, ignore=shutil.ignore_patterns(*skip))
        else:
            shutil.copy(src, tree / name)
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                           str(out), str(tree)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (found,) = out.glob("gpubuf-*.whl")
    return found


def test_the_wheel_holds_every_package_of_the_tree(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    packages = {n[: -len("/__init__.py")].replace("/", ".") for n in names if n.endswith("/__init__.py")}
    assert "gpubuf.torchrl" in source_packages()
    assert packages == source_packages()


def test_the_wheel_holds_every_module_and_its_version(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "gpubuf").rglob("*.py")
               if "__pycache__" not in p.parts and not p.is_relative_to(ROOT / "gpubuf" / "kernels")}
    modules |= {f"gpubuf/{p.relative_to(ROOT)}" for p in (ROOT / "kernels").rglob("*.py")}
    assert modules <= names, sorted(modules - names)
    assert wheel.name.startswith("gpubuf-0.2.0-")
