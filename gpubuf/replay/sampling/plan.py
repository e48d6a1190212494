"""SamplePlan: one sample configuration, checked and allocated once, and the stages every sample runs.

A configuration is a batch size ``B`` (``K * B`` for ``K`` minibatches), the unit of a start (plain windows, with
next observations, frame stacks and n-step returns: a :class:`~gpubuf.replay.sampling.stacked.StackSpec`),
``boundaries``, and the outputs: fresh for every sample, a caller's ``out``, or ``fixed`` (allocated once and
refilled by every sample). Building a plan checks the outputs and allocates what it keeps; its drivers run the
stages, each of which takes its outputs:

- draw: starts ``(B,)`` int64 and masses ``(B,)`` float64. The eager sample's sampler or selector allocates
  them; a fixed plan's :class:`DeviceDraw` fills its own, from uniforms drawn on the device;
- read (:meth:`SamplePlan.read`): the output leaves of the drawn starts, into the plan's held outputs or the set
  :meth:`SamplePlan.outputs` allocated before the draw (so a failed allocation draws nothing);
- weigh (``SamplePlan.weigh``, the sampler's): ``PER_weights`` of the drawn masses (a prioritized buffer's); a
  fixed plan's :meth:`DeviceDraw.weigh` writes them into its weights tensor.

The drivers: the eager sample (:meth:`~gpubuf.TransitionBuffer.sample`: a plan per configuration, cached by
:meth:`~gpubuf.replay.sampling.readers.BatchReader.plan`), :class:`~gpubuf.GraphSampler` (a fixed plan from
:func:`fixed_plan`, plus a device generator) and the sharded sampler (a fresh plan of each owner's starts; the
requester weighs).

Read paths: a sample reads its plain leaves by one of 1-5, then its stacks and returns by 6 and 7, from the storage's
rows (8 for a ``storage_dir``'s); the same set for every driver, the path decided once, when the plan is built:

1. windows into held words: a fixed plan's outputs or a caller's ``out`` on the storage's device, filled by the
   storage's window gather (a fixed plan's Triton tables, uploaded once, are that gather's launch form);
2. fresh windows on the storage's device: words allocated per sample, then gathered as in 1;
3. host storage read by another device: gathered into pinned host words, then one non-blocking copy per leaf;
4. the CPU steady path: fresh windows of host storage gathered with the torch twin's rows, narrow leaves in their
   own dtype (an allocation that fails there takes 2, which names ``batch_size``);
5. traced (``torch.compile``): a fixed plan's output leaves made again as views of the words 1 filled;
6. frame stacks of the observations (the stack op; a fixed plan's Triton tables, uploaded once);
7. n-step returns and their bootstrap stacks (the return op, then the stack op);
8. env-major files (``storage_dir``): the rows 1-3, 6 and 7 read are gathered from ``(E, M)`` files.
"""

import operator

import torch

from gpubuf import ops
from gpubuf._core.transition import Transition, flatten, leaf_name, map_leaves, unflatten
from gpubuf.replay.sampling.stacked import StackedGather, StackSpec
from gpubuf.replay.storage.memory import leaves_of_words, word_views

FLAGS = ("PER_weights", "is_first", "mask", "has_transition")  # leaves a traced batch takes from the fixed one


class WindowsRead:
    """Read paths 1-5 of a plan's plain leaves: ``jobs`` ``{output path: (given tensor or None, stored path, shift,
    shape)}`` of ``B`` starts; ``keep``: the outputs are held (fixed, or given), ``fixed``: allocated here;
    ``host``: the storage's ``host_jobs`` of fresh outputs (``None``: not the CPU steady path)."""

    def __init__(self, reader, B: int, jobs: dict, keep: bool, fixed: bool, host: list | None):
        storage, device = reader.storage, reader.device
        self.storage, self.config, self.device, self.jobs, self.host = storage, reader.config, device, jobs, host
        self.result = self.work = self.views = self.tables = None
        if keep and storage.device == device:
            self.result, self.work = storage.outputs(B, jobs, device)
            self.views = word_views(self.result, self.work)
            if fixed and storage.table.fixed_tables:  # pointer tables uploaded once
                self.tables = storage.table.window_tables(self.work, B, self.config.n_steps, device)

    def run(self, starts: torch.Tensor, traced: bool = False) -> dict:
        """``{output path: tensor}``: the windows of flat ``starts`` (B,) int64."""
        if self.work is not None:
            c = self.config
            if self.tables is not None:
                self.storage.table.window_gather_fixed(self.tables, starts, c.n_steps, c.n_envs, c.max_rows)
            else:
                self.storage.gather_windows(self.work, starts)
            return leaves_of_words(self.views, self.work) if traced and self.views is not None else self.result
        if self.host is not None:
            try:
                return self.storage.gather_host_jobs(self.host, starts)
            except RuntimeError:  # an allocation failure: the general gather raises MemoryError naming batch_size
                pass
        return self.storage.gather(starts, self.jobs, self.device)


