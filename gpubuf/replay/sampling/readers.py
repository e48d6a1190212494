"""BatchReader: how a replay buffer reads the batch of drawn flat starts.

A sample runs check -> draw -> read. Before the draw, :meth:`BatchReader.prepare` checks the
caller's ``out`` and allocates what can fail (a failed allocation draws nothing), and picks one
read for the call:

- plain windows (and ``next_observation`` one row later), into fresh tensors or the caller's ``out``
  (:meth:`~gpubuf.replay.storage.memory.MemoryStorage.gather`: the storage's device, then copied to the
  sampling device);
- the steady host path: fresh windows of host storage for a CPU buffer, gathered with the torch twin's
  rows (:meth:`~gpubuf.replay.storage.memory.MemoryStorage.host_jobs`);
- frame stacks and n-step returns (:class:`~gpubuf.replay.sampling.stacked.StackedGather`, on the storage's
  device, from the episode marks this reader keeps).

It also estimates what a sample needs in memory and refuses one that cannot fit, before the draw.
"""

import functools
import math

import torch

from gpubuf import ops
from gpubuf._core.transition import Transition, flatten, unflatten
from gpubuf.replay.sampling.episode_marks import EpisodeMarks
from gpubuf.replay.sampling.stacked import StackedGather, StackSpec
from gpubuf.replay.sampling.tree import FANOUT


