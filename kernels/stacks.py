"""Triton kernels of replay frame stacks and n-step returns, built from single stored frames.

Storage of one leaf is a contiguous time-major ``(M * E, D)`` tensor (row ``step * E + env``);
``marks`` is ``(M * E,)`` uint8 of the same rows (``MARK_*`` bits); ``held`` is ``(2,)`` int64, the
oldest row held and the rows held (device values, so a captured CUDA graph reads them as they are
when it replays). The stack and return rules: :mod:`gpubuf.ops.stacks`.
"""

import torch
import triton
import triton.language as tl

import gpubuf.kernels as _pkg
from gpubuf.kernels import (
    INDEX,
    MARK_BOUNDARY,
    MARK_STOP,
    MARK_TERM,
    Variant,
    upload,
    variant,
    word_groups,
)
from gpubuf.kernels.tables import table_entry
from gpubuf.kernels.words import WORDS

BLOCK = 1024
# the mark bits as compile-time constants (a kernel reads only constexpr globals)
_TERM, _STOP = tl.constexpr(MARK_TERM), tl.constexpr(MARK_STOP)
_BOUNDARY = tl.constexpr(MARK_BOUNDARY)
REWARDS = ("fp16", "bf16", "fp32", "fp64", "i8", "u8", "i16", "i32", "i64")


