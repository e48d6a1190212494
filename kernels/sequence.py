"""Triton kernel of TransitionBuffer's window gather: ``(B, n_steps)`` rows from time-major storage.

Storage of one leaf is a contiguous ``(M * E, D)`` tensor (row ``step * E + env``). A flat start
``s = step * E + env`` yields the rows ``((step + j + shift) % M) * E + env`` for ``j < n``; ``shift = 1``
reads the following rows (next observations). Runtime sizes are plain arguments; offsets are int64.
"""

import torch
import triton
import triton.language as tl

from gpubuf.reference import as_words

BLOCK = 1024


@triton.jit
def _gather_kernel(
    src_ptr,  # (M * E, D) storage, contiguous
    dst_ptr,  # (B, n, D) output, contiguous
    start_ptr,  # (B,) int64 flat starts step * E + env
    n,  # window length
    E,  # envs
    M,  # rows per env
    shift,  # 0, or 1 for next observations
    D,  # words per row
    BLOCK: tl.constexpr,
):
    bj = tl.program_id(0)  # b * n + j
    b = bj // n
    j = bj % n
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D  # last chunk of the row is partial
    s = tl.load(start_ptr + b)
    row = ((s // E + j + shift) % M) * E + s % E
    x = tl.load(src_ptr + row * D + offs, mask=mask)
    tl.store(dst_ptr + bj.to(tl.int64) * D + offs, x, mask=mask)


def gather(jobs: list, starts: torch.Tensor, n: int, E: int, M: int) -> None:
    """For each ``(storage (M*E, D), out (B, n, D), shift)`` in ``jobs``: out = the n-row windows of storage
    at flat starts (B,) int64, shifted by ``shift``. One launch per job."""
    B = starts.shape[0]
    for storage, out, shift in jobs:
        if B == 0 or storage.shape[1] == 0:
            continue
        src, dst = as_words(storage, out.view(B * n, -1))
        D = src.shape[1]
        grid = (B * n, triton.cdiv(D, BLOCK))
        _gather_kernel[grid](src, dst, starts, n, E, M, shift, D, BLOCK=BLOCK)