class BatchReader:
    """The reads of one buffer's samples: its ``config``, ``storage`` and ``ring``
    (:class:`~gpubuf.replay.ring.StartRing`: the rows held) and the sampling device's backend
    ``table``; the episode marks, built by the first read that needs them."""

    def __init__(self, config, storage, ring, table: ops.Backend):
        self.config, self.storage, self.ring = config, storage, ring
        self.device, self.table = table.device, table
        self._marks = None  # EpisodeMarks, built by the first sample that needs them
        # sample sizes checked to fit (a call that fits is not estimated again)
        self._fits = ops.LRU(8)
        self._last_fit = (None, None)  # (key, what) of the last check
        self._last_out = (None, None)  # (key, (jobs, work)) of the last ``out`` (a loop passes the same each step)

    # ------------------------------------------------------------------ episode marks

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

    def rows_loaded(self, whole: bool) -> None:
        """Keep built marks current after a load: rebuilt from every row (``whole``), else (the
        buffer was emptied) only the held rows."""
        if self._marks is not None:
            if whole:
                self._marks.rebuild(self.ring)
            else:
                self._marks.set_held(self.ring)

    # ------------------------------------------------------------------ reads

    def spec(self, frame_stack, frame_stride, n_step_return, out) -> StackSpec | None:
        """The checked stacks and returns of a sample call (``None``: neither); ``ValueError`` for
        an ``out`` with them."""
        spec = StackSpec.build(self.config, frame_stack, frame_stride, n_step_return)
        if spec is not None and out is not None:
            raise ValueError("out: not offered with frame_stack or n_step_return; got a "
                             f"{type(out).__name__}")
        return spec

    def prepare(self, B: int, with_next_obs: bool, boundaries: str, spec: StackSpec | None,
                out: Transition | None, owned: tuple):
        """The read of one sample: a function of the drawn flat starts ``(B,)`` int64 returning the
        flagged batch. What can fail on the arguments or allocation fails here, before the draw
        (``owned``: memory ranges ``out`` must not reach)."""
        if spec is not None:  # the stacks' outputs, before the draw
            stacked = StackedGather(self, spec, B, with_next_obs).prepare()
            return functools.partial(self._flagged, stacked.run, boundaries)
        jobs = None if out is not None else self.storage.host_jobs(B, with_next_obs, self.device)
        if jobs is not None:  # the steady host path: fresh outputs in their own dtypes
            return functools.partial(self._read_host, jobs, B, with_next_obs, boundaries)
        key = None if out is None else self._out_key(out, B, with_next_obs, owned)
        if key is not None and self._last_out[0] == key:  # checked last time: its word views too
            return functools.partial(self._windows_into, self._last_out[1], out, boundaries)
        jobs = self.storage.check_out(out, self.config.jobs(B, with_next_obs), self.device, owned)
        if key is not None and self.storage.device == self.device:
            self._last_out = (key, self.storage.outputs(B, jobs, self.device)[1])
        return functools.partial(self.windows, jobs=jobs, out=out, boundaries=boundaries)

    @staticmethod
    def _out_key(out, B: int, with_next_obs: bool, owned: tuple):
        """What a check of ``out`` depends on: every leaf's identity, address, shape, strides and dtype (its word
        views keep its memory alive, so an address seen again is the same memory); ``None`` for a non-tensor leaf
        (checked every time)."""
        leaves = flatten(out, "out")
        if not all(isinstance(t, torch.Tensor) for t in leaves.values()):
            return None
        return (B, with_next_obs, owned, type(out), tuple((p, id(t), t.data_ptr(), t.shape, t.stride(), t.dtype,
                                                           t.device) for p, t in leaves.items()))

    def _windows_into(self, work: list, out: Transition, boundaries: str, starts: torch.Tensor) -> Transition:
        """:meth:`windows` into an ``out`` checked before, through the word views kept then."""
        self.storage.gather_windows(work, starts)
        return self.config.with_flags(out, boundaries, self.device)

    def _flagged(self, run, boundaries: str, starts: torch.Tensor) -> Transition:
        return self.config.with_flags(run(starts), boundaries, self.device)

    def _read_host(self, jobs: list, B: int, with_next_obs: bool, boundaries: str,
                   starts: torch.Tensor) -> Transition:
        """The storage's host gather of ``jobs``; an allocation failure takes the general path,
        which raises ``MemoryError`` naming ``batch_size``."""
        try:
            result = self.storage.gather_host_jobs(jobs, starts)
        except RuntimeError:
            jobs = self.storage.check_out(None, self.config.jobs(B, with_next_obs), self.device, ())
            result = self.storage.gather(starts, jobs, self.device)
        return self.config.with_flags(unflatten(result), boundaries, self.device)

    def windows(self, starts: torch.Tensor, jobs: dict, out: Transition | None = None,
                boundaries: str = "allow") -> Transition:
        """The flagged batch of windows of flat ``starts`` (B,) for ``storage.check_out``'s ``jobs``
        (``out``: the caller's tensors they were written into)."""
        result = self.storage.gather(starts, jobs, self.device)
        return self.config.with_flags(unflatten(result) if out is None else out, boundaries,
                                      self.device)

    # ------------------------------------------------------------------ memory

    def check_memory(self, B: int, with_next_obs: bool, spec, with_replacement: bool,
                     fresh: bool = True):
        """What a sample of ``B`` windows needs (``what()``: a phrase naming the bytes, for a
        ``MemoryError``), after checking it fits: ``MemoryError`` naming ``batch_size`` when that
        is more than the sampling (or storage) device has in all (:func:`gpubuf.ops.capacity`)."""
        key = (B, with_next_obs, spec, with_replacement, fresh)
        last = self._last_fit  # a steady loop asks the same each step: one compare
        if last[0] == key:
            return last[1]
        what = self._fits.get(key, self._check_fits, B, with_next_obs, spec, with_replacement,
                              fresh)
        self._last_fit = (key, what)
        return what

    def _check_fits(self, B: int, with_next_obs: bool, spec, with_replacement: bool, fresh: bool):
        nbytes = self.sample_bytes(B, with_next_obs, spec, with_replacement, fresh)
        device = self.device  # the cached phrase must not hold the reader (a cycle through _fits)
        what = lambda: (f"sample(batch_size={B}) needs about {nbytes} bytes of outputs and "
                        f"working memory on {device}")
        ops.check_fits("batch_size", what, nbytes, self.device)
        if self.storage.device != self.device:
            ops.check_fits("batch_size", what, nbytes, self.storage.device)
        return what

    def sample_bytes(self, B: int, with_next_obs: bool, spec=None, with_replacement: bool = True,
                     fresh: bool = True, draw: bool = True) -> int:
        """About how many bytes a sample of ``B`` windows allocates at once: its outputs (``fresh``:
        not the caller's ``out``), flags, starts and masses, plus the working memory of the draw
        (``draw``; the torch twin's descent holds ``(B, fanout)`` children, a draw without
        replacement rounds of ``2 B`` draws) and of the gathers (row indices; stacks' and returns'
        masks). An estimate, to refuse a sample that cannot fit before it starts."""
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
