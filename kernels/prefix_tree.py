"""Triton kernels of the wide prefix-sum tree behind TransitionBuffer / PrioritizedTransitionBuffer.

The tree's layout (levels leaves-first, bounded by ``offsets``, fan-out ``F``):
:mod:`gpubuf.ops.prefix_tree`. Runtime sizes are plain arguments; only ``F`` and block sizes are
``tl.constexpr``. Offsets are int64. Updates of many leaves run one many-program launch per level
(see :data:`MANY_PROGRAMS_FROM`); smaller ones one single-program launch.
"""

import torch
import triton
import triton.language as tl

import gpubuf.kernels as _pkg
from gpubuf.kernels import INDEX, Variant, variant

# the fan-out compiled ahead of time: the buffers' trees use it (gpubuf.replay.sampling.tree.FANOUT)
FANOUT = 32
BLOCK = 1024  # leaves written per step of the update kernel
PARENTS = 32  # parents recomputed per step (PARENTS * fanout children)
# Updates of this many leaves or more run one launch per level, each spread over many programs: one
# program walks each level's touched parents P at a time (dependent loads, one step after another),
# so 4,096 scattered priorities on 2**24 leaves cost it 4 levels * 128 steps and a full rebuild
# ~10**4 steps a level, while a many-program level costs one launch whatever its size. Below it, one
# launch (at most 16 steps a level) beats K launches.
MANY_PROGRAMS_FROM = 512
_BELOW_ONE = 1.0 - 2.0**-52  # x * _BELOW_ONE < x for every positive normal float64 x


@triton.jit
def _sample_kernel(
    tree_ptr,  # (size,) float64 levels, leaves first
    off_ptr,  # (K+1,) int64 level bounds
    u_ptr,  # (B,) float64 uniforms in [0, 1)
    out_ptr,  # (B,) int64 sampled leaf per uniform
    n_levels,  # K
    BELOW_ONE: tl.constexpr,
    F: tl.constexpr,  # fan-out
):
    b = tl.program_id(0)
    ar = tl.arange(0, F)
    top = tl.load(off_ptr + n_levels - 1)
    total = tl.max(tl.cumsum(tl.load(tree_ptr + top + ar), 0), 0)
    target = tl.load(u_ptr + b) * total
    node = tl.load(off_ptr) * 0  # int64 zero: the top level's only node
    for i in range(0, n_levels):
        off = tl.load(off_ptr + n_levels - 1 - i)
        c = tl.load(tree_ptr + off + node * F + ar)  # (F,) children of this sample's node
        cs = tl.cumsum(c, 0)
        target = tl.minimum(target, tl.max(cs, 0) * BELOW_ONE)  # stay below the node's mass
        below = cs <= target  # children entirely below the remaining mass
        j = tl.minimum(tl.sum(below.to(tl.int64), 0), F - 1)
        # rounding (subnormal or huge masses) can leave j on a zero-mass child: take the last
        # positive one
        picked = tl.sum(tl.where(ar == j, c, 0.0), 0)
        last = tl.max(tl.where(c > 0, ar, 0), 0)
        j = tl.where(picked > 0, j, last)
        prev = tl.sum(tl.where(ar == j, cs - c, 0.0), 0)  # exclusive prefix sum at the chosen child
        target = tl.maximum(target - prev, 0.0)
        node = node * F + j
    tl.store(out_ptr + b, node)


@triton.jit
def _update_kernel(
    tree_ptr,  # (size,) float64 levels, leaves first
    off_ptr,  # (K+1,) int64 level bounds
    idx_ptr,  # (n,) int64 leaf indices (duplicates carry equal values); unused when RANGE
    val_ptr,  # (n,) float64 new leaf values
    n,  # leaves written
    lo,  # first leaf when RANGE: leaves [lo, lo + n)
    k0,  # first level done: 0 = the leaves, k >= 1 = the parents on level k
    k1,  # levels [k0, k1) are done, in order
    F: tl.constexpr,  # fan-out
    RANGE: tl.constexpr,  # leaves are the contiguous range [lo, lo + n) instead of idx
    BLOCK: tl.constexpr,  # leaves written per step
    P: tl.constexpr,  # parents recomputed per step (P * F children loaded)
):
    # Levels k0 .. k1-1, level after level: parents are recomputed from their children
    # (no atomics, so the tree stays a deterministic function of its leaves). The programs of the
    # grid share each level's work; a block-wide barrier orders the levels of a one-program launch,
    # and a many-program launch does one level (launches on one stream are ordered). Duplicate
    # parents store equal values.
    if k0 == 0:
        _write_leaves(tree_ptr, idx_ptr, val_ptr, n, lo, RANGE, BLOCK)
        tl.debug_barrier()
    div = tl.load(off_ptr) * 0 + 1  # int64 F**level: leaf // div = its ancestor on that level
    for k in range(1, k1):
        div = div * F
        if k >= k0:
            _sum_level(tree_ptr, off_ptr, idx_ptr, n, lo, k, div, F, RANGE, P)
            tl.debug_barrier()


@triton.jit
def _write_leaves(tree_ptr, idx_ptr, val_ptr, n, lo, RANGE: tl.constexpr, BLOCK: tl.constexpr):
    """Leaves ``tree[idx or lo + arange(n)] = val (n,)``, a strided loop over the grid's
    programs."""
    ar = tl.arange(0, BLOCK)
    for s in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = s + ar
        mask = offs < n
        if RANGE:
            i = lo + offs
        else:
            i = tl.load(idx_ptr + offs, mask=mask, other=0)
        tl.store(tree_ptr + i, tl.load(val_ptr + offs, mask=mask), mask=mask)


