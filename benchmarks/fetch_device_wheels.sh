#!/usr/bin/env bash
# Downloads the wheels of benchmarks/device_wheels.txt for the GPU machine (CPython 3.12, manylinux x86-64) into
# .whl/ (git-ignored), one version each and no dependencies: `bash benchmarks/device_check.sh --dry-run` then
# lists them as present. Run it here, on a machine with a package index, before the device calls.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
grep -vE '^\s*(#|$)' benchmarks/device_wheels.txt | xargs python3 -m pip download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl
ls -la .whl
