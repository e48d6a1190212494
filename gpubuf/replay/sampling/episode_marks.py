"""EpisodeMarks: a replay buffer's episode marks and held rows as tensors beside its storage, for the frame-stack and
n-step-return ops (:mod:`gpubuf.ops.stacks`).

Built by the buffer on the first sample that needs them and kept current from then on by every insert, load and re-open,
in place: a ``GraphSampler`` captured in a CUDA graph reads them as they are when it replays.

- ``marks`` ``(M * E,)`` uint8, one per time-major flat row ``step * E + env``: ``MARK_TERM`` where ``terminated`` is
  set; ``MARK_STOP`` where ``truncated`` or ``info["is_last"]`` is (a return stops before the row); ``MARK_BOUNDARY``
  where an episode ends after the row: an ``info["is_last"]`` row when the buffer stores that leaf (an env source's:
  the row after an episode's last transition holds its last observation), else a ``terminated`` or ``truncated`` one.
- ``held`` ``(2,)`` int64: the oldest row held and the rows held per env.

A flag leaf counts as set where any of its values in the row is nonzero.
"""

import torch

from gpubuf.ops import MARK_BOUNDARY, MARK_STOP, MARK_TERM
from gpubuf.replay.config import IS_LAST


class EpisodeMarks:
    """Marks and held rows of one buffer's ring, on its storage's device."""

    def __init__(self, config, storage, ring):
        M, E = config.max_rows, config.n_envs
        self.config, self.storage = config, storage
        self.marks = torch.zeros(M * E, dtype=torch.uint8, device=storage.device)
        self.held = torch.zeros(2, dtype=torch.int64, device=storage.device)
        term, trunc = config.paths("terminated"), config.paths("truncated")
        last = [IS_LAST] if IS_LAST in config.by_path else []
        self._bits = [(p, MARK_TERM) for p in term] + [(p, MARK_STOP) for p in trunc + last]
        self._bits += [(p, MARK_BOUNDARY) for p in (last or term + trunc)]
        self.rebuild(ring)

    def rebuild(self, ring) -> None:
        """Every row's marks from storage, and the held rows."""
        self._refresh(0, self.config.max_rows)
        self.set_held(ring)

    def rows_written(self, ring, pos: int, head_rows: int, T: int) -> None:
        """Marks of the ``T`` rows just written at ``pos`` (``head_rows`` before the wrap), and the held rows."""
        self._refresh(pos, pos + head_rows)
        if head_rows < T:
            self._refresh(0, T - head_rows)
        self.set_held(ring)

    def set_held(self, ring) -> None:
        self.held[0] = ring.oldest
        self.held[1] = ring.count

    def _refresh(self, a: int, b: int) -> None:
        rows = {p: self.storage.data[p][a:b] for p, _ in self._bits}
        self.marks.view(-1, self.config.n_envs)[a:b] = self.bits(rows, b - a)

    def bits(self, rows: dict, K: int) -> torch.Tensor:
        """(K, E) uint8: the marks of ``K`` rows whose flag leaves are ``rows`` ``{path: (K, E, ...)}``."""
        E = self.config.n_envs
        bits = torch.zeros(K, E, dtype=torch.uint8, device=self.marks.device)
        for path, bit in self._bits:
            bits |= (rows[path].reshape(K, E, -1) != 0).any(2).to(torch.uint8) * bit
        return bits
