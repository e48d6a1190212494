"""benchmarks/device_check.sh without a GPU: the dry run checks the plan of both device calls (every step has a
limit, the limits with their kill grace and the packing fit each call's budget, the files it runs exist), and a
simulated run packs everything a part writes into one archive under $OUT."""

import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "device_check.sh"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils timeout")


def run(*args, **env):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={**os.environ, **env})


def test_the_dry_run_checks_both_calls_against_their_budget():
    r = run("--dry-run")
    out = r.stdout
    steps = {}
    part = None
    for line in out.splitlines():
        if line.startswith("== part "):
            part = line.split()[2].rstrip(":")
            steps[part] = []
        elif part and (m := re.match(r"(\w+)\s+(\d+)s\s+(\S+)\s+(.+)", line)):
            steps[part].append((m[1], int(m[2]), m[3], m[4]))
    assert set(steps) == {"basics", "bench"}
    for name, plan in steps.items():
        total = int(re.search(rf"part {name}: \d+ steps, limits \+ kill grace \+ packing = (\d+) s of 285 s", out)[1])
        assert total == sum(s for _, s, _, _ in plan) + 3 * len(plan) + 10 <= 285 < 300  # a 5-minute call
        assert len({log for _, _, log, _ in plan}) == len(plan)  # every step its own log
    basics = " ".join(cmd for *_, cmd in steps["basics"])
    # the CUDA tests, ops vs twins
    assert "-m cuda tests" in basics and "tests/kernels/test_history_kernels.py" in basics
    bench = {name for name, *_ in steps["bench"]}
    assert {"history", "replay", "graph", "tree_update", "demo"} <= bench
    assert "missing file" not in out
    if (ROOT / ".whl").is_dir() and not re.search(r"^absent: ", out, re.M):
        assert r.returncode == 0 and "dry run: plan OK" in out, out


def test_the_dry_run_fails_a_plan_over_budget():
    r = run("--dry-run", "bench", DEVICE_CHECK_BUDGET="120")
    assert r.returncode == 1 and "part bench: over budget" in r.stdout


def test_a_part_writes_one_archive_under_out(tmp_path):
    r = run("--simulate", "basics", OUT=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["device_basics.tar.gz"]
    with tarfile.open(tmp_path / "device_basics.tar.gz") as tar:
        names = set(tar.getnames())
        summary = tar.extractfile("device_basics/README.txt").read().decode()
    assert {"device_basics/summary.tsv", "device_basics/cuda_tests.txt", "device_basics/kernel_tests.txt"} <= names
    assert [row.split("\t")[0] for row in summary.splitlines()[2:]] == ["info", "wheels", "kernel_tests", "cuda_tests",
                                                                      "distributed_tests"]


def test_a_part_must_be_named():
    assert run().returncode == 2 and run("all").returncode == 2


def test_sleeps_when_asked():
    """The target of the per-test limit check below (instant unless GPUBUF_SLEEP_TEST is set)."""
    if os.environ.get("GPUBUF_SLEEP_TEST"):
        time.sleep(30)


def test_the_per_test_limit_fails_a_stuck_test():
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        f"{__file__}::test_sleeps_when_asked"], capture_output=True, text=True, timeout=120,
                       cwd=ROOT, env={**os.environ, "GPUBUF_SLEEP_TEST": "1", "GPUBUF_TEST_TIMEOUT": "1"})
    assert r.returncode == 1 and "over GPUBUF_TEST_TIMEOUT=1 s" in r.stdout, r.stdout[-2000:]
