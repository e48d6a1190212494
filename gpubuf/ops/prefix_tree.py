"""The wide prefix-sum tree's ops (Triton kernels in ``kernels/prefix_tree.py``): descent and leaf updates.

``tree`` is the flat float64 concatenation of the levels (leaves first; level ``k+1`` holds the sums of consecutive
groups of ``fanout`` entries of level ``k``; the top level is one node of ``fanout`` entries); ``offsets`` (K+1 ints)
bounds the K levels: level ``k`` is ``tree[offsets[k]:offsets[k+1]]``. The CPU implementations run the compiled host
loop when enabled, else the twin.
"""

import numpy as np
import torch

from gpubuf.ops import host_loops
from gpubuf.ops.device import LRU
from gpubuf.ops.registry import Op, kernel

_BELOW_ONE = 1.0 - 2.0**-52  # x * _BELOW_ONE < x for every positive normal float64 x
_SHARED = 4096  # tree levels up to this size are searched whole by sample_twin
_DENSE = 1024  # parent levels up to this size are recomputed whole by update_twin


_ASCENDING = LRU(16)  # (fanout, device) -> arange(fanout): 16 entries at most
_OFFSETS = LRU(16)  # tuple(offsets) -> int64 array, for the compiled loops


def offsets_array(offsets: list[int]) -> np.ndarray:
    """``offsets`` as an int64 numpy array (cached)."""
    key = tuple(offsets)
    return _OFFSETS.get(key, np.array, key, np.int64)


def _ascending(n: int, device: torch.device) -> torch.Tensor:
    """(n,) int64: 0, 1, ..., n-1."""
    return _ASCENDING.get((n, device), _make_ascending, n, device)


def _make_ascending(n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, device=device)


def sample_twin(tree: torch.Tensor, offsets: list[int], fanout: int, u: torch.Tensor, out: torch.Tensor) -> None:
    """out (B,) int64 = leaf of each uniform u (B,) float64 in [0, 1), by descent of the wide prefix-sum tree.

    At each level the sample takes the inclusive prefix sum of its node's children and moves to the first child whose
    prefix sum exceeds its remaining mass. Only a child of positive mass is ever chosen: when rounding (subnormal or
    huge masses) puts the remaining mass at or past the node's total, the last child of positive mass is taken. So,
    whenever the tree holds any mass, every returned leaf has positive mass (a valid start) and lies below the capacity
    (padding leaves are zero). On the host the descent runs unchecked first and the drawn leaves' masses are read once;
    only a draw that met a zero-mass leaf runs again, child by child checked.
    """
    if u.shape[0] == 0:
        return
    if tree.device.type != "cpu":
        _descend(tree, offsets, fanout, u, out, True)
        return
    try:
        _descend(tree, offsets, fanout, u, out, False)
        ok = bool((tree.index_select(0, out) > 0).all())
    except IndexError:  # rounding walked into a padding node, which has no children
        ok = False
    if not ok:
        _descend(tree, offsets, fanout, u, out, True)


