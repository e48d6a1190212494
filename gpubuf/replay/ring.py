"""StartRing: the host-side bookkeeping of a time-major replay ring (no tensors, no device).

A ring holds ``M`` rows per env for ``E`` envs; a sequence start is the flat index ``row * E + env``. The ring knows
the write position, how many rows are written, which rows carry a truncation or end an episode (terminated or
truncated), and, per validity kind, which starts may begin a window. A kind is two bits:

- bit 0 (``NEXT_OBS``): windows of ``n_steps + 1`` rows (next observations are read from the following row) whose
  first ``n_steps`` rows hold no truncation; else windows of ``n_steps`` rows;
- bit 1 (``IN_EPISODE``): no episode ends in the window's first ``n_steps - 1`` rows (its last row may end one), so
  the window never crosses into the next episode.

Every kind's windows lie inside the written rows and never cross the write seam, and never start at a row that holds
no transition (an env source's row holding an episode's last observation, ``info["is_last"]``). The buffer turns
the validity computed here into device masks and sampling mass. Names as in :mod:`gpubuf.replay.config`."""

import os

import numpy as np

NEXT_OBS, IN_EPISODE = 1, 2  # validity kind bits


def forbidden_starts(rows, max_rows: int, n_steps: int, kind: int, trunc, ends, last, steps):
    """The flag rule of a kind, one code for the host ring (numpy) and the device ring (tensors): (K, E) bool, whether
    the window of ``kind`` starting at each env's start of ``rows`` (K,) int64 holds a forbidden flag (``None`` when
    no flag is checked). ``trunc``, ``ends``, ``last``: the ring's (M, E) flags, ``None`` to skip one (none stored);
    ``steps``: ``arange(n_steps)`` like the flags."""
    M, bad = max_rows, None
    if kind & NEXT_OBS and trunc is not None:  # no truncation in the first n rows
        bad = trunc[(rows[:, None] + steps) % M].any(1)
    if kind & IN_EPISODE and ends is not None and n_steps > 1:  # no episode end in the first n - 1 rows
        cross = ends[(rows[:, None] + steps[:-1]) % M].any(1)
        bad = cross if bad is None else bad | cross
    if last is not None:  # never a start on a row holding no transition
        bad = last[rows] if bad is None else bad | last[rows]
    return bad

class RowEvents:
    """The events a buffer tells every part that follows its rows (sampler, selector, reader, rate limiter), each part
    in its list's order, once the ring holds the change (here: nothing to do; a part overrides what it follows)."""

    def rows_written(self, pos: int, before_wrap: int, T: int) -> None:
        """``T`` new rows were written at ``pos``: ``pos .. pos + before_wrap - 1``, then ``0 .. T - before_wrap -
        1``."""

    def row_cut(self, row: int) -> None:
        """The episode flags of held row ``row`` changed in place (an episode cut there)."""

    def rows_loaded(self, whole: bool) -> None:
        """Every row changed at once: a load (``whole``), or the buffer emptied by a load that failed half-way."""


class LimiterSize(RowEvents):
    """A rate limiter as a part: told the buffer's size (``ring``'s held rows times ``n_envs``) after each write."""

    def __init__(self, limiter, ring: "StartRing", n_envs: int):
        self.limiter, self.ring, self.n_envs = limiter, ring, n_envs

    def rows_written(self, pos: int, before_wrap: int, T: int) -> None:
        self.limiter.set_size(self.ring.count * self.n_envs)