@triton.jit
def _sum_level(tree_ptr, off_ptr, idx_ptr, n, lo, k, div, F: tl.constexpr, RANGE: tl.constexpr,
               P: tl.constexpr):
    """Every touched parent on level ``k`` (``div = F**k`` leaves under each) = the sum of its ``F``
    children on level ``k - 1``, ``P`` parents per step of a strided loop over the grid's
    programs."""
    child_off = tl.load(off_ptr + k - 1)
    parent_off = tl.load(off_ptr + k)
    if RANGE:  # the touched parents are one contiguous range
        first = lo // div
        count = (lo + n - 1) // div - first + 1
    else:
        first = div * 0
        count = div * 0 + n
    ap = tl.arange(0, P)
    af = tl.arange(0, F)
    for q in range(tl.program_id(0) * P, count, tl.num_programs(0) * P):
        offs = q + ap
        mask = offs < count
        if RANGE:
            parent = first + offs
        else:
            parent = tl.load(idx_ptr + offs, mask=mask, other=0) // div
        c = tl.load(tree_ptr + child_off + parent[:, None] * F + af[None, :], mask=mask[:, None],
                    other=0.0)
        tl.store(tree_ptr + parent_off + parent, tl.sum(c, 1), mask=mask)


def sample(tree: torch.Tensor, offsets: list[int], fanout: int, u: torch.Tensor,
           out: torch.Tensor) -> None:
    """out (B,) int64 = leaves picked by uniforms u (B,) float64; one program per sample."""
    B = u.shape[0]
    if B == 0:
        return
    with _pkg.on_device(tree):
        off = _offsets(offsets, tree.device)
        _sample_kernel[(B,)](tree, off, u, out, len(offsets) - 1, BELOW_ONE=_BELOW_ONE, F=fanout)


def update(tree: torch.Tensor, offsets: list[int], fanout: int, idx: torch.Tensor,
           values: torch.Tensor) -> None:
    """Leaves ``tree[idx (n,)] = values (n,)``, then every touched parent: one launch below
    :data:`MANY_PROGRAMS_FROM` leaves, else one many-program launch per level."""
    if idx.shape[0]:
        _launch(tree, offsets, fanout, idx, values, 0, False)


def update_range(tree: torch.Tensor, offsets: list[int], fanout: int, lo: int,
                 values: torch.Tensor) -> None:
    """Leaves ``tree[lo:lo + n] = values (n,)``, then their (contiguous) parents; launches as
    :func:`update`."""
    if values.shape[0]:
        _launch(tree, offsets, fanout, values, values, lo, True)


def level_grids(n: int, lo: int, offsets: list[int], fanout: int, is_range: bool) -> list[int]:
    """Programs per level of a many-program update of ``n`` leaves (level 0 = the leaves): enough
    that each program writes one block of leaves or recomputes :data:`PARENTS` parents."""
    grids = [triton.cdiv(n, BLOCK)]
    for k in range(1, len(offsets) - 1):
        div = fanout**k
        count = (lo + n - 1) // div - lo // div + 1 if is_range else n
        grids.append(triton.cdiv(count, PARENTS))
    return grids


def _launch(tree, offsets, fanout, idx, values, lo, is_range) -> None:
    n, K = values.shape[0], len(offsets) - 1
    with _pkg.on_device(tree):
        off = _offsets(offsets, tree.device)
        if n < MANY_PROGRAMS_FROM:
            _update_kernel[(1,)](tree, off, idx, values, n, lo, 0, K, F=fanout, RANGE=is_range,
                                 BLOCK=BLOCK, P=PARENTS)
            return
        for k, programs in enumerate(level_grids(n, lo, offsets, fanout, is_range)):
            _update_kernel[(programs,)](tree, off, idx, values, n, lo, k, k + 1, F=fanout,
                                        RANGE=is_range, BLOCK=BLOCK, P=PARENTS)


_OFFSETS: dict[tuple, torch.Tensor] = {}


def _offsets(offsets: list[int], device: torch.device) -> torch.Tensor:
    """A cached device copy of the level bounds (uploaded once per tree shape)."""
    key = (tuple(offsets), device)
    if key not in _OFFSETS:
        _OFFSETS[key] = torch.tensor(offsets, dtype=torch.int64, device=device)
    return _OFFSETS[key]


def variants() -> list[Variant]:
    """Every (kernel, signature, constexprs) the launchers above compile for :data:`FANOUT`: per
    index width, the update over scattered leaves and over a range, and the descent."""
    out = []
    for idx in INDEX:
        for is_range in (False, True):
            types = {"tree_ptr": "*fp64", "off_ptr": "*i64", "val_ptr": "*fp64",
                     "idx_ptr": "*fp64" if is_range else "*i64"}
            out.append(variant("prefix_tree.update", _update_kernel,
                               "tree_ptr off_ptr idx_ptr val_ptr n lo k0 k1", types, idx,
                               {"F": FANOUT, "RANGE": is_range, "BLOCK": BLOCK, "P": PARENTS}))
        types = {"tree_ptr": "*fp64", "off_ptr": "*i64", "u_ptr": "*fp64", "out_ptr": "*i64"}
        out.append(variant("prefix_tree.sample", _sample_kernel,
                           "tree_ptr off_ptr u_ptr out_ptr n_levels", types, idx,
                           {"BELOW_ONE": _BELOW_ONE, "F": FANOUT}))
    return out