@triton.jit
def _stack_kernel(
    # (G, 4) int64 per leaf: storage address (M * E, D), output address (B * n * k, D), D words,
    # row shift
    table_ptr,
    start_ptr,  # (B,) int64 flat starts step * E + env
    marks_ptr,  # (M * E,) uint8 row marks
    held_ptr,  # (2,) int64: oldest row held, rows held
    like_ptr,  # any tensor of the group's word type
    n,  # window rows
    k,  # frames per stack
    stride,  # rows between stacked frames
    E,  # envs
    M,  # rows per env
    BLOCK: tl.constexpr,
):
    bjq = tl.program_id(0)  # (b * n + j) * k + q
    g = tl.program_id(1)  # leaf
    q = bjq % k
    b = bjq // k // n
    j = bjq // k % n
    src, dst, D = table_entry(table_ptr, g, 4, like_ptr)
    shift = tl.load(table_ptr + 4 * g + 3)
    s = tl.load(start_ptr + b)
    env = s % E
    t = (s // E + j + shift) % M  # the row the stack ends at
    age = (t - tl.load(held_ptr) + M) % M  # held rows before t
    reach = (k - 1 - q) * stride
    back = reach * 0  # rows this frame may go back: stops at an episode end or the oldest row
    for i in range(0, reach):
        mark = tl.load(marks_ptr + ((t - i - 1 + M) % M) * E + env)
        ok = (back == i) & (i < age) & ((mark & _BOUNDARY) == 0)
        back = tl.where(ok, i + 1, back)
    row = ((t - back + M) % M) * E + env
    offs = tl.program_id(2).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(src + row * D + offs, mask=mask)
    tl.store(dst + bjq.to(tl.int64) * D + offs, x, mask=mask)


@triton.jit
def _return_kernel(
    start_ptr,  # (B,) int64 flat starts
    reward_ptr,  # (M * E,) rewards
    marks_ptr,  # (M * E,) uint8 row marks
    held_ptr,  # (2,) int64: oldest row held, rows held
    ret_ptr,  # (B,) float out: discounted sum of the rewards taken
    disc_ptr,  # (B,) float out: the bootstrap value's factor
    boot_ptr,  # (B,) int64 out: flat row of the bootstrap observation
    term_ptr,  # (B,) uint8 out: the rewards taken end in a termination
    cut_ptr,  # (B,) uint8 out: fewer than n rewards taken, no termination
    gamma_ptr,  # (1,) float64 discount per step (a device value: Triton passes floats as fp32)
    n,  # rewards at most
    E,  # envs
    M,  # rows per env
):
    b = tl.program_id(0)
    gamma = tl.load(gamma_ptr)
    s = tl.load(start_ptr + b)
    env = s % E
    r = s // E
    age = (r - tl.load(held_ptr) + M) % M
    avail = tl.load(held_ptr + 1) - 1 - age  # held rows after the start
    total = gamma * 0.0
    factor = gamma * 0.0 + 1.0  # gamma ** rewards taken
    m = avail * 0
    alive = avail * 0 + 1
    ended = avail * 0
    for i in range(0, n):
        row = ((r + i) % M) * E + env
        mark = tl.load(marks_ptr + row)
        # a truncation stops the return before its row, unless the row also terminated
        stop = ((i >= 1) & ((mark & _STOP) != 0) & ((mark & _TERM) == 0)) | (i >= avail)
        alive = tl.where(stop, 0, alive)
        reward = tl.load(reward_ptr + row).to(tl.float64)
        total = tl.where(alive != 0, total + factor * reward, total)
        factor = tl.where(alive != 0, factor * gamma, factor)
        m = m + alive
        end = (alive != 0) & ((mark & _TERM) != 0)
        ended = tl.where(end, 1, ended)
        alive = tl.where(end, 0, alive)
    tl.store(ret_ptr + b, total.to(ret_ptr.dtype.element_ty))
    tl.store(disc_ptr + b, tl.where(ended != 0, 0.0, factor).to(disc_ptr.dtype.element_ty))
    tl.store(boot_ptr + b, ((r + m) % M) * E + env)
    tl.store(term_ptr + b, ended.to(tl.uint8))
    tl.store(cut_ptr + b, ((ended == 0) & (m < n)).to(tl.uint8))


def tables(jobs: list, B: int, n: int, k: int, device: torch.device) -> list:
    """``(word-typed anchor, device table, most words per row)`` per word type for
    :func:`stack_from_tables`, for ``(storage (M*E, D), out (B, n, k, D), shift)`` ``jobs``: tables
    live in their own device tensors (they can be launched again, or captured in a CUDA graph)."""
    groups = word_groups([(storage, out.view(B * n * k, -1)) for storage, out, _ in jobs],
                         [(s,) for _, _, s in jobs])
    return [(like, torch.from_numpy(table).to(device), most) for like, table, most in groups]


def stack_from_tables(groups: list, starts: torch.Tensor, marks: torch.Tensor, held: torch.Tensor,
                      n: int, k: int, stride: int, E: int, M: int) -> None:
    """Launch the stack gather of :func:`tables` for flat starts (B,) int64."""
    B = starts.shape[0]
    if B == 0:
        return
    with _pkg.on_device(starts):
        for like, table, most in groups:
            grid = (B * n * k, table.shape[0], triton.cdiv(most, BLOCK))
            _stack_kernel[grid](table, starts, marks, held, like, n, k, stride, E, M, BLOCK=BLOCK)


def stack(jobs: list, starts: torch.Tensor, marks: torch.Tensor, held: torch.Tensor, n: int,
          k: int, stride: int, E: int, M: int) -> None:
    """For each ``(storage (M*E, D), out (B, n, k, D), shift)`` in ``jobs``: the ``k``-frame stacks
    (stride ``stride``) ending at the rows of the n-row windows of flat starts (B,), shifted by
    ``shift``. One launch per word type."""
    B = starts.shape[0]
    if B == 0:
        return
    groups = word_groups([(storage, out.view(B * n * k, -1)) for storage, out, _ in jobs],
                         [(s,) for _, _, s in jobs])
    with _pkg.on_device(starts):
        for like, table, most in groups:
            grid = (B * n * k, table.shape[0], triton.cdiv(most, BLOCK))
            _stack_kernel[grid](upload(table, starts.device), starts, marks, held, like, n, k,
                                stride, E, M, BLOCK=BLOCK)


def returns(starts: torch.Tensor, reward: torch.Tensor, marks: torch.Tensor, held: torch.Tensor,
            outs: tuple, gamma: torch.Tensor, n: int, E: int, M: int) -> None:
    """n-step returns of flat starts (B,) into ``outs`` = (return, discount, bootstrap row,
    terminated, cut) (B,) (float, float, int64, uint8, uint8); ``gamma`` (1,) float64. One
    launch."""
    B = starts.shape[0]
    if B == 0:
        return
    ret, disc, boot, term, cut = outs
    with _pkg.on_device(starts):
        _return_kernel[(B,)](starts, reward, marks, held, ret, disc, boot, term, cut, gamma,
                             n, E, M)


def variants() -> list[Variant]:
    """Every (kernel, signature, constexprs) the launchers above compile: per index width, word
    type, reward type and return precision."""
    stacks = [variant("stacks.stack", _stack_kernel,
                      "table_ptr start_ptr marks_ptr held_ptr like_ptr n k stride E M",
                      {"table_ptr": "*i64", "start_ptr": "*i64", "marks_ptr": "*u8",
                       "held_ptr": "*i64", "like_ptr": f"*{w}"}, idx, {"BLOCK": BLOCK})
              for idx in INDEX for w in WORDS]
    names = "start_ptr reward_ptr marks_ptr held_ptr ret_ptr disc_ptr boot_ptr term_ptr cut_ptr " \
            "gamma_ptr n E M"
    rets = [variant("stacks.returns", _return_kernel, names,
                    {"start_ptr": "*i64", "reward_ptr": f"*{r}", "marks_ptr": "*u8",
                     "held_ptr": "*i64", "ret_ptr": f"*{f}", "disc_ptr": f"*{f}",
                     "boot_ptr": "*i64", "term_ptr": "*u8", "cut_ptr": "*u8", "gamma_ptr": "*fp64"},
                    idx)
            for idx in INDEX for r in REWARDS for f in (("fp64",) if r == "fp64" else ("fp32",))]
    return stacks + rets
