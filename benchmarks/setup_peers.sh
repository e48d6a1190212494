#!/usr/bin/env bash
# Installs the replay-buffer peers of benchmarks/bench_replay.py into a separate venv (never the test extra).
# Usage: bash benchmarks/setup_peers.sh [VENV]   (default .venv-peers in the repository, ignored by git; BENCH_VENV
# also sets it). The benchmark commands in docs/benchmarks.md run .venv-peers/bin/python from the repository root.
# CPU torch goes in first and stays pinned (a constraints file), so no peer swaps it for another build. gpubuf goes
# in with its fast extra (numba's compiled host loops), as the benchmarks describe it. Each peer installs on its own:
# one that fails is reported as missing by the benchmark, it does not stop the others.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-${BENCH_VENV:-.venv-peers}}"
python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q torch==2.13.0 || { echo "setup_peers: torch 2.13.0 failed"; exit 1; }
echo "torch==2.13.0" > "$VENV/constraints.txt"
export PIP_CONSTRAINT="$VENV/constraints.txt"
"$PY" -m pip install -q "setuptools>=68" wheel
rm -rf build && "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$VENV/wheel" . && rm -rf build
"$PY" -m pip install -q --force-reinstall "$(ls "$VENV"/wheel/gpubuf-*.whl)[fast]" numpy scipy
for peer in cpprb rlox envpool "torchrl tensordict" "flashbax jax" "jaxnasium[algs]"; do
    # shellcheck disable=SC2086
    if "$PY" -m pip install -q $peer; then echo "setup_peers: installed $peer"; else echo "setup_peers: FAILED $peer"; fi
done
rebuild_torchrl() {
    # Compiles torchrl/csrc/{pybind,utils}.cpp (CPU segment trees only) against the installed torch with
    # torch.utils.cpp_extension and puts the result where torchrl imports it from.
    "$PY" - <<'PYEOF'
import glob, os, shutil, sys, tempfile
import torchrl
from torch.utils.cpp_extension import load
src = os.path.join(os.path.dirname(torchrl.__file__), "csrc")
build = tempfile.mkdtemp(prefix="torchrl_ext_")
mod = load(name="_torchrl", sources=[os.path.join(src, "pybind.cpp"), os.path.join(src, "utils.cpp")],
           extra_include_paths=[src], extra_cflags=["-O3"], build_directory=build, verbose=False)
dst = glob.glob(os.path.join(os.path.dirname(torchrl.__file__), "_torchrl*.so"))[0]
shutil.copy(mod.__file__, dst)
print("setup_peers: rebuilt", dst)
PYEOF
    "$PY" -c "import torchrl._torchrl; print('setup_peers: torchrl extension loads')"
}
# torchrl's wheel ships a compiled extension built against another torch; if it does not load, rebuild it
# from the C++ sources the wheel ships (needs a C++ compiler and torch's headers).
"$PY" - <<'PYEOF'
import sys
try:
    import torchrl._torchrl  # noqa: F401
    print("setup_peers: torchrl extension loads")
except Exception as err:  # noqa: BLE001
    print(f"setup_peers: torchrl extension does not load ({err}); rebuilding", file=sys.stderr)
    sys.exit(3)
PYEOF
if [ $? -eq 3 ]; then rebuild_torchrl; fi
"$PY" -m pip list 2>/dev/null | grep -i -E "^(torch|torchrl|tensordict|cpprb|rlox|flashbax|jax|jaxlib|jaxnasium|numba) "