class StartRing:
    """Write position, row count, truncation flags and per-kind validity of a ``(M, E)`` ring.

    Args:
        max_rows: ``M``, rows per env.
        n_envs: ``E``.
        n_steps: window length of kind 0 (kind 1 windows are one row longer).
        kinds: the validity kinds tracked, a subset of ``(0, 1)``."""

    def __init__(self, max_rows: int, n_envs: int, n_steps: int, kinds: tuple[int, ...]):
        self.max_rows, self.n_envs, self.n_steps = max_rows, n_envs, n_steps
        self.kinds = tuple(kinds)
        self.pos = 0  # next row written
        self.count = 0  # rows held, at most M: the `count` rows before `pos`
        self.total = 0  # rows ever written
        # generations of the held rows start past every one handed out before a restore (write_backs.py),
        # from a random base: another ring (a re-opened storage_dir) shares none with this one
        self.base = int.from_bytes(os.urandom(6), "little") << 8
        # (M, E) rows holding a truncation, a transition whose successor is not stored (a row both terminated
        # and truncated is a termination: it needs none, and is not one of them)
        self.trunc = np.zeros((max_rows, n_envs), dtype=bool)
        self.n_trunc = 0  # such rows stored
        self.ends = np.zeros((max_rows, n_envs), dtype=bool)  # (M, E) rows ending an episode
        self.n_ends = 0  # rows ending an episode stored
        self.last = np.zeros((max_rows, n_envs), dtype=bool)  # (M, E) rows holding no transition (never a start)
        self.n_last = 0  # such rows stored (while these three counts are 0, every kind is one ring range)
        # (M, E) per kind
        self.valid = {k: np.zeros((max_rows, n_envs), dtype=bool) for k in self.kinds}
        self.n_valid = dict.fromkeys(self.kinds, 0)
        self._steps = np.arange(n_steps)  # a window's row offsets, for forbidden_starts

    def window(self, kind: int) -> int:
        """Rows a window of this kind reads."""
        return self.n_steps + (kind & NEXT_OBS)

    def write(self, T: int, trunc: np.ndarray | None, ends: np.ndarray | None,
              last: np.ndarray | None = None) -> tuple[int, int]:
        """Account for ``T`` rows written at the write position with truncation flags ``trunc`` (T, E), episode ends
        ``ends`` (T, E) and rows holding no transition ``last`` (T, E) (None: no such leaf); returns ``(old position,
        rows before the wrap)``."""
        M, pos = self.max_rows, self.pos
        head_rows = min(T, M - pos)
        self.n_trunc += self._put(self.trunc, trunc, pos, head_rows, T)
        self.n_ends += self._put(self.ends, ends, pos, head_rows, T)
        self.n_last += self._put(self.last, last, pos, head_rows, T)
        self.pos = (pos + T) % M
        self.count = min(self.count + T, M)
        self.total += T
        return pos, head_rows

    def truncate_row(self, row: int, envs: np.ndarray) -> None:
        """Mark ``row`` truncated and ending an episode for the ``envs`` (E,) bool (the caller refreshes validity)."""
        for flags, name in ((self.trunc, "n_trunc"), (self.ends, "n_ends")):
            before = int(np.count_nonzero(flags[row]))
            flags[row] |= envs
            setattr(self, name, getattr(self, name) + int(np.count_nonzero(flags[row])) - before)

    @staticmethod
    def _put(flags: np.ndarray, new: np.ndarray | None, pos: int, head_rows: int, T: int) -> int:
        """Write ``new`` (T, E) into ``flags`` at ``pos`` (wrapping after ``head_rows`` rows, the rows before the
        wrap); returns the change in set flags."""
        if new is None:
            return 0
        old = int(np.count_nonzero(flags[pos:pos + head_rows])) + int(np.count_nonzero(flags[:T - head_rows]))
        flags[pos:pos + head_rows] = new[:head_rows]
        if head_rows < T:
            flags[:T - head_rows] = new[head_rows:]
        return int(np.count_nonzero(new)) - old

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
        t0 = (r0 - self.oldest) % M
        last = self.count - self.window(kind)
        ok = np.zeros(r1 - r0, dtype=bool)
        ok[:max(last - t0 + 1, 0)] = True  # before the time index wraps past M
        ok[M - t0:max(last - t0 + M + 1, 0)] = True  # after it
        bad = None  # (K, E) starts whose window holds a forbidden flag
        if self.n_trunc or self.n_ends or self.n_last:
            flags = (self.trunc if self.n_trunc else None, self.ends if self.n_ends else None,
                     self.last if self.n_last else None)
            bad = forbidden_starts(np.arange(r0, r1), M, self.n_steps, kind, *flags, self._steps)
        if bad is not None:
            return (ok[:, None] & ~bad).reshape(-1)
        return ok if E == 1 else np.repeat(ok, E)

    def refresh(self, kind: int, r0: int, r1: int) -> tuple[np.ndarray, int]:
        """Recompute the validity of rows ``[r0, r1)`` for ``kind``; returns it ((r1 - r0) * E,) and its valid count."""
        ok = self.validity(r0, r1, kind)
        valid = self.valid[kind].reshape(-1)  # (M*E,) view
        lo, hi = r0 * self.n_envs, r1 * self.n_envs
        n_ok = int(np.count_nonzero(ok))
        self.n_valid[kind] += n_ok - int(np.count_nonzero(valid[lo:hi]))
        valid[lo:hi] = ok
        return ok, n_ok

    def one_range(self, kind: int) -> bool:
        """Whether the valid starts of ``kind`` are every env's start in one ring range of rows: always for kind 0;
        with ``NEXT_OBS`` while no truncation is stored, with ``IN_EPISODE`` while no episode end is (or n = 1)."""
        return self.n_last == 0 and (not kind & NEXT_OBS or self.n_trunc == 0) and \
            (not kind & IN_EPISODE or self.n_ends == 0 or self.n_steps == 1)

    def range_starts(self, kind: int) -> tuple[int, int]:
        """``(oldest row, number of valid starts)`` when :meth:`one_range`: starts ``(oldest + t) % M`` for
        ``t < count - window + 1``, every env."""
        return self.oldest, max(self.count - self.window(kind) + 1, 0) * self.n_envs

    @property
    def oldest(self) -> int:
        """The oldest row held: rows held are the ``count`` rows before ``pos`` (a crash-safe storage directory may
        re-open holding fewer rows than were written before ``pos``)."""
        return (self.pos - self.count) % self.max_rows

    def locate(self, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(env, row, step)`` int64 of flat starts ``flat`` (any shape): ``flat = row * E + env``; ``step`` counts
        the env's rows ever written (``total - count`` rows before the oldest held). ``IndexError`` for an index
        outside ``[0, M*E)`` or a row not held."""
        flat, size = flat.astype(np.int64), self.max_rows * self.n_envs
        bad = (flat < 0) | (flat >= size)
        if bad.any():
            raise IndexError(f"indices: expected flat starts in [0, {size}), got {flat[bad][:5].tolist()}")
        row, env = flat // self.n_envs, flat % self.n_envs
        age = (row - self.oldest) % self.max_rows  # 0 = the oldest row held
        bad = age >= self.count
        if bad.any():
            raise IndexError(f"indices: rows {np.unique(row[bad])[:5].tolist()} are not held (the buffer holds "
                             f"{self.count} rows per env)")
        step = self.total - self.count + age
        return tuple(np.array(a, dtype=np.int64).reshape(flat.shape) for a in (env, row, step))

    def forget_validity(self) -> None:
        """Mark every start invalid (validity is recomputed by :meth:`refresh`)."""
        for kind in self.kinds:
            self.valid[kind][:] = False
            self.n_valid[kind] = 0

    def restore(self, pos: int, count: int, trunc: np.ndarray | None = None, ends: np.ndarray | None = None,
                total: int | None = None, last: np.ndarray | None = None) -> None:
        """Set the write position, row count, (M, E) truncation flags, episode ends, (default: ``count``) rows ever
        written and rows holding no transition (flags default: none; copied); validity is forgotten, and every
        generation handed out before is stale."""
        self.base += self.total + 1
        self.pos, self.count = pos, count
        self.total = count if total is None else total
        self.trunc, self.ends, self.last = (np.zeros((self.max_rows, self.n_envs), bool) if f is None
                                            else np.array(f, dtype=bool) for f in (trunc, ends, last))
        self.n_trunc, self.n_ends, self.n_last = (int(np.count_nonzero(f)) for f in (self.trunc, self.ends, self.last))
        self.forget_validity()
