"""``gpubuf info`` and ``gpubuf.info()``: the report of what runs here, on the CPU, with and without numba and
with ``GPUBUF_BACKEND`` set."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import INTERPRET

import gpubuf
from gpubuf.ops.registry import OPS

SECTIONS = ["versions", "device", "ops", "extras", "storage_tiers"]


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "gpubuf.apps.cli", "info", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_the_report_has_every_section_and_every_op():
    report = gpubuf.info("cpu")
    assert list(report) == SECTIONS
    assert report["versions"]["torch"] == torch.__version__ and report["versions"]["gpubuf"] == gpubuf.__version__
    assert report["device"]["device"] == "cpu" and report["device"]["capability"] is None
    assert set(OPS) <= set(report["ops"]) and {"priority_update", "importance_weights"} <= set(report["ops"])
    assert set(report["extras"]) == {"fast", "apps", "envpool", "gymnasium", "jax", "export", "torchrl", "tensordict",
                                      "ray"}
    assert all(line.startswith(("  ", *SECTIONS)) for line in str(report).splitlines())


def test_the_ops_follow_the_host_loops(host_loops, monkeypatch):
    monkeypatch.delenv("GPUBUF_BACKEND", raising=False)
    ops = gpubuf.info("cpu")["ops"]
    want = "numba loop" if host_loops == "compiled" else "torch twin"
    assert ops["tree_sample"] == ops["tree_update"] == ops["tree_update_range"] == want
    assert ops["sequence_gather"] == ops["frame_stack"] == ops["history_append"] == "torch twin"
    assert ops["priority_update"] == ("numba loop" if host_loops == "compiled" else "torch ops")


def test_the_ops_follow_the_backend(backend):
    ops = gpubuf.info("cpu")["ops"]
    if backend == "triton" and INTERPRET:
        assert {ops[name] for name in OPS} == {"triton kernel"}
        assert ops["priority_update"] == "torch ops"
    else:
        assert "triton kernel" not in ops.values()
    assert gpubuf.info("cpu")["device"]["GPUBUF_BACKEND"] == backend


def test_gpubuf_info_prints_the_report_and_its_json():
    proc = run_cli()
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[0] == "versions:" and "  tree_sample: " in proc.stdout
    proc = run_cli("--json", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert list(json.loads(proc.stdout)) == SECTIONS


def test_gpubuf_info_without_numba_says_so():
    env = {**os.environ, "GPUBUF_NUMBA": "0"}
    report = json.loads(run_cli("--json", env=env).stdout)
    assert report["ops"]["tree_sample"] == "torch twin" and report["device"]["GPUBUF_NUMBA"] == "0"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA refuses the device")
def test_a_device_that_cannot_be_used_is_refused_naming_it():
    proc = run_cli("--device", "cuda")
    assert proc.returncode == 2 and "--device" in proc.stderr and "CUDA is not available" in proc.stderr
    with pytest.raises(ValueError, match="device: CUDA is not available"):
        gpubuf.info("cuda")
