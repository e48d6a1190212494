"""The host mirror of a history buffer's rings: per env, the write head (next slot) and the entry
count. The host knows them, so appends and reads never read the device; every write of the mirror
goes through this class, which also keeps whether all envs stand in lockstep."""

import numpy as np

from gpubuf.ops import indexing


class Ring:
    """``heads`` and ``counts`` ``(n_envs,)`` int64 of ``n_envs`` rings of ``max_len`` slots;
    ``lockstep_at``: ``(common head or -1, common count or -1)``, ``None`` until :meth:`lockstep`
    computes it after anything but :meth:`step` moved the mirror."""

    def __init__(self, n_envs: int, max_len: int):
        self.n_envs, self.max_len = n_envs, max_len
        self.counts = np.zeros(n_envs, dtype=np.int64)
        self.heads = np.zeros(n_envs, dtype=np.int64)
        self.all_ids = np.arange(n_envs, dtype=np.int64)
        self.lockstep_at = None
        self.mirror = None  # a device copy told of every change (gpubuf.history.graph_append.DeviceHeads), once made

    def lockstep(self) -> tuple[int, int]:
        """``(head, count)`` shared by every env (-1 where they differ), kept in ``lockstep_at``."""
        heads, counts = self.heads, self.counts
        h, c = int(heads[0]), int(counts[0])
        self.lockstep_at = (h if (heads == h).all() else -1, c if (counts == c).all() else -1)
        return self.lockstep_at

    def step(self) -> None:
        """One entry appended to every env, whose heads stand in lockstep (``lockstep_at`` known,
        with a head ``>= 0``)."""
        h, c = self.lockstep_at
        h = (h + 1) % self.max_len
        self.heads.fill(h)
        counts = self.counts
        if c >= 0:
            if c < self.max_len:
                c += 1
                counts.fill(c)
        else:
            np.add(counts, 1, out=counts)
            np.minimum(counts, self.max_len, out=counts)
            first = counts[0]
            c = int(first) if (counts == first).all() else -1
        self.lockstep_at = (h, c)
        if self.mirror is not None:
            self.mirror.push()

    def plan_append(self, ids: np.ndarray):
        """Storage rows for each input row, which rows to keep (None = all), and the mirror's next
        heads and counts (:meth:`restore`\\ d by the caller once every key is written)."""
        mult = np.bincount(ids, minlength=self.n_envs)
        keep = None
        if mult.max() > 1:  # an env listed twice: entries go in row order
            order = np.argsort(ids, kind="stable")
            sorted_ids = ids[order]
            rank = np.empty_like(ids)
            rank[order] = np.arange(len(ids)) - np.searchsorted(sorted_ids, sorted_ids, "left")
            kept = rank >= mult[ids] - self.max_len  # older duplicates would be overwritten anyway
            if not kept.all():
                keep = np.flatnonzero(kept)
                ids, rank = ids[keep], rank[keep]
        else:
            rank = 0
        dst_rows = (self.heads[ids] + rank) % self.max_len * self.n_envs + ids
        heads = (self.heads + mult) % self.max_len
        counts = np.minimum(self.counts + mult, self.max_len)
        return dst_rows, keep, heads, counts

    def restore(self, heads: np.ndarray, counts: np.ndarray) -> None:
        """Set the mirror to ``heads`` and ``counts`` (kept as given: pass arrays no one else writes)."""
        self.heads, self.counts = heads, counts
        self.lockstep_at = None
        if self.mirror is not None:
            self.mirror.push()

    def reset(self, ids: np.ndarray) -> None:
        """Forget the entries of envs ``ids``; their heads stay."""
        self.counts[ids] = 0
        self.lockstep_at = None
        if self.mirror is not None:
            self.mirror.push()

    def clear(self) -> None:
        """Every env empty, every head at slot 0."""
        self.restore(np.zeros_like(self.heads), np.zeros_like(self.counts))

    def num_strided(self, ids: np.ndarray, ab: int) -> np.ndarray:
        """Strided entries held per env of ``ids`` (0 for an empty env)."""
        L = self.counts[ids]
        return np.where(L > 0, indexing.strided(L, ab), 0)

    def meta(self, ids: np.ndarray, n: int, ab: int) -> np.ndarray:
        """``(3, R)`` int64, the row table the history ops take: env, newest slot, strided frames
        used by a read of ``n`` (envs ``ids`` must hold entries)."""
        meta = np.empty((3, len(ids)), dtype=np.int64)
        meta[0] = ids
        meta[1] = indexing.newest_slot(self.heads[ids], self.max_len)
        meta[2] = np.minimum(n, indexing.strided(self.counts[ids], ab))
        return meta
