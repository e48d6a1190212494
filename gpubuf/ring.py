"""StartRing: the host-side bookkeeping of a time-major replay ring (no tensors, no device).

A ring holds ``M`` rows per env for ``E`` envs; a sequence start is the flat index ``row * E + env``. The
ring knows the write position, how many rows are written, which rows carry a truncation, and, per
validity kind, which starts may begin a window:

- kind 0: windows of ``n_steps`` rows inside the written rows, not across the write seam;
- kind 1: windows of ``n_steps + 1`` rows (next observations are read from the following row) whose first
  ``n_steps`` rows hold no truncation.

Everything here is numpy on the host: the replay buffer turns the validity it computes into device masks
and sampling mass.
"""

import numpy as np


class StartRing:
    """Write position, row count, truncation flags and per-kind validity of a ``(M, E)`` ring.

    Args:
        max_rows: ``M``, rows per env.
        n_envs: ``E``.
        n_steps: window length of kind 0 (kind 1 windows are one row longer).
        kinds: the validity kinds tracked, a subset of ``(0, 1)``.
    """

    def __init__(self, max_rows: int, n_envs: int, n_steps: int, kinds: tuple[int, ...]):
        self.max_rows, self.n_envs, self.n_steps, self.kinds = max_rows, n_envs, n_steps, tuple(kinds)
        self.pos = 0  # next row written
        self.count = 0  # rows written, at most M
        self.trunc = np.zeros((max_rows, n_envs), dtype=bool)  # (M, E) rows holding a truncation
        self.n_trunc = 0  # truncated rows stored: while 0, every kind's valid starts are one ring range of rows
        self.valid = {k: np.zeros((max_rows, n_envs), dtype=bool) for k in self.kinds}  # (M, E) per kind
        self.n_valid = dict.fromkeys(self.kinds, 0)

    def window(self, kind: int) -> int:
        """Rows a window of this kind reads."""
        return self.n_steps + kind

    def write(self, T: int, trunc: np.ndarray | None) -> tuple[int, int]:
        """Account for ``T`` rows written at the write position with truncation flags ``trunc`` (T, E) (or
        None: no ``truncated`` leaf); returns ``(old position, rows before the ring wraps)``."""
        M, pos = self.max_rows, self.pos
        first = min(T, M - pos)
        if trunc is not None:
            old = int(np.count_nonzero(self.trunc[pos:pos + first])) + int(np.count_nonzero(self.trunc[:T - first]))
            self.n_trunc += int(np.count_nonzero(trunc)) - old
            self.trunc[pos:pos + first] = trunc[:first]
            if first < T:
                self.trunc[:T - first] = trunc[first:]
        self.pos = (pos + T) % M
        self.count = min(self.count + T, M)
        return pos, first

    def changed_rows(self, old_pos: int, T: int, kinds) -> list[tuple[int, int]]:
        """Row ranges ``[r0, r1)`` (at most two) whose starts' windows changed after writing ``T`` rows at
        ``old_pos``: rows ``old_pos - W + 1 .. old_pos + T - 1``, W the longest window of ``kinds``."""
        M = self.max_rows
        W = max(self.window(k) for k in kinds)
        K = min(T + W - 1, M)
        a = (old_pos + T - K) % M
        return [(a, min(a + K, M))] + ([(0, a + K - M)] if a + K > M else [])

    def validity(self, r0: int, r1: int, kind: int) -> np.ndarray:
        """((r1 - r0) * E,) bool: whether a window of this kind may start at each flat start of rows [r0, r1)."""
        M, E = self.max_rows, self.n_envs
        # rows r0 + i have time indices (t0 + i) % M (0 = oldest); valid ones are <= last: two slices of rows
        t0 = (r0 - (self.pos if self.count == M else 0)) % M
        last = self.count - self.window(kind)
        ok = np.zeros(r1 - r0, dtype=bool)
        ok[:max(last - t0 + 1, 0)] = True  # before the time index wraps past M
        ok[M - t0:max(last - t0 + M + 1, 0)] = True  # after it
        if kind == 1 and self.n_trunc:
            win = (np.arange(r0, r1)[:, None] + np.arange(self.n_steps)) % M  # (K, n)
            return (ok[:, None] & ~self.trunc[win].any(1)).reshape(-1)
        return ok if E == 1 else np.repeat(ok, E)

    def refresh(self, kind: int, r0: int, r1: int) -> tuple[np.ndarray, int]:
        """Recompute the validity of rows ``[r0, r1)`` for ``kind``; returns it ((r1 - r0) * E,) and how many
        of those starts are valid."""
        ok = self.validity(r0, r1, kind)
        valid = self.valid[kind].reshape(-1)  # (M*E,) view
        lo, hi = r0 * self.n_envs, r1 * self.n_envs
        n_ok = int(np.count_nonzero(ok))
        self.n_valid[kind] += n_ok - int(np.count_nonzero(valid[lo:hi]))
        valid[lo:hi] = ok
        return ok, n_ok

    def one_range(self, kind: int) -> bool:
        """Whether the valid starts of ``kind`` are every env's start in one ring range of rows (kind 0 always,
        kind 1 while no truncation is stored)."""
        return kind == 0 or self.n_trunc == 0

    def range_starts(self, kind: int) -> tuple[int, int]:
        """``(oldest row, number of valid starts)`` when :meth:`one_range`: starts ``(oldest + t) % M`` for
        ``t < count - window + 1``, every env."""
        base = self.pos if self.count == self.max_rows else 0
        return base, max(self.count - self.window(kind) + 1, 0) * self.n_envs

    def forget_validity(self) -> None:
        """Mark every start invalid (validity is recomputed by :meth:`refresh`)."""
        for kind in self.kinds:
            self.valid[kind][:] = False
            self.n_valid[kind] = 0

    def restore(self, pos: int, count: int, trunc: np.ndarray) -> None:
        """Set the write position, row count and truncation flags (validity forgotten)."""
        self.pos, self.count, self.trunc = pos, count, trunc
        self.n_trunc = int(np.count_nonzero(trunc))
        self.forget_validity()
