"""Triton kernel of TransitionBuffer's window gather: ``(B, n_steps)`` rows from time-major storage
(the rows: :mod:`gpubuf.ops.sequence`; ``shift = 1`` reads the following rows, next observations).
Runtime sizes are plain arguments; offsets are int64.
"""

import torch
import triton
import triton.language as tl

import gpubuf.kernels as _pkg
from gpubuf.kernels import INDEX, Variant, upload, variant, word_groups
from gpubuf.kernels.tables import table_entry
from gpubuf.kernels.words import WORDS

BLOCK = 1024


@triton.jit
def _gather_kernel(
    # (G, 4) int64 per leaf: storage address (M * E, D), output address (B, n, D), D words, shift
    table_ptr,
    start_ptr,  # (B,) int64 flat starts step * E + env
    like_ptr,  # any tensor of the group's word type
    n,  # window length
    E,  # envs
    M,  # rows per env
    BLOCK: tl.constexpr,
):
    # the grid of history's frame gather ((row, step) x pair x chunk), read the same way on purpose
    bj = tl.program_id(0)  # b * n + j
    g = tl.program_id(1)  # leaf
    b = bj // n
    j = bj % n
    src, dst, D = table_entry(table_ptr, g, 4, like_ptr)
    shift = tl.load(table_ptr + 4 * g + 3)  # 0, or 1 for next observations
    offs = tl.program_id(2).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D  # last chunk of the row is partial
    s = tl.load(start_ptr + b)
    row = ((s // E + j + shift) % M) * E + s % E
    x = tl.load(src + row * D + offs, mask=mask)
    tl.store(dst + bj.to(tl.int64) * D + offs, x, mask=mask)


def tables(jobs: list, B: int, n: int,
         device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """``(word-typed anchor, device table, most words per row)`` per word type for
    :func:`gather_from_tables`: the tables live in their own device tensors, so they can be launched
    again (or captured in a CUDA graph) while the ``jobs`` tensors stay where they are."""
    groups = word_groups([(storage, out.view(B * n, -1)) for storage, out, _ in jobs],
                         [(s,) for _, _, s in jobs])
    return [(like, torch.from_numpy(table).to(device), most) for like, table, most in groups]


def gather_from_tables(groups: list, starts: torch.Tensor, n: int, E: int, M: int) -> None:
    """Launch the gather of :func:`tables` for flat starts (B,) int64."""
    B = starts.shape[0]
    with _pkg.on_device(starts):
        for like, table, most in groups:
            grid = (B * n, table.shape[0], triton.cdiv(most, BLOCK))
            _gather_kernel[grid](table, starts, like, n, E, M, BLOCK=BLOCK)


def gather(jobs: list, starts: torch.Tensor, n: int, E: int, M: int) -> None:
    """For each ``(storage (M*E, D), out (B, n, D), shift)`` in ``jobs``: out = the n-row windows of
    storage at flat starts (B,) int64, shifted by ``shift``. One launch per word type."""
    B = starts.shape[0]
    if B == 0:
        return
    groups = word_groups([(storage, out.view(B * n, -1)) for storage, out, _ in jobs],
                         [(s,) for _, _, s in jobs])
    with _pkg.on_device(starts):
        for like, table, most in groups:
            grid = (B * n, table.shape[0], triton.cdiv(most, BLOCK))
            _gather_kernel[grid](upload(table, starts.device), starts, like, n, E, M, BLOCK=BLOCK)


def variants() -> list[Variant]:
    """Every (kernel, signature, constexprs) the launchers above compile: per index width and word
    type."""
    return [variant("sequence.gather", _gather_kernel, "table_ptr start_ptr like_ptr n E M",
                    {"table_ptr": "*i64", "start_ptr": "*i64", "like_ptr": f"*{w}"}, idx,
                    {"BLOCK": BLOCK})
            for idx in INDEX for w in WORDS]
