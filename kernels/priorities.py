"""Triton kernel of the checked priority write behind PrioritizedTransitionBuffer.

Priorities are ``(size,)`` float32, TD errors ``td`` float32 or float64; the write and its checks
are those of :mod:`gpubuf.ops.priorities` (the bits :data:`~gpubuf.kernels.BAD_INDEX`,
:data:`~gpubuf.kernels.NOT_FINITE`, :data:`~gpubuf.kernels.OVERFLOW`), the trees left to the
caller; nothing is read back. One program: the checks see every value before anything is written.
"""

import numpy as np
import torch
import triton
import triton.language as tl

import gpubuf.kernels as _pkg
from gpubuf.kernels import BAD_INDEX, INDEX, NOT_FINITE, OVERFLOW, Variant, variant

BLOCK = 1024  # starts checked and written per step
_FLOAT32_MAX = float(np.finfo(np.float32).max)


@triton.jit
def _write_kernel(
    prio_ptr,  # (size,) float32 priorities
    idx_ptr,  # (n,) int64 flat starts
    td_ptr,  # (n,) float32 or float64 TD errors
    box_ptr,  # (1,) float32 or float64 running maximum priority
    result_ptr,  # (2,) float64: code, largest finite new priority
    n,  # starts written
    size,  # priorities held
    eps,  # float32 added to |td|
    limit,  # float32: a new priority at or above it overflows the sampling mass
    BAD: tl.constexpr,
    NAN: tl.constexpr,
    OVER: tl.constexpr,
    F32_MAX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    ar = tl.arange(0, BLOCK)
    bad = tl.zeros((BLOCK,), tl.int32)
    nonfinite = tl.zeros((BLOCK,), tl.int32)
    top = tl.zeros((BLOCK,), tl.float32)
    for s in range(0, n, BLOCK):
        offs = s + ar
        mask = offs < n
        i = tl.load(idx_ptr + offs, mask=mask, other=0)
        v = tl.abs(tl.load(td_ptr + offs, mask=mask, other=0.0).to(tl.float32)) + eps
        finite = tl.abs(v) <= F32_MAX  # NaN compares false
        bad = tl.maximum(bad, (mask & ((i < 0) | (i >= size))).to(tl.int32))
        nonfinite = tl.maximum(nonfinite, (mask & (finite == 0)).to(tl.int32))
        top = tl.maximum(top, tl.where(mask & finite, v, 0.0))
    big = tl.max(top, 0)
    code = tl.max(bad, 0) * BAD + tl.max(nonfinite, 0) * NAN
    code = tl.where((code == 0) & (big >= limit), OVER, code)
    if code == 0:
        for s in range(0, n, BLOCK):  # one of each duplicate's values, then their largest
            offs = s + ar
            mask = offs < n
            i = tl.load(idx_ptr + offs, mask=mask, other=0)
            v = tl.abs(tl.load(td_ptr + offs, mask=mask, other=0.0).to(tl.float32)) + eps
            tl.store(prio_ptr + i, v, mask=mask)
        tl.debug_barrier()
        for s in range(0, n, BLOCK):
            offs = s + ar
            mask = offs < n
            i = tl.load(idx_ptr + offs, mask=mask, other=0)
            v = tl.abs(tl.load(td_ptr + offs, mask=mask, other=0.0).to(tl.float32)) + eps
            tl.atomic_max(prio_ptr + i, v, mask=mask)
        box = tl.load(box_ptr)
        tl.store(box_ptr, tl.maximum(box, big.to(box.dtype)))
    tl.store(result_ptr, code.to(tl.float64))
    tl.store(result_ptr + 1, big.to(tl.float64))


def float32_bound(limit: float) -> float:
    """The smallest float32 at or above ``limit`` (inf past the largest float32): a float32
    priority reaches ``limit`` exactly when it reaches this bound."""
    if limit > _FLOAT32_MAX:
        return float("inf")
    bound = np.float32(limit)
    if float(bound) < limit:
        bound = np.nextafter(bound, np.float32(np.inf))
    return float(bound)


def write(priority: torch.Tensor, idx: torch.Tensor, td: torch.Tensor, eps: float, limit: float,
          box: torch.Tensor, result: torch.Tensor) -> None:
    """The checked write of ``td`` (n,) at ``idx`` (n,) into ``priority`` (size,), raising ``box``
    (1,); ``result`` (2,) float64 = (code, largest finite new priority). One program."""
    with _pkg.on_device(priority):
        _write_kernel[(1,)](priority, idx, td, box, result, idx.shape[0], priority.shape[0], eps,
                            float32_bound(limit), BAD=BAD_INDEX, NAN=NOT_FINITE, OVER=OVERFLOW,
                            F32_MAX=_FLOAT32_MAX, BLOCK=BLOCK)


def variants() -> list[Variant]:
    """Every (signature, constexprs) :func:`write` compiles: per index width, TD errors and
    running maximum in float32 or float64."""
    names = "prio_ptr idx_ptr td_ptr box_ptr result_ptr n size eps limit"
    consts = {"BAD": BAD_INDEX, "NAN": NOT_FINITE, "OVER": OVERFLOW, "F32_MAX": _FLOAT32_MAX,
              "BLOCK": BLOCK}
    out = []
    for idx in INDEX:
        for td in ("*fp32", "*fp64"):
            for box in ("*fp32", "*fp64"):
                types = {"prio_ptr": "*fp32", "idx_ptr": "*i64", "td_ptr": td, "box_ptr": box,
                         "result_ptr": "*fp64", "eps": "fp32", "limit": "fp32"}
                out.append(variant("priorities.write", _write_kernel, names, types, idx, consts))
    return out
