"""gpubuf's draws inside torchrl's replay buffers (needs ``torchrl``: ``pip install gpubuf[torchrl]``).

- ``PrioritizedSampler``: a drop-in for ``torchrl.data.PrioritizedSampler`` (same arguments, same call sequence,
  same ``"priority_weight"``) whose segment trees are gpubuf's prefix-sum tree (:mod:`gpubuf.torchrl.prioritized`);
- ``PrioritizedSliceSampler``: a drop-in for ``torchrl.data.PrioritizedSliceSampler`` (same arguments, draws and
  weights) on gpubuf's trees, with vectorised boundaries (:mod:`gpubuf.torchrl.prioritized_slices`);
- ``SliceSampler``: a drop-in for ``torchrl.data.SliceSampler`` (same arguments, same seeded draws, same ``info``)
  with vectorised episode boundaries and draws (:mod:`gpubuf.torchrl.slices`).

- ``ReplayStorage``: a torchrl ``TensorStorage`` whose rows live on the sampling device, in host memory or in a
  ``storage_dir`` (gpubuf's memory-mapped files with their row journal) (:mod:`gpubuf.torchrl.storage`).

Importing this package imports torchrl; ``import gpubuf`` does not."""

from gpubuf.torchrl.prioritized import PrioritizedSampler
from gpubuf.torchrl.prioritized_slices import PrioritizedSliceSampler
from gpubuf.torchrl.slices import SliceSampler
from gpubuf.torchrl.storage import ReplayStorage

__all__ = ["PrioritizedSampler", "PrioritizedSliceSampler", "ReplayStorage", "SliceSampler"]
