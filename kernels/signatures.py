"""Ahead-of-time compilation of every kernel variant (each kernel module's ``variants()``) for a
named GPU architecture with no GPU present.

``triton.compile`` runs the whole pipeline (TTIR -> PTX -> cubin with the wheel's ``ptxas``) for a
``GPUTarget``; the wheel's ``cuobjdump`` reads registers, shared memory and local memory (spills)
from the cubin. ``python -m gpubuf.kernels.signatures 80 90`` prints one JSON row per variant and
arch (the test suite runs it and fails on an error or a spill; ``benchmarks/kernel_resources.py``
writes the table). Compilation needs real ``JITFunction`` kernels: run it in a process without
``TRITON_INTERPRET=1``.
"""

import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from gpubuf.kernels import Variant, history, prefix_tree, priorities, sequence, stacks


def variants() -> list[Variant]:
    """The variants of every kernel module."""
    return (history.variants() + sequence.variants() + prefix_tree.variants() + stacks.variants()
            + priorities.variants())


_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def compile_variant(v: Variant, arch: int) -> dict:
    """Compile ``v`` for ``sm_<arch>``; returns registers, stack, shared and local (spill) bytes per
    thread, and the block-wide barriers (``bar.sync``) in its PTX."""
    if not isinstance(v.fn, JITFunction):
        raise RuntimeError("kernels are interpreted here (TRITON_INTERPRET=1): compile them in a "
                           "process without it, e.g. `python -m gpubuf.kernels.signatures 80 90`")
    kernel = triton.compile(ASTSource(fn=v.fn, signature=v.signature, constexprs=v.constexprs),
                            target=GPUTarget("cuda", arch, 32))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        report = subprocess.run([os.path.join(_BIN, "cuobjdump"), "--dump-resource-usage", f.name],
                                capture_output=True, text=True, check=True).stdout
    regs, stack, shared, local = map(int, _USAGE.search(report).groups())
    return {"kernel": v.label, "arch": f"sm_{arch}", "registers": regs, "stack": stack,
            "shared": shared, "local": local, "num_warps": kernel.metadata.num_warps,
            "barriers": kernel.asm["ptx"].count("bar.sync")}


def main(archs: list[int]) -> list[dict]:
    """Compile every variant for every arch; a failure becomes a row with an ``error``."""
    rows = []
    for arch in archs:
        for v in variants():
            try:
                rows.append(compile_variant(v, arch))
            except Exception as err:  # every failing variant is reported, not only the first
                rows.append({"kernel": v.label, "arch": f"sm_{arch}",
                             "error": f"{type(err).__name__}: {err}"})
    return rows


if __name__ == "__main__":
    print(json.dumps(main([int(a) for a in sys.argv[1:]] or [80, 90])))
