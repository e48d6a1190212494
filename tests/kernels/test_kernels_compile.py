"""Every Triton kernel variant the launchers produce compiles ahead of time for sm_80 and sm_90 on this
CPU-only machine (the Triton wheel ships ptxas), without register spills. No GPU is needed or used; the
compilation runs in a child process, because this one interprets the kernels (TRITON_INTERPRET=1)."""

import json
import os
import subprocess
import sys

import pytest

from gpubuf.kernels import INDEX
from gpubuf.kernels.words import WORDS
from gpubuf.replay.sampling.tree import FANOUT

signatures = pytest.importorskip("gpubuf.kernels.signatures")


def test_every_launcher_dtype_is_covered():
    variants = signatures.variants()
    assert {v.name for v in variants} == {"history.append", "history.gather_frames", "history.pack_blocks",
                                          "sequence.gather", "prefix_tree.update",
                                          "prefix_tree.sample", "stacks.stack", "stacks.returns", "priorities.write"}
    per_index_width = (4 * len(WORDS) + len(signatures.history.FLOATS) + len(signatures.history.INTS) + 3
                       + len(signatures.stacks.REWARDS) + 4)  # priorities.write: TD errors x running maximum dtypes
    assert len(variants) == len(INDEX) * per_index_width
    assert signatures.prefix_tree.FANOUT == FANOUT  # the tree kernels compile for the fan-out the buffers use


def test_kernels_compile_for_sm80_and_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "gpubuf.kernels.signatures", "80", "90"], env=env,
                         capture_output=True, text=True, check=True).stdout
    rows = json.loads(out)
    assert len(rows) == 2 * len(signatures.variants())
    failures = [f"{r['arch']} {r['kernel']}: {r['error']}" for r in rows if "error" in r]
    failures += [f"{r['arch']} {r['kernel']}: spills ({r['local']} B local, {r['stack']} B stack)"
                 for r in rows if "error" not in r and (r["local"] or r["stack"])]
    assert not failures, "\n".join(failures)
    assert {r["arch"] for r in rows} == {"sm_80", "sm_90"}
    # the one-launch tree update relies on a block-wide barrier after the leaves and after each level
    assert all(r["barriers"] >= 2 for r in rows if r["kernel"].startswith("prefix_tree.update"))
