"""torchrl's own prioritized sampler classes with plain numpy trees in place of the segment trees of torchrl's compiled
extension (which does not load against this torch): values stored in the sampler's dtype, prefix sums searched with
``searchsorted``. Everything else these references run is torchrl's code: the oracle of tests/torchrl."""

import numpy as np
import torch
from torchrl.data.replay_buffers.samplers import PrioritizedSampler as TorchRLPrioritizedSampler
from torchrl.data.replay_buffers.samplers import PrioritizedSliceSampler as TorchRLPrioritizedSliceSampler


class NumpySumTree:
    def __init__(self, capacity, dtype):
        self.v = np.zeros(capacity, dtype=np.float64)
        self.dtype = np.float32 if dtype == torch.float32 else np.float64

    def __setitem__(self, index, value):
        idx = np.asarray(torch.as_tensor(index).reshape(-1).cpu())
        val = np.broadcast_to(np.asarray(torch.as_tensor(value).reshape(-1).cpu(), dtype=self.dtype), idx.shape)
        for i, x in zip(idx, val, strict=True):  # in order: the last write of an index wins
            self.v[i] = float(x)

    def __getitem__(self, index):  # numpy in, numpy out, as torchrl's compiled trees
        if isinstance(index, int):
            return self.v[index]
        out = self.v[np.asarray(torch.as_tensor(index).cpu())].astype(self.dtype)
        return out if isinstance(index, np.ndarray) else torch.as_tensor(out)

    def query(self, left, right):
        return float(self.v[left:right].sum())

    def scan_lower_bound(self, mass):
        return torch.as_tensor(np.searchsorted(np.cumsum(self.v), np.asarray(mass), side="right"))


class NumpyMinTree(NumpySumTree):
    def __init__(self, capacity, dtype):
        super().__init__(capacity, dtype)
        self.v[:] = np.inf

    def query(self, left, right):
        return float(self.v[left:right].min())


def _numpy_trees(sampler):  # torchrl's _init with numpy trees
    sampler._sum_tree = NumpySumTree(sampler._max_capacity, sampler.dtype)  # noqa: SLF001
    sampler._min_tree = NumpyMinTree(sampler._max_capacity, sampler.dtype)  # noqa: SLF001
    sampler._max_priority = None  # noqa: SLF001


class ReferenceSampler(TorchRLPrioritizedSampler):
    _init = _numpy_trees


class ReferenceSliceSampler(TorchRLPrioritizedSliceSampler):
    _init = _numpy_trees