def _check_no_stale_leaves(out: Transition | None, jobs: dict) -> None:
    """Refuse an ``out`` holding stored leaves this sample does not fill (another unit's batch): they would be stale."""
    if out is None:
        return
    stale = [leaf_name(path) for path in flatten(out, "out") if path not in jobs]
    if stale:
        raise ValueError(f"out: expected the leaves this sample fills (an earlier sample's Batch of the same unit), "
                         f"got {', '.join(stale)} besides them")


class SamplePlan:
    """The plan of ``B`` starts of one unit (``with_next_obs``, ``spec``) and ``boundaries``, into fresh outputs, the
    caller's ``out`` (checked here; ``owned``: memory ranges it must not reach) or ``fixed`` ones (:attr:`out`)."""

    def __init__(self, reader, B: int, with_next_obs: bool, boundaries: str, spec: StackSpec | None,
                 out: Transition | None = None, owned: tuple = (), fixed: bool = False):
        config, storage = reader.config, reader.storage
        self.config, self.B, self.boundaries, self.fixed = config, B, boundaries, fixed
        # the weigh stage: ``weigh(batch, drawn masses (B,))`` sets ``batch.PER_weights`` (a uniform buffer's: none)
        self.weigh = reader.sampler.weigh
        self.device, self.table, self.given, self.tables = reader.device, reader.table, out, None
        self.stacks = None if spec is None else StackedGather(reader, spec, B, with_next_obs)
        plain = config.jobs(B, with_next_obs) if spec is None else self.stacks.plain
        jobs = storage.check_out(out, plain, reader.device, owned)
        _check_no_stale_leaves(out, jobs)
        fresh = spec is None and out is None and not fixed
        host = storage.host_jobs(B, with_next_obs, self.device) if fresh else None
        self.windows = WindowsRead(reader, B, jobs, fixed or out is not None, fixed, host)
        self.held = self.stacks.outputs() if fixed and self.stacks is not None else None
        self.out = None
        if fixed:
            if self.held is not None and storage.table.fixed_tables:
                self.tables = self.stacks.tables(self.held)
            self.out = config.with_flags(self._batch(self.windows.result, self.held), boundaries, self.device)

    def outputs(self) -> dict | None:
        """The stacks' and returns' outputs of the next read: the held ones, else fresh (``None``: no stacks)."""
        return self.held if self.fixed or self.stacks is None else self.stacks.outputs()

    def _batch(self, plain: dict, outputs: dict | None) -> Transition:
        return unflatten(plain) if self.stacks is None else self.stacks.assemble(outputs, plain)

    def read(self, starts: torch.Tensor, outputs: dict | None = None) -> Transition:
        """The flagged batch of flat ``starts`` (B,) int64 (``outputs``: :meth:`outputs`' set for this read)."""
        traced = self.fixed and self.table.tracing() and (self.stacks is not None or self.windows.views is not None)
        plain = self.windows.run(starts, traced)
        if self.stacks is not None:
            self.stacks.run(starts, outputs, self.tables)
        if not self.fixed:
            if self.given is not None:
                batch = self.given
                for name in FLAGS:  # an earlier sample's flags and weights: this read sets its own, or none
                    setattr(batch, name, None)
            else:
                batch = unflatten(plain) if self.stacks is None else self.stacks.assemble(outputs, plain)
            return self.config.with_flags(batch, self.boundaries, self.device)
        batch = self._batch(plain, outputs) if traced else self.out
        for name in FLAGS if traced else ():  # traced: views made where the trace sees them, flags as held
            setattr(batch, name, getattr(self.out, name))
        self.config.refresh_flags(batch)  # has_transition from the rows just gathered
        return batch