def _descend(tree: torch.Tensor, offsets: list[int], fanout: int, u: torch.Tensor,
             out: torch.Tensor, checked: bool) -> None:
    """:func:`sample_twin`'s descent; ``checked``: step to the last child of positive mass wherever
    rounding lands on a child of zero mass (else only clamp to the node's children)."""
    F = fanout
    pick = _positive_child if checked else (lambda j, c: j.clamp_max_(c.shape[-1] - 1))
    # The lowest level holding at most _SHARED entries is searched whole: one cumsum shared by all
    # samples (bounded work, whatever the capacity), then the descent goes node by node below it.
    shared = 0
    while offsets[shared + 1] - offsets[shared] > max(_SHARED, F):
        shared += 1
    level = tree[offsets[shared]:offsets[shared + 1]]
    cs = level.cumsum(0)
    total = cs[-1]
    target = torch.minimum(u * total, total * _BELOW_ONE)
    node = pick(torch.searchsorted(cs, target, right=True), level)
    target = target.sub_(cs.sub_(level).index_select(0, node)).clamp_min_(0).unsqueeze_(1)  # (B, 1)
    base = tree.storage_offset()
    for k in range(shared - 1, -1, -1):
        children = tree.as_strided(((offsets[k + 1] - offsets[k]) // F, F), (F, 1), base + offsets[k])
        c = children.index_select(0, node)  # (B, F) children
        cs = c.cumsum(1)
        target = torch.minimum(target, cs[:, -1:] * _BELOW_ONE)  # stay below the node's mass
        j = pick(torch.searchsorted(cs, target, right=True), c)  # (B, 1)
        target = target.sub_(cs.sub_(c).gather(1, j)).clamp_min_(0)
        node = torch.add(j.view(-1), node, alpha=F)
    out.copy_(node)


def _positive_child(j: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``j`` (first child whose prefix sum exceeds the mass), replaced by the last child of positive
    mass in ``c`` (``(F,)`` or ``(B, F)``) wherever it is out of range or of zero mass."""
    F = c.shape[-1]
    j = j.clamp_max(F - 1)
    picked = c.gather(-1, j) if c.dim() == 2 else c.index_select(0, j)
    if c.device.type == "cpu" and not bool((picked <= 0).any()):
        return j  # the common case, checked for free on the host
    last = torch.where(c > 0, _ascending(F, c.device), -1).amax(-1, keepdim=True).clamp_min_(0)
    if c.dim() == 1:
        last = last.expand_as(j)
    return torch.where(picked > 0, j, last)


def sample_host(tree, offsets, fanout, u, out) -> None:
    """The CPU implementation: :func:`gpubuf.ops.host_loops.tree_sample` when compiled, else the twin."""
    if not host_loops.ENABLED:
        sample_twin(tree, offsets, fanout, u, out)
    elif u.shape[0]:
        host_loops.tree_sample(tree.numpy(), offsets_array(offsets), fanout, u.numpy(), out.numpy())


SAMPLE = Op("tree_sample", "(Tensor tree, int[] offsets, int fanout, Tensor u, Tensor(a!) out) -> ()",
            sample_twin, kernel("prefix_tree", "sample"), sample_host, host_loop=True)


def sample_masses_host(tree, offsets, fanout, u) -> tuple[torch.Tensor, torch.Tensor]:
    """``(leaves (B,) int64, masses (B,) float64)`` picked by uniforms ``u`` (B,) float64 of a host tree, by numba."""
    idx, mass = torch.empty(u.shape, dtype=torch.int64), torch.empty(u.shape, dtype=torch.float64)
    host_loops.tree_sample_masses(tree.numpy(), offsets_array(offsets), fanout, u.contiguous().numpy(), idx.numpy(),
                                  mass.numpy())
    return idx, mass


def update_twin(tree: torch.Tensor, offsets: list[int], fanout: int, idx: torch.Tensor, values: torch.Tensor) -> None:
    """Leaves ``tree[idx] = values`` (duplicate indices must carry equal values), then every touched parent, level by
    level, recomputed as the sum of its ``fanout`` children (idempotent: no atomics needed).

    Parent levels of at most ``max(_DENSE, len(idx))`` entries are recomputed whole (one reduction instead of a gather,
    a sum and a scatter of the touched parents): same values, untouched parents included."""
    K = idx.shape[0]
    if K == 0:
        return
    F = fanout
    tree.index_copy_(0, idx, values)
    node, base = idx, tree.storage_offset()
    for k in range(1, len(offsets) - 1):
        c0, p0 = offsets[k - 1], offsets[k]
        n = (p0 - c0) // F  # parents with children (the level's padding past them stays zero)
        children = tree.as_strided((n, F), (F, 1), base + c0)
        if n <= max(_DENSE, K):  # this level and every (smaller) one above it: whole
            torch.sum(children, 1, out=tree[p0:p0 + n])
            continue
        node = torch.div(node, F, rounding_mode="floor")
        tree[p0:p0 + n].index_copy_(0, node, children.index_select(0, node).sum(1))


def update_host(tree, offsets, fanout, idx, values) -> None:
    """The CPU implementation: :func:`gpubuf.ops.host_loops.tree_update` when compiled, else the twin."""
    if not host_loops.ENABLED:
        update_twin(tree, offsets, fanout, idx, values)
    elif idx.shape[0]:
        host_loops.tree_update(tree.numpy(), offsets_array(offsets), fanout, idx.numpy(), values.numpy())


UPDATE = Op("tree_update", "(Tensor(a!) tree, int[] offsets, int fanout, Tensor idx, Tensor values) -> ()",
            update_twin, kernel("prefix_tree", "update"), update_host, host_loop=True)


def update_range_twin(tree: torch.Tensor, offsets: list[int], fanout: int, lo: int, values: torch.Tensor) -> None:
    """Leaves ``tree[lo:lo+len(values)] = values``, then their parents (contiguous ranges) from their children."""
    a, b = lo, lo + values.shape[0]
    if a == b:
        return
    F = fanout
    tree[a:b].copy_(values)
    base = tree.storage_offset()
    for k in range(1, len(offsets) - 1):
        c0, p0 = offsets[k - 1], offsets[k]
        a, b = a // F, (b - 1) // F + 1
        torch.sum(tree.as_strided((b - a, F), (F, 1), base + c0 + a * F), 1, out=tree[p0 + a:p0 + b])


def update_range_host(tree, offsets, fanout, lo, values) -> None:
    """The CPU implementation: :func:`gpubuf.ops.host_loops.tree_update_range` when compiled, else the twin."""
    if not host_loops.ENABLED:
        update_range_twin(tree, offsets, fanout, lo, values)
    elif values.shape[0]:
        host_loops.tree_update_range(tree.numpy(), offsets_array(offsets), fanout, lo, values.numpy())


UPDATE_RANGE = Op("tree_update_range", "(Tensor(a!) tree, int[] offsets, int fanout, int lo, Tensor values) -> ()",
                  update_range_twin, kernel("prefix_tree", "update_range"), update_range_host, host_loop=True)
