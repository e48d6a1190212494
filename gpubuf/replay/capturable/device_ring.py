"""DeviceRing: the device copy of a replay ring's bookkeeping, for writes that never read the host.

A :class:`~gpubuf.replay.ring.StartRing` keeps the write position, row counts, episode flags and validity on the host.
Once a buffer hands out a :class:`~gpubuf.replay.capturable.writer.GraphWriter`, a copy of the position, counts and
flags lives on the buffer's device too: the graph writer's inserts advance the copy alone (device ops, no host reads),
and every eager write keeps the copy equal to the host's (it is a part told of row events). The host's copy falls behind
only while graph-written rows are not yet read back; :meth:`DeviceRing.catch_up` reads them back (the buffer's eager
calls run it first, through ``guard.behind``).
"""

import numpy as np
import torch

from gpubuf.replay.ring import NEXT_OBS, RowEvents, StartRing, forbidden_starts


class DeviceRing(RowEvents):
    """Position, counts and row flags of ``ring`` on ``device``: ``counters`` (4,) int64 (write position, rows held,
    rows ever written, and graph inserts dropped since the last catch-up) and ``flags`` (3, M, E) bool (rows holding
    a truncation, rows ending an episode, rows holding no transition, as the ring's ``trunc``, ``ends``, ``last``)."""

    def __init__(self, ring: StartRing, device: torch.device):
        M, E = ring.max_rows, ring.n_envs
        self.ring, self.device = ring, device
        self.counters = torch.zeros(4, dtype=torch.int64, device=device)
        self.flags = torch.zeros(3, M, E, dtype=torch.bool, device=device)
        self.steps = torch.arange(ring.n_steps, device=device)  # a window's row offsets
        self.rows_loaded(True)

    # ------------------------------------------------------------------ the host's writes, mirrored

    def rows_written(self, pos: int, before_wrap: int, T: int) -> None:
        """An eager write: the counters and the ``T`` rows written at ``pos``, copied from the host."""
        self._copy_rows(pos, pos + before_wrap)
        if before_wrap < T:
            self._copy_rows(0, T - before_wrap)
        self._copy_counters()

    def row_cut(self, row: int) -> None:
        self._copy_rows(row, row + 1)

    def rows_loaded(self, whole: bool) -> None:
        self._copy_rows(0, self.ring.max_rows)
        self._copy_counters()

    def _host_flags(self) -> tuple:
        return self.ring.trunc, self.ring.ends, self.ring.last

    def _copy_rows(self, a: int, b: int) -> None:
        for i, host in enumerate(self._host_flags()):
            self.flags[i, a:b].copy_(torch.from_numpy(host[a:b]))

    def _copy_counters(self) -> None:
        ring = self.ring
        self.counters[:3].copy_(torch.tensor([ring.pos, ring.count, ring.total], dtype=torch.int64))

    # ------------------------------------------------------------------ device writes

    def validity(self, rows: torch.Tensor, kind: int, oldest: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """(K, E) bool: whether a window of ``kind`` may start at each env's start of ``rows`` (K,) int64, the ring
        holding the ``count`` rows from row ``oldest`` on (0-d tensors): the rule of :meth:`StartRing.validity`, on the
        device (the window inside the held rows by time index; the flags by the ring's own :func:`forbidden_starts`)."""
        ring = self.ring
        # inside the held rows: the time index of each start (0 = oldest) at most the last a window may start at
        ok = (rows - oldest) % ring.max_rows <= count - (ring.n_steps + (kind & NEXT_OBS))
        bad = forbidden_starts(rows, ring.max_rows, ring.n_steps, kind, *self.flags, self.steps)
        return ok[:, None] & ~bad

    # ------------------------------------------------------------------ the host catching up

    def catch_up(self) -> tuple[bool, int]:
        """Bring the host ring up to the device's copy (one read of the counters, then of the rows written since);
        returns ``(whether it was behind, graph inserts dropped since the last catch-up)``."""
        ring, M = self.ring, self.ring.max_rows
        pos, count, total, dropped = self.counters.tolist()
        if dropped:
            self.counters[3] = 0
        new = total - ring.total
        if new == 0:
            return False, dropped
        rows = (pos - min(new, M) + np.arange(min(new, M))) % M
        fresh = self.flags[:, torch.from_numpy(rows).to(self.device)].cpu().numpy()  # (3, K, E)
        for host, name, rows_flags in zip(self._host_flags(), ("n_trunc", "n_ends", "n_last"), fresh, strict=True):
            host[rows] = rows_flags
            setattr(ring, name, int(np.count_nonzero(host)))
        ring.pos, ring.count, ring.total = pos, count, total
        return True, dropped
