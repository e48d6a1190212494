"""HostCommit: the bookkeeping of an insert into a CPU buffer in two compiled loops.

An insert's bookkeeping is the ring's write (row flags, position, counts) and the sampler's refresh of the starts
whose windows changed (validity, new priorities, masses, tree leaves and parents). On the CPU that is a chain of
some twenty numpy and torch calls of a few microseconds each; with numba (``pip install gpubuf[fast]``) the same
work runs as two compiled loops that the backend table hands out (``insert_loops``): one ``ring_write``, then one
``refresh_starts`` per kept validity kind (:mod:`gpubuf.ops.host_loops`). ``StartRing.write`` followed by the
sampler's ``rows_written`` is the reference: the tests hold the two to the same flags, counts, validity, priorities
and trees, bit for bit."""

import numpy as np

from gpubuf.ops.prefix_tree import offsets_array
from gpubuf.replay.ring import StartRing
from gpubuf.replay.sampling.samplers import PrioritizedSampler, UniformSampler

_NO_PRIORITY = np.zeros(0, np.float32)


class HostCommit:
    """``ring.write`` + ``sampler.rows_written`` of one CPU buffer in compiled loops (made by :meth:`of`)."""

    def __init__(self, ring: StartRing, sampler, loops: tuple):
        self.ring, self.sampler = ring, sampler
        self._ring_write, self._refresh_starts = loops
        self._counts = np.zeros(3, np.int64)
        self._no_flags = np.zeros((0, ring.n_envs), bool)
        self._views: dict = {}  # id(tensor) -> (tensor, its numpy view)

    @classmethod
    def of(cls, ring: StartRing, sampler) -> "HostCommit | None":
        """The commit of a buffer whose ``sampler`` is a uniform or prioritized one and whose backend table has the
        compiled loops (on the CPU, with numba); else ``None`` (the reference path runs)."""
        loops = sampler.table.insert_loops
        if loops is None or type(sampler) not in (UniformSampler, PrioritizedSampler):
            return None
        return cls(ring, sampler, loops)

    def write(self, T: int, trunc, ends, last) -> tuple[int, int]:
        """What ``ring.write(T, trunc, ends, last)`` then ``sampler.rows_written`` do (flags (T, E) bool or None);
        returns ``(old position, rows before the wrap)`` as ``ring.write`` does."""
        ring, sampler, counts = self.ring, self.sampler, self._counts
        M, pos = ring.max_rows, ring.pos
        counts[:] = ring.n_trunc, ring.n_ends, ring.n_last
        priority, top = _NO_PRIORITY, 0.0
        if sampler.prioritized:
            priority, top = self._numpy(sampler.priority), float(sampler.new_row_priority())
        none = self._no_flags
        self._ring_write(ring.trunc, ring.ends, ring.last, none if trunc is None else trunc,
                              none if ends is None else ends, none if last is None else last, pos, counts,
                              priority, top)
        ring.n_trunc, ring.n_ends, ring.n_last = counts.tolist()
        ring.pos, ring.count, ring.total = (pos + T) % M, min(ring.count + T, M), ring.total + T
        kinds = sampler.kept_kinds()
        if kinds:
            self._refresh(kinds, pos, T, priority)
        return pos, min(T, M - pos)

    def _refresh(self, kinds: list, old_pos: int, T: int, priority: np.ndarray) -> None:
        """The starts of ``kinds`` whose windows changed (:meth:`StartRing.changed_rows`)."""
        ring, sampler = self.ring, self.sampler
        segments = ring.changed_rows(old_pos, T, kinds)  # one or two ranges from row a on, K rows in all
        a, K, oldest = segments[0][0], sum(r1 - r0 for r0, r1 in segments), ring.oldest
        alpha = sampler.alpha if sampler.prioritized else 1.0
        for kind in kinds:
            tree = sampler.tree(kind)
            ring.n_valid[kind] += self._refresh_starts(
                ring.valid[kind].reshape(-1), self._numpy(sampler.valid_mask(kind)), ring.trunc, ring.ends, ring.last,
                kind, ring.n_steps, ring.count - ring.window(kind), oldest, a, K, priority, alpha,
                self._numpy(tree.tree), offsets_array(tree.offsets), tree.fanout)

    def _numpy(self, t) -> np.ndarray:
        """The numpy view of CPU tensor ``t`` (kept while ``t`` lives: the sampler's tensors are made once)."""
        kept = self._views.get(id(t))
        if kept is None or kept[0] is not t:
            kept = self._views[id(t)] = (t, t.numpy())
        return kept[1]
