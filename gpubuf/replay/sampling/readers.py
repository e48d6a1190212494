"""BatchReader: the reads of a replay buffer's samples, and their plans.

Before the draw, :meth:`BatchReader.plan` returns the :class:`~gpubuf.replay.sampling.plan.SamplePlan` of the call's
configuration (batch size, unit, boundaries, the caller's ``out``): built once, which checks ``out`` and that the sample
fits in memory (refused before the draw when it cannot), then cached. The reader also keeps the episode marks that frame
stacks and n-step returns read.
"""

import math

import torch

from gpubuf import ops
from gpubuf._core.transition import Transition, flatten
from gpubuf.replay.ring import RowEvents
from gpubuf.replay.sampling.episode_marks import EpisodeMarks
from gpubuf.replay.sampling.plan import SamplePlan
from gpubuf.replay.sampling.stacked import StackSpec
from gpubuf.replay.sampling.tree import FANOUT


class BatchReader(RowEvents):
    """The reads of one buffer's samples: its ``config``, ``storage``, ``ring`` (the rows held), the ``sampler`` that
    weighs them and the sampling device's ``table``; the episode marks, built on first need."""

    def __init__(self, config, storage, ring, sampler, table: ops.Backend):
        self.config, self.storage, self.ring, self.sampler = config, storage, ring, sampler
        self.device, self.table = table.device, table
        self._plans = ops.LRU(8)  # (plan, what) per sample configuration
        self._last_plan = (None, None)  # (key, (plan, what)) of the last sample (a loop asks the same each step)
        self._marks = None  # EpisodeMarks, built by the first sample that needs them
        self._fits = ops.LRU(8)  # sample sizes checked to fit (a call that fits is not estimated again)
        self._last_fit = (None, None)  # (key, what) of the last check

    def marks(self) -> EpisodeMarks:
        """The buffer's :class:`~gpubuf.replay.sampling.episode_marks.EpisodeMarks` (built from the stored
        rows now unless built already, then kept current by every write and load)."""
        if self._marks is None:
            self._marks = EpisodeMarks(self.config, self.storage, self.ring)
        return self._marks

    def tensors(self) -> list[torch.Tensor]:
        """The marks' tensors, once built."""
        return [] if self._marks is None else [self._marks.marks, self._marks.held]

    def rows_written(self, pos: int, before_wrap: int, T: int) -> None:
        """Keep built marks current after ``T`` rows were written at ``pos``."""
        if self._marks is not None:
            self._marks.rows_written(self.ring, pos, before_wrap, T)

    def row_cut(self, row: int) -> None:
        """Keep built marks current after an episode was cut at held row ``row``."""
        self.rows_written(row, 1, 1)

    def rows_loaded(self, whole: bool) -> None:
        """Keep built marks current after a load: rebuilt (``whole``), else (emptied) only the held rows."""
        if self._marks is not None:
            if whole:
                self._marks.rebuild(self.ring)
            else:
                self._marks.set_held(self.ring)

    def spec(self, frame_stack, frame_stride, n_step_return, out) -> StackSpec | None:
        """The checked stacks and returns of a call (``None``: neither); ``ValueError`` for an ``out`` with them."""
        spec = StackSpec.build(self.config, frame_stack, frame_stride, n_step_return)
        if spec is not None and out is not None:
            raise ValueError(f"out: not offered with frame_stack or n_step_return; got a {type(out).__name__}")
        return spec

    def plan(self, B: int, with_next_obs: bool, boundaries: str, spec: StackSpec | None, with_replacement: bool,
             out: Transition | None, owned: tuple) -> tuple[SamplePlan, object]:
        """``(plan, what)`` of one sample: its :class:`~gpubuf.replay.sampling.plan.SamplePlan` and what it needs in
        memory (:meth:`check_memory`'s phrase), after checking it fits and that ``out`` is usable (``owned``:
        memory ranges ``out`` must not reach); cached per configuration."""
        key = (B, with_next_obs, boundaries, spec, with_replacement, None if out is None else self._out_key(out, owned))
        last = self._last_plan
        if last[0] == key:  # a steady loop asks the same each step: one compare
            return last[1]
        if out is not None and key[-1] is None:  # a leaf that is not a tensor: checked every time
            return self._build(B, with_next_obs, boundaries, spec, with_replacement, out, owned)
        made = self._plans.get(key, self._build, B, with_next_obs, boundaries, spec, with_replacement, out, owned)
        self._last_plan = (key, made)
        return made

    def _build(self, B, with_next_obs, boundaries, spec, with_replacement, out, owned) -> tuple[SamplePlan, object]:
        what = self.check_memory(B, with_next_obs, spec, with_replacement, out is None)
        return SamplePlan(self, B, with_next_obs, boundaries, spec, out, owned), what

    @staticmethod
    def _out_key(out, owned: tuple):
        """What a check of ``out`` depends on: each leaf's identity, address, shape, strides and dtype (the plan's word
        views keep its memory alive); ``None`` for a non-tensor leaf (checked every time)."""
        leaves = flatten(out, "out")
        if not all(isinstance(t, torch.Tensor) for t in leaves.values()):
            return None
        return (owned, type(out), tuple((p, id(t), t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)
                                        for p, t in leaves.items()))

    def check_memory(self, B: int, with_next_obs: bool, spec, with_replacement: bool, fresh: bool = True):
        """What a sample of ``B`` windows needs (``what()``: a phrase naming the bytes), checked to fit: ``MemoryError``
        naming ``batch_size`` when more than the sampling (or storage) device has in all (``ops.capacity``)."""
        key = (B, with_next_obs, spec, with_replacement, fresh)
        last = self._last_fit  # a steady loop asks the same each step: one compare
        if last[0] == key:
            return last[1]
        what = self._fits.get(key, self._check_fits, B, with_next_obs, spec, with_replacement, fresh)
        self._last_fit = (key, what)
        return what

    def _check_fits(self, B: int, with_next_obs: bool, spec, with_replacement: bool, fresh: bool):
        nbytes = self.sample_bytes(B, with_next_obs, spec, with_replacement, fresh)
        device = self.device  # the cached phrase must not hold the reader (a cycle through _fits)
        what = lambda: f"sample(batch_size={B}) needs about {nbytes} bytes of outputs and working memory on {device}"
        ops.check_fits("batch_size", what, nbytes, self.device)
        if self.storage.device != self.device:
            ops.check_fits("batch_size", what, nbytes, self.storage.device)
        return what

    def sample_bytes(self, B: int, with_next_obs: bool, spec=None, with_replacement: bool = True,
                     fresh: bool = True, draw: bool = True) -> int:
        """About how many bytes a sample of ``B`` windows allocates at once: its outputs (``fresh``: not the caller's
        ``out``), flags, starts and masses, plus the working memory of the draw (``draw``; the torch twin's descent
        holds ``(B, fanout)`` children, a draw without replacement rounds of ``2 B`` draws) and of the gathers (row
        indices; stacks' and returns' masks). An estimate, to refuse a sample that cannot fit before it starts."""
        config, n = self.config, self.config.n_steps
        row = {leaf.path: math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in config.leaves}
        obs = sum(row[p] for p in config.paths("observation"))
        k = 1 if spec is None or spec.k is None else spec.k
        returns = spec is not None and spec.n is not None
        per = (n * sum(row.values()) + n * (k - 1) * obs) if fresh else 0  # windows, stacks
        if fresh and with_next_obs and not config.stores_next_obs and not returns:
            per += n * k * obs  # next observations
        if returns:
            per += k * obs + 26  # bootstrap stacks; return, discount, row, terminated, cut
        per += 2 * n + 24  # is_first and mask; starts, masses, weights
        work = 8 * n * 2  # window rows
        if draw:
            if not self.table.kernels:
                work += 2 * FANOUT * 8 + 48  # the twin's descent: children and their sums
            if not with_replacement:
                work = 2 * (work + 64)  # rounds of 2 B draws, made unique
        if spec is not None and not self.storage.table.kernels:
            reach = (k - 1) * spec.stride
            stack = reach * 18 + k * 8  # the back-reach masks and frame rows of one stack
            work += n * stack * (spec.k is not None) + (spec.n * 48 + stack if returns else 0)
        return B * (per + work)
