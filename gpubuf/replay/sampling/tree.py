"""The wide prefix-sum tree the replay buffers sample from (uniform and prioritized alike).

One float64 mass per sequence start (``priority**alpha``, or 1 for uniform sampling, times 0/1 validity). Level ``k+1``
holds the sums of consecutive groups of ``fanout`` entries of level ``k``; the top level is a single node of ``fanout``
entries; all levels live in one flat tensor. Sampling walks the levels with a prefix sum over each visited node's
children; updating writes leaves, then recomputes only the touched parents from their children, so the tree is a
deterministic function of its leaves: float rounding cannot accumulate across updates, and a zero leaf is never sampled.
"""

import torch

from gpubuf.ops import Backend, allocate

FANOUT = 32


def level_sizes(capacity: int, fanout: int = FANOUT) -> list[int]:
    """Entries of each level of a tree over ``capacity`` leaves, leaves first: each level padded to a multiple of
    ``fanout``, up to a top level of ``fanout`` entries."""
    sizes = [max(1, -(-capacity // fanout)) * fanout]
    while sizes[-1] > fanout:
        sizes.append(-(-sizes[-1] // fanout // fanout) * fanout)
    return sizes


class PrefixSumTree:
    """Wide prefix-sum tree over ``capacity`` leaves on the device of backend ``table``, zero-filled: ``tree`` is
    its ``(size,)`` float64 storage, levels leaves-first; ``table`` runs its ops."""

    def __init__(self, capacity: int, table: Backend, fanout: int = FANOUT):
        self.capacity, self.fanout, self.device, self.table = capacity, fanout, table.device, table
        self.offsets = [0]
        for s in level_sizes(capacity, fanout):
            self.offsets.append(self.offsets[-1] + s)
        self.size = self.offsets[-1]
        self.tree = allocate({"tree": (self.size,)}, {"tree": torch.float64}, self.device)["tree"]

    def leaves(self, idx: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """(K,) float64 masses of leaves ``idx`` (K,) int64 (into ``out`` when given)."""
        return self.tree[idx] if out is None else torch.index_select(self.tree, 0, idx, out=out)

    def masses(self) -> torch.Tensor:
        """(capacity,) float64 copy of every leaf."""
        return self.tree[:self.capacity].clone()

    def total(self) -> torch.Tensor:
        """0-d float64: the mass of every leaf."""
        return self.tree[self.offsets[-2]:].sum()

    def update(self, idx: torch.Tensor, values: torch.Tensor) -> None:
        """Leaves ``idx`` (K,) int64 = ``values`` (K,) float64 (equal values for duplicates), then their parents."""
        self.table.tree_update(self.tree, self.offsets, self.fanout, idx, values)

    def update_range(self, lo: int, values: torch.Tensor) -> None:
        """Leaves ``[lo, lo + len(values))`` = values, then their (contiguous) parents."""
        self.table.tree_update_range(self.tree, self.offsets, self.fanout, int(lo), values)

    def sample(self, u: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """(B,) int64 leaves picked by uniforms ``u`` (B,) float64 in [0, 1), in proportion to their
        mass (into ``out`` when given: no allocation, as a captured CUDA graph needs)."""
        if out is None:
            out = torch.empty(u.shape, dtype=torch.int64, device=self.device)
        self.table.tree_sample(self.tree, self.offsets, self.fanout, u, out)
        return out

    def sample_masses(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(leaves (B,) int64, masses (B,) float64)`` picked by uniforms ``u`` (B,) float64 (CPU: a compiled loop)."""
        return self.table.tree_sample_masses(self.tree, self.offsets, self.fanout, u)
