"""Every (kernel, signature, constexprs) variant the launchers in this package produce, and their
ahead-of-time compilation for a named GPU architecture with no GPU present.

``triton.compile`` runs the whole pipeline (TTIR -> PTX -> cubin with the wheel's ``ptxas``) for a
``GPUTarget``; the wheel's ``cuobjdump`` reads registers, shared memory and local memory (spills) from
the cubin. ``python -m gpubuf.kernels.signatures 80 90`` prints one JSON row per variant and arch (the
test suite runs it and fails on an error or a spill; ``benchmarks/kernel_resources.py`` writes the table).
Compilation needs real ``JITFunction`` kernels: run it in a process without ``TRITON_INTERPRET=1``.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from gpubuf.kernels import history, prefix_tree, sequence
from gpubuf.prefix_tree import FANOUT

WORDS = ("i64", "i32", "i16", "u8")  # what reference.as_words makes of any storage row (pure copies)
FLOATS = ("fp16", "bf16", "fp32", "fp64")  # action blocks keep their dtype (NaN/inf handling)
INTS = ("u8", "i8", "i16", "i32", "i64")  # bool blocks travel as u8
INDEX = ("i32", "i64")  # Triton passes a Python int as i32, or i64 from 2**31 on


@dataclass(frozen=True)
class Variant:
    """One compilation unit: the kernel, its signature (name -> Triton type) and constexpr values."""

    name: str
    fn: object
    signature: dict
    constexprs: dict

    @property
    def label(self) -> str:
        types = ",".join(t for t in self.signature.values() if t != "constexpr")
        consts = ",".join(f"{k}={v}" for k, v in self.constexprs.items() if k != "BELOW_ONE")
        return f"{self.name}({types}; {consts})"


def _sig(names: str, types: dict, default: str) -> dict:
    return {n: types.get(n, default) for n in names.split()}


def variants() -> list[Variant]:
    out = []
    for idx in INDEX:
        for w in WORDS:
            p = f"*{w}"
            out.append(Variant("history.append", history._append_kernel,
                               {**_sig("table_ptr dst_row_ptr like_ptr", {"table_ptr": "*i64", "dst_row_ptr": "*i64",
                                                                          "like_ptr": p}, idx),
                                "BLOCK": "constexpr"}, {"BLOCK": history.BLOCK}))
            out.append(Variant("history.gather_frames", history._gather_frames_kernel,
                               {**_sig("table_ptr meta_ptr like_ptr rows n ab max_len n_envs",
                                       {"table_ptr": "*i64", "meta_ptr": "*i64", "like_ptr": p}, idx),
                                "BLOCK": "constexpr"}, {"BLOCK": history.BLOCK}))
            out.append(Variant("sequence.gather", sequence._gather_kernel,
                               {**_sig("table_ptr start_ptr like_ptr n E M",
                                       {"table_ptr": "*i64", "start_ptr": "*i64", "like_ptr": p}, idx),
                                "BLOCK": "constexpr"}, {"BLOCK": sequence.BLOCK}))
        for dtype in FLOATS + INTS:
            is_float = dtype in FLOATS
            p = f"*{dtype}"
            out.append(Variant("history.pack_blocks", history._pack_blocks_kernel,
                               {**_sig("src_ptr dst_ptr meta_ptr rows n ab max_len n_envs D fmax_ptr",
                                       {"src_ptr": p, "dst_ptr": p, "meta_ptr": "*i64",
                                        "fmax_ptr": ("*fp64" if dtype == "fp64" else "*fp32") if is_float
                                        else "*i64"}, idx),
                                "IS_FLOAT": "constexpr", "BLOCK": "constexpr"},
                               {"IS_FLOAT": is_float, "BLOCK": history.BLOCK}))
        for is_range in (False, True):
            out.append(Variant("prefix_tree.update", prefix_tree._update_kernel,
                               {**_sig("tree_ptr off_ptr idx_ptr val_ptr n lo k0 k1",
                                       {"tree_ptr": "*fp64", "off_ptr": "*i64",
                                        "idx_ptr": "*fp64" if is_range else "*i64", "val_ptr": "*fp64"}, idx),
                                "F": "constexpr", "RANGE": "constexpr", "BLOCK": "constexpr", "P": "constexpr"},
                               {"F": FANOUT, "RANGE": is_range, "BLOCK": prefix_tree.BLOCK,
                                "P": prefix_tree.PARENTS}))
        out.append(Variant("prefix_tree.sample", prefix_tree._sample_kernel,
                           {**_sig("tree_ptr off_ptr u_ptr out_ptr n_levels", {"tree_ptr": "*fp64", "off_ptr": "*i64",
                                                                                "u_ptr": "*fp64", "out_ptr": "*i64"},
                                   idx), "BELOW_ONE": "constexpr", "F": "constexpr"},
                           {"BELOW_ONE": prefix_tree._BELOW_ONE, "F": FANOUT}))
    return out


_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def compile_variant(v: Variant, arch: int) -> dict:
    """Compile ``v`` for ``sm_<arch>``; returns registers, stack, shared and local (spill) bytes per thread, and
    the block-wide barriers (``bar.sync``) in its PTX."""
    if not isinstance(v.fn, JITFunction):
        raise RuntimeError("kernels are interpreted here (TRITON_INTERPRET=1): compile them in a process without it, "
                           "e.g. `python -m gpubuf.kernels.signatures 80 90`")
    kernel = triton.compile(ASTSource(fn=v.fn, signature=v.signature, constexprs=v.constexprs),
                            target=GPUTarget("cuda", arch, 32))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        report = subprocess.run([os.path.join(_BIN, "cuobjdump"), "--dump-resource-usage", f.name],
                                capture_output=True, text=True, check=True).stdout
    regs, stack, shared, local = map(int, _USAGE.search(report).groups())
    return {"kernel": v.label, "arch": f"sm_{arch}", "registers": regs, "stack": stack, "shared": shared,
            "local": local, "num_warps": kernel.metadata.num_warps, "barriers": kernel.asm["ptx"].count("bar.sync")}


def main(archs: list[int]) -> list[dict]:
    """Compile every variant for every arch; a failure becomes a row with an ``error``."""
    rows = []
    for arch in archs:
        for v in variants():
            try:
                rows.append(compile_variant(v, arch))
            except Exception as err:  # every failing variant is reported, not only the first
                rows.append({"kernel": v.label, "arch": f"sm_{arch}", "error": f"{type(err).__name__}: {err}"})
    return rows


if __name__ == "__main__":
    print(json.dumps(main([int(a) for a in sys.argv[1:]] or [80, 90])))
