"""Triton kernels of the wide prefix-sum tree behind TransitionBuffer / PrioritizedTransitionBuffer.

The tree is one flat float64 tensor holding its levels leaves-first; ``offsets`` (K+1 ints) bound the K
levels, level ``k+1`` holds the sums of consecutive groups of ``F`` (fan-out) entries of level ``k``, and
the top level is a single node of ``F`` entries. Runtime sizes are plain arguments; only ``F`` and block
sizes are ``tl.constexpr``. Offsets are int64.
"""

import torch
import triton
import triton.language as tl

BLOCK = 256
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
        # rounding (subnormal or huge masses) can leave j on a zero-mass child: take the last positive one
        picked = tl.sum(tl.where(ar == j, c, 0.0), 0)
        last = tl.max(tl.where(c > 0, ar, 0), 0)
        j = tl.where(picked > 0, j, last)
        prev = tl.sum(tl.where(ar == j, cs - c, 0.0), 0)  # exclusive prefix sum at the chosen child
        target = tl.maximum(target - prev, 0.0)
        node = node * F + j
    tl.store(out_ptr + b, node)


@triton.jit
def _write_leaves_kernel(
    tree_ptr,  # (size,) float64; leaves are its first entries
    idx_ptr,  # (K,) int64 leaf indices (duplicates carry equal values)
    val_ptr,  # (K,) float64 new leaf values
    K,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < K
    i = tl.load(idx_ptr + offs, mask=mask, other=0)
    v = tl.load(val_ptr + offs, mask=mask)
    tl.store(tree_ptr + i, v, mask=mask)


@triton.jit
def _update_parents_kernel(
    tree_ptr,  # (size,) float64
    idx_ptr,  # (K,) int64 touched leaf indices
    child_off,  # start of the child level
    parent_off,  # start of the parent level
    div,  # F**level: leaf index // div = parent index
    F: tl.constexpr,
):
    parent = tl.load(idx_ptr + tl.program_id(0)) // div
    c = tl.load(tree_ptr + child_off + parent * F + tl.arange(0, F))  # (F,) children
    tl.store(tree_ptr + parent_off + parent, tl.sum(c, 0))


def sample(tree: torch.Tensor, offsets: list[int], fanout: int, u: torch.Tensor, out: torch.Tensor) -> None:
    """out (B,) int64 = leaves picked by uniforms u (B,) float64; one program per sample."""
    B = u.shape[0]
    if B == 0:
        return
    off = _offsets(offsets, tree.device)
    _sample_kernel[(B,)](tree, off, u, out, len(offsets) - 1, BELOW_ONE=_BELOW_ONE, F=fanout)


def update(tree: torch.Tensor, offsets: list[int], fanout: int, idx: torch.Tensor, values: torch.Tensor) -> None:
    """Leaves ``tree[idx] = values``, then one launch per level recomputing the touched parents."""
    K = idx.shape[0]
    if K == 0:
        return
    _write_leaves_kernel[(triton.cdiv(K, BLOCK),)](tree, idx, values, K, BLOCK=BLOCK)
    for k in range(1, len(offsets) - 1):
        _update_parents_kernel[(K,)](tree, idx, offsets[k - 1], offsets[k], fanout**k, F=fanout)


_OFFSETS: dict[tuple, torch.Tensor] = {}


def _offsets(offsets: list[int], device: torch.device) -> torch.Tensor:
    """A cached device copy of the level bounds (uploaded once per tree shape)."""
    key = (tuple(offsets), device)
    if key not in _OFFSETS:
        _OFFSETS[key] = torch.tensor(offsets, dtype=torch.int64, device=device)
    return _OFFSETS[key]