class DeviceDraw:
    """The draw and weigh stages of a fixed plan: uniforms ``u``, :attr:`starts` and (prioritized) :attr:`mass`,
    each ``(B,)`` and allocated once, filled from device state only (the tree of ``kind`` or a capturable
    selector); ``groups`` minibatches of one draw, each weighed by its own largest weight."""

    def __init__(self, buffer, kind: int, B: int, groups: int):
        dev, self.groups, self.kind, self.table = buffer.device, groups, kind, buffer.table
        self.tree, self.selector = buffer.sampler.tree(kind), buffer.selector  # the tree: kept current from now on
        self.u = torch.empty(B, dtype=torch.float64, device=dev)
        self.starts = torch.empty(B, dtype=torch.int64, device=dev)
        self.prioritized = buffer.sampler.prioritized
        if self.prioritized:
            self.mass = torch.empty(B, dtype=torch.float64, device=dev)
            self._min = torch.empty(groups, 1, dtype=torch.float64, device=dev)
            self._beta = buffer.beta_tensor  # () float64: the buffer's beta, kept current by the buffer
            self._neg_beta = torch.empty((), dtype=torch.float64, device=dev)

    def draw(self, generator: torch.Generator | None) -> None:
        """Fill :attr:`starts` (and :attr:`mass`) from fresh uniforms of ``generator`` (``None``: the default)."""
        torch.rand(self.u.shape, dtype=torch.float64, generator=generator, out=self.u)
        if self.selector is None:
            self.tree.sample(self.u, out=self.starts)
            if self.prioritized:
                self.tree.leaves(self.starts, out=self.mass)
            return
        drawn, q = self.selector.draw_u(self.kind, self.u, self.groups)  # each minibatch a mixture
        self.starts.copy_(drawn)
        if self.prioritized:
            self.mass.copy_(q)

    def weigh(self, weights: torch.Tensor) -> None:
        """``weights`` (B,) float32 = ``(P_i / min_minibatch P)**-beta`` in place (beta read at run or replay)."""
        K = self.groups
        self.table.importance_weights(self.mass.view(K, -1), self._beta, weights.view(K, -1),
                                      (self._min, self._neg_beta))


def check_fixed(buffer) -> None:
    """``ValueError`` naming ``buffer`` unless a fixed plan can sample it: storage on the sampling device, and a draw
    from device state only (the buffer's own, or a capturable selector's)."""
    if buffer.storage_device != buffer.device:
        raise ValueError("buffer: a GraphSampler gathers on the sampling device; this buffer's "
                         f"storage is on {buffer.storage_device}, not {buffer.device}")
    if buffer.selector is not None and not buffer.selector.capturable:
        raise ValueError(f"buffer: its selector {buffer.selector!r} decides on the host; a GraphSampler draws "
                         "with Recency, Mixture or the buffer's own draw")


def minibatch_count(minibatches) -> int:
    """``minibatches`` checked: any integer >= 1 (numpy's too), not a bool."""
    try:
        k = None if isinstance(minibatches, bool) else operator.index(minibatches)
    except TypeError:
        k = None
    if k is None or k < 1:
        raise ValueError(f"minibatches: expected an int >= 1, got {minibatches!r}")
    return k


def fixed_plan(buffer, B: int, kind: int, with_next_obs: bool, boundaries: str, spec, K: int):
    """``(fixed plan, its DeviceDraw)`` of ``K`` minibatches of ``B`` starts of ``kind``, one draw of ``K * B``;
    ``MemoryError`` naming ``batch_size`` (and ``minibatches``) for one that cannot fit, before anything is built."""
    names = "batch_size" if K == 1 else "batch_size, minibatches"
    try:
        what = buffer.reader.check_memory(K * B, with_next_obs, spec, True)
    except MemoryError as err:
        if K == 1:
            raise
        raise MemoryError(f"{names}: {K} minibatches of {B} windows are one draw of {K * B}; {err}") from None
    try:
        plan = SamplePlan(buffer.reader, K * B, with_next_obs, boundaries, spec, fixed=True)
        draw = DeviceDraw(buffer, kind, K * B, K)
        if draw.prioritized:
            plan.out.PER_weights = torch.empty(K * B, dtype=torch.float32, device=buffer.device)
    except Exception as err:
        if ops.allocation_failed(err):
            raise ops.memory_error(names, what, err) from None
        raise
    return plan, draw


def split(batch: Transition, k: int) -> Transition:
    """``batch`` with every ``(k * B, ...)`` leaf viewed as ``(k, B, ...)`` (``k == 1``: ``batch`` itself)."""
    return batch if k == 1 else map_leaves(batch, lambda t, _: t.view(k, -1, *t.shape[1:]))
