"""torchrl's ``PrioritizedSliceSampler`` on gpubuf's trees, with its episode boundaries and the rows that cannot start
a slice found in numpy.

:class:`PrioritizedSliceSampler` is torchrl's own class (slices whose first rows are drawn in proportion to their
priorities, the weights and ``info`` it returns, its state methods), with:

- the prioritized sampler's trees of :class:`~gpubuf.torchrl.prioritized.GpubufTrees` (no compiled extension);
- the episode boundaries of :class:`~gpubuf.torchrl.slices.NumpyBoundaries`;
- the rows that cannot start a slice (the last ``slice_len - 1`` rows of each episode, every row of a shorter one;
  with ``strict_length=False`` an episode's first row may start a short slice) from one vectorised expression,
  where torchrl fills a padded table of every row in a Python loop over episodes. Their priorities are zeroed for
  the draw and restored after it, as torchrl does.
"""

import numpy as np
import torch
from torchrl.data.replay_buffers.samplers import PrioritizedSliceSampler as _TorchRLPrioritizedSliceSampler

from gpubuf.torchrl.prioritized import GpubufTrees
from gpubuf.torchrl.slices import NumpyBoundaries


def rows_without_a_slice(lengths: np.ndarray, last: int, strict: bool) -> np.ndarray:
    """(R,) int64: the rows, counted from the first episode's first row, of the last ``last`` rows of each episode
    (``last = 0``: every row), episode by episode in order; without ``strict`` an episode's first row is never
    among them."""
    ends = np.cumsum(lengths)
    held = lengths - 1 if not strict else lengths  # the rows that may be named
    if last == 0:
        last = max(int(held.max()), 0) if held.size else 0
    count = np.minimum(held, last).clip(0)
    first = np.repeat(ends - count, count)
    within = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    return first + within


class PrioritizedSliceSampler(GpubufTrees, NumpyBoundaries, _TorchRLPrioritizedSliceSampler):
    """torchrl's ``PrioritizedSliceSampler`` (same arguments: ``max_capacity``, ``alpha``, ``beta``, ``eps``,
    ``dtype``, ``num_slices`` or ``slice_len``, ``traj_key`` / ``end_key``, ``strict_length``, ``cache_values``,
    ``span`` (right only, as torchrl), ``max_priority_within_buffer``, ...) on gpubuf's trees, with vectorised
    episode boundaries. The same seeded draws (``np.random`` for the starts, as torchrl's host sampler) and the same
    ``"priority_weight"`` per row."""

    def _preceding_stop_idx(self, storage, lengths, seq_length, start_idx):
        cached = self._cache.get("preceding_stop_idx")
        if cached is not None:
            return cached
        span_right = self.span[1]
        if storage.ndim != 1 or not isinstance(seq_length, int) or (span_right and span_right is not True):
            return super()._preceding_stop_idx(storage, lengths, seq_length, start_idx)
        T = storage.shape.numel()
        n = lengths.cpu().numpy()
        if int(n.sum()) != T:
            raise RuntimeError("Wrong shapes / arange configuration")
        rows = rows_without_a_slice(n, 1 if span_right is True else seq_length - 1, self.strict_length)
        if storage._is_full:  # noqa: SLF001 (torchrl's own attribute, as its sampler reads it)
            rows = (rows + int(start_idx[0, 0])) % T
        out = torch.from_numpy(rows)
        if self.cache_values:
            self._cache["preceding_stop_idx"] = out
        return out
