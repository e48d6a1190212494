"""MemoryPlan: the bytes a replay buffer allocates, known before it is built.

A buffer of ``M`` rows per env and ``E`` envs (``L = M * E`` starts) allocates, zero-filled and up front:

- storage: ``L`` rows of every leaf, ``prod(shape) * itemsize`` bytes each, in its storage dtype;
- per validity kind kept (one per ``with_next_obs`` / ``boundaries`` pair a draw needs a tree for, each made on that
  draw): a float64 prefix-sum tree over the ``L`` starts (leaves padded to the fan-out, then its parents) and a bool
  mask. A prioritized buffer keeps one for every pair it samples; a uniform one draws from a range of rows while the
  valid starts are one, and keeps a kind only once they are not (a stored truncation for next observations, an
  episode end for ``boundaries="forbid"`` with ``n_steps > 1``, an ``info["is_last"]`` row for any);
- prioritized: one float32 priority per start;
- episode marks (once frame stacks or n-step returns were sampled): one byte per start and 16 bytes.

That is what :attr:`TransitionBuffer.nbytes <gpubuf.TransitionBuffer.nbytes>` counts, and what the tests hold the plan
to. A ``storage_dir`` keeps its rows in files, not in this count's memory; staging and sampled batches (a few batches'
bytes) are not counted."""

import dataclasses
import math
import numbers

from gpubuf._core.inputs import check_bool, positive_int
from gpubuf.replay.sampling.tree import level_sizes


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The bytes of one buffer configuration (:meth:`TransitionBuffer.memory_plan
    <gpubuf.TransitionBuffer.memory_plan>`).

    Attributes:
        max_size: the transitions held (``M * E``): as asked, or the largest whose ``nbytes`` fits the budget.
        n_envs: ``E``.
        row_bytes: storage bytes per transition, every leaf in its storage dtype.
        start_bytes: sampling bytes per transition, about (masks, priorities, tree leaves; the trees' parents add
            about one part in the fan-out).
        storage_bytes: the storage of ``max_size`` transitions.
        sampling_bytes: trees, masks, priorities and episode marks of ``max_size`` transitions.
        nbytes: ``storage_bytes + sampling_bytes``: what the buffer allocates.
    """

    max_size: int
    n_envs: int
    row_bytes: int
    start_bytes: float
    storage_bytes: int
    sampling_bytes: int
    nbytes: int

    @property
    def bytes_per_transition(self) -> float:
        """``nbytes / max_size``."""
        return self.nbytes / self.max_size


class Planner:
    """The byte counts of one configuration (``leaves``: ``(shape, itemsize)`` per stored leaf)."""

    def __init__(self, leaves: list, n_envs: int, prioritized: bool, kinds: int, episode_marks: bool):
        self.row_bytes = sum(math.prod(shape) * size for shape, size in leaves)
        self.n_envs, self.prioritized, self.kinds, self.marks = n_envs, prioritized, kinds, episode_marks

    def sampling_bytes(self, starts: int) -> int:
        """Trees, masks, priorities and marks of ``starts`` starts."""
        per_kind = 8 * sum(level_sizes(starts)) + starts
        return self.kinds * per_kind + 4 * starts * self.prioritized + (starts + 16) * self.marks

    def plan(self, rows: int) -> MemoryPlan:
        """The plan of ``rows`` rows per env."""
        L = rows * self.n_envs
        storage, sampling = L * self.row_bytes, self.sampling_bytes(L)
        start = self.kinds * (8 + 1) + 4 * self.prioritized + self.marks
        return MemoryPlan(L, self.n_envs, self.row_bytes, float(start), storage, sampling, storage + sampling)

    def largest(self, budget: int) -> MemoryPlan:
        """The plan of the most rows per env whose bytes fit ``budget`` (``ValueError`` when not even one row does)."""
        if self.plan(1).nbytes > budget:
            raise ValueError(f"budget: {budget} bytes hold not even one row of {self.n_envs} envs "
                             f"({self.plan(1).nbytes} bytes)")
        lo, hi = 1, max(2, budget // max(1, self.row_bytes * self.n_envs) + 2)  # plan(hi) exceeds the budget
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.plan(mid).nbytes <= budget else (lo, mid)
        return self.plan(lo)


def check_plan_args(max_size, budget, kinds, episode_marks) -> tuple:
    """``(max_size or None, budget or None, kinds, episode_marks)`` checked: exactly one of ``max_size`` and
    ``budget`` (positive ints), ``kinds`` in 0..4, ``episode_marks`` a bool."""
    if (max_size is None) == (budget is None):
        raise ValueError(f"memory_plan: give exactly one of max_size and budget, got max_size={max_size!r}, "
                         f"budget={budget!r}")
    max_size = None if max_size is None else positive_int("max_size", max_size)
    budget = None if budget is None else positive_int("budget", budget)
    if isinstance(kinds, bool) or not isinstance(kinds, numbers.Integral) or not 0 <= kinds <= 4:
        raise ValueError(f"kinds: expected 0 to 4 validity kinds kept (with_next_obs x boundaries), got {kinds!r}")
    return max_size, budget, int(kinds), check_bool("episode_marks", episode_marks)
