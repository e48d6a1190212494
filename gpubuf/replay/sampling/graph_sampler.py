"""GraphSampler: replay sampling with fixed tensors, device-side random numbers and no host sync, so
that a learner step calling it can be captured in a CUDA graph (``torch.cuda.graph``) and replayed.

Everything one draw touches is allocated once, at construction: the uniforms ``(B,)`` float64, the
flat starts ``(B,)`` int64, the output windows (a :class:`~gpubuf.Transition` of ``(B, n_steps,
...)`` tensors), and for a prioritized buffer the masses and ``PER_weights``. The Triton gather
launches from tables uploaded once. :meth:`GraphSampler.sample` then does, on the device only:
``torch.rand`` into the uniforms, the prefix-sum tree descent, the window gather, and the importance
weights. Nothing reads the device, nothing allocates, and the host decides nothing that depends on
the buffer's fill: the tree the descent walks is the buffer's own, kept current by every insert and
priority update, so a graph replayed after more inserts samples the buffer as it is then.
"""

import operator

import torch

from gpubuf import ops
from gpubuf._core.concurrency import locked
from gpubuf._core.copies import refuse_copies
from gpubuf._core.inputs import check_bool
from gpubuf._core.transition import Transition, map_leaves, unflatten
from gpubuf.replay.sampling.stacked import StackedGather
from gpubuf.replay.storage.memory import leaves_of_words, word_views


@refuse_copies("its tensors may be captured in a CUDA graph of its buffer; build a new one with "
               "copy.graph_sampler(...) on the buffer's copy")
class GraphSampler:
    """Fixed-tensor sampling with replacement from a :class:`~gpubuf.TransitionBuffer` (or
    prioritized one).

    Built by :meth:`TransitionBuffer.graph_sampler`. Draws are exact: starts with probability
    proportional to their mass (uniform over valid starts, or ``priority**alpha``; a ``Recency`` or
    ``Mixture`` selector's probabilities), as :meth:`TransitionBuffer.sample` with
    ``with_replacement=True``, but from a device generator:
    ``generator`` (a ``torch.Generator`` on the buffer's device; register it with the graph,
    ``CUDAGraph.register_generator_state``) or, when ``None``, the device's default generator
    (``torch.manual_seed`` seeds it; CUDA graphs handle it by themselves).

    ``frame_stack``, ``frame_stride`` and ``n_step_return`` build stacks and n-step returns from
    single frames as :meth:`TransitionBuffer.sample` does (from the buffer's episode marks and held
    rows, device tensors every insert keeps current).

    ``boundaries`` may be ``"allow"`` or ``"forbid"`` (as in :meth:`TransitionBuffer.sample`;
    ``"forbid"`` sets the constant ``is_first`` / ``mask`` flags once and refreshes
    ``has_transition`` from each draw); ``"mask"`` derives its flags from each batch and is not
    offered here.

    ``beta`` (prioritized) is the buffer's own: every draw reads the buffer's device copy of it
    (:attr:`~gpubuf.PrioritizedTransitionBuffer.beta_tensor`), which ``buffer.update_beta``,
    ``buffer.load_state_dict`` and :meth:`set_beta` refresh in place, so a captured graph replayed
    after any of them uses the new value (a buffer re-opened from a ``storage_dir`` starts from the
    saved one). A draw needs at least one valid start; the buffer must not be emptied
    (``load_state_dict`` of an empty state) while a captured graph is replayed.

    ``minibatches=K`` draws ``K * batch_size`` starts at once and returns them as ``K`` minibatches
    (leaves ``(K, B, ...)``, ``indices`` ``(K, B)``), each with its own ``PER_weights`` normalisation.
    :meth:`update_priorities` is the prioritized update a captured or compiled learner step holds: checked
    on the device, all or nothing, its failures raised at :meth:`check_updates` (or the buffer's next
    ``max_priority``, ``state_dict`` or flush). Traced by ``torch.compile`` the whole step is one graph
    (draw from the default generator then: ``generator=None``).

    :meth:`sample`, :meth:`update_priorities` and :meth:`set_beta` hold the buffer's lock, as the
    buffer's own calls do; a captured graph replays outside any call, and a compiled step runs without
    it: replay or run it under ``buffer.lock`` when other threads write the buffer.
    """

    def __init__(self, buffer, batch_size: int | None = None, with_next_obs: bool = False,
                 generator: torch.Generator | None = None, boundaries: str = "allow", *,
                 frame_stack: int | None = None, frame_stride: int = 1,
                 n_step_return: tuple[int, float] | None = None, minibatches: int = 1):
        with_next_obs = check_bool("with_next_obs", with_next_obs)
        if boundaries not in ("allow", "forbid"):
            raise ValueError("boundaries: expected 'allow' or 'forbid' for a GraphSampler, got "
                             f"{boundaries!r}")
        if buffer.storage_device != buffer.device:
            raise ValueError("buffer: a GraphSampler gathers on the sampling device; this buffer's "
                             f"storage is on {buffer.storage_device}, not {buffer.device}")
        reader, sampler = buffer.reader, buffer.sampler
        selector = buffer.selector
        if selector is not None and not selector.capturable:
            raise ValueError(f"buffer: its selector {selector!r} decides on the host; a GraphSampler draws with "
                             "Recency, Mixture or the buffer's own draw")
        try:  # any integer (numpy's too), not a bool
            k = None if isinstance(minibatches, bool) else operator.index(minibatches)
        except TypeError:
            k = None
        if k is None or k < 1:
            raise ValueError(f"minibatches: expected an int >= 1, got {minibatches!r}")
        minibatches = k
        spec = reader.spec(frame_stack, frame_stride, n_step_return, None)
        returns = spec is not None and spec.n is not None
        B, kind = buffer.check_sample_args(batch_size, True, with_next_obs or returns, boundaries)
        self.minibatches, B = minibatches, B * minibatches  # one draw of every minibatch
        if generator is not None and (not isinstance(generator, torch.Generator)
                                      or generator.device.type != buffer.device.type):
            got = (generator.device if isinstance(generator, torch.Generator)
                   else type(generator).__name__)
            raise ValueError(f"generator: expected a torch.Generator on {buffer.device} or None, "
                             f"got {got}")
        # a batch that cannot fit is refused before anything is built
        try:
            what = reader.check_memory(B, with_next_obs, spec, True)
        except MemoryError as err:
            if minibatches == 1:
                raise
            raise MemoryError(f"batch_size, minibatches: {minibatches} minibatches of {B // minibatches} windows "
                              f"are one draw of {B}; {err}") from None
        self._guard, self._table = buffer.guard, buffer.table  # calls hold the buffer's lock
        self.buffer, self.batch_size, self.generator = buffer, B // minibatches, generator
        self._tree = sampler.tree(kind)  # kept current from now on
        self._selector, self._kind = selector, kind
        dev = buffer.device
        try:  # a failed allocation raises MemoryError naming batch_size
            self.u = torch.empty(B, dtype=torch.float64, device=dev)  # (B,) uniforms
            self.indices = torch.empty(B, dtype=torch.int64, device=dev)  # (B,) flat starts
            self._storage = storage = buffer.storage
            self._config = buffer.config
            self._tables, self._stacked, self._views = None, None, None
            if spec is not None:
                self._stacked = StackedGather(reader, spec, B, with_next_obs, fixed=True).prepare()
                result = self._stacked.assemble(self._stacked.out, self._stacked.out["plain"])
            else:
                jobs = storage.check_out(None, buffer.config.jobs(B, with_next_obs), dev, ())
                result, self._work = storage.outputs(B, jobs, dev)
                self._views = word_views(result, self._work)
                result = unflatten(result)
            # forbid: constant
            self.out: Transition = buffer.config.with_flags(result, boundaries, dev)
            # the kernel reads time-major storage
            if spec is None and storage.table.fixed_tables:
                self._tables = storage.table.window_tables(self._work, B, buffer.n_steps, dev)
            self.prioritized = sampler.prioritized
            if self.prioritized:
                self._mass = torch.empty(B, dtype=torch.float64, device=dev)
                self._min = torch.empty(minibatches, 1, dtype=torch.float64, device=dev)
                # () float64: the buffer's beta, kept current by the buffer
                self._beta = buffer.beta_tensor
                self._neg_beta = torch.empty((), dtype=torch.float64, device=dev)
                self.out.PER_weights = torch.empty(B, dtype=torch.float32, device=dev)
                self._updates = sampler.device_updates()
            self._flat = self.out  # (K * B, ...) leaves; what sample returns: (K, B, ...) views of them
            if minibatches > 1:
                self.out = _split(self.out, minibatches)
            self._idx = self.indices  # (K * B,) flat starts
            self.indices = self.indices.view(minibatches, -1) if minibatches > 1 else self.indices
        except Exception as err:
            if ops.allocation_failed(err):
                raise ops.memory_error("batch_size" if minibatches == 1 else "batch_size, minibatches", what,
                                       err) from None
            raise

    @locked
    def set_beta(self, beta: float) -> "GraphSampler":
        """Set the buffer's importance-sampling exponent (as ``buffer.update_beta``), read by every
        later draw, graph replay and ``buffer.sample``; returns ``self``. A bad value raises naming
        ``beta`` and changes nothing."""
        if not self.prioritized:
            raise ValueError("set_beta: the buffer is not prioritized (its batches carry no "
                             "PER_weights)")
        self.buffer.update_beta(beta)
        return self

    @locked
    def sample(self) -> tuple[Transition, torch.Tensor]:
        """``(out, indices)``: ``out`` holds ``B`` fresh windows (plus ``PER_weights`` when
        prioritized) and ``indices`` (B,) int64 their flat starts; both are the same tensors at
        every call. With ``minibatches=K``: ``K`` minibatches of one draw, every leaf ``(K, B, ...)``
        and ``indices`` ``(K, B)``, each minibatch's ``PER_weights`` normalised by its own largest."""
        tree, config, idx, flat = self._tree, self._config, self._idx, self._flat
        if self.generator is not None and self._table.tracing():
            raise ValueError("generator: torch.compile cannot trace a torch.Generator; build the GraphSampler with "
                             "generator=None (the device's default generator, seeded by torch.manual_seed)")
        torch.rand(self.u.shape, dtype=torch.float64, generator=self.generator, out=self.u)
        if self._selector is None:
            tree.sample(self.u, out=idx)
        else:  # the selector's probabilities, from device state only
            drawn, q = self._selector.draw_u(self._kind, self.u, self.minibatches)  # each minibatch a mixture
            idx.copy_(drawn)
        batch = None
        if self._stacked is not None:
            batch = self._stacked.run(idx)
        elif self._tables is not None:
            ops.sequence_gather_fixed(self._tables, idx, config.n_steps, config.n_envs,
                                      config.max_rows)
        else:
            self._storage.gather_windows(self._work, idx)
        out, indices = self.out, self.indices
        if self._table.tracing() and (self._views is not None or batch is not None):
            # traced: the outputs as views of the gathered words, so that no two inputs of the graph alias
            flat, out, indices = self._traced(flat, batch)
        config.refresh_flags(flat)  # has_transition from the rows just gathered
        if self.prioritized:  # (P_i / min_minibatch P)**-beta, all in place
            if self._selector is None:
                tree.leaves(idx, out=self._mass)
            else:
                self._mass.copy_(q)
            K = self.minibatches  # the buffer's beta when this runs (or is replayed); eager: no allocation
            self._table.importance_weights(self._mass.view(K, -1), self._beta, flat.PER_weights.view(K, -1),
                                           (self._min, self._neg_beta))
        return out, indices

    def _traced(self, flat: Transition, batch: Transition | None) -> tuple[Transition, Transition, torch.Tensor]:
        """``(flat batch, batch, indices)`` as :meth:`sample` returns them, the windows' leaves made from the gathered
        words (or the stacked gather's ``batch``, made so) and ``indices`` from the flat starts (views of the same
        memory, made where the trace sees them)."""
        traced = batch if batch is not None else unflatten(leaves_of_words(self._views, self._work))
        for name in ("PER_weights", "is_first", "mask", "has_transition"):
            setattr(traced, name, getattr(flat, name))
        K = self.minibatches
        if K == 1:
            return traced, traced, self._idx
        return traced, _split(traced, K), self._idx.view(K, -1)

    @locked
    def update_priorities(self, indices: torch.Tensor, td_errors: torch.Tensor) -> None:
        """Priorities ``|td| + eps`` of flat starts ``indices`` without a host synchronisation, so that a captured
        learner step (a CUDA graph, or ``torch.compile(fullgraph=True)``) holds it: the checks and ``max_priority``
        stay on the device.

        ``indices`` and ``td_errors``: tensors on the buffer's device of the same shape (``(B,)``, or ``(K, B)``
        as :meth:`sample` returns them), integer and real. Duplicates keep their largest value. All or nothing: when
        an index lies outside the buffer, a ``|td| + eps`` is NaN or infinite, or a priority's mass would overflow,
        the update writes nothing, and the failure is raised later, at the first of :meth:`check_updates`,
        ``buffer.max_priority``, ``buffer.state_dict()`` or a ``storage_dir`` flush (so it is never silent). Shapes,
        dtypes and devices are checked on the host at once (``ValueError``)."""
        if not self.prioritized:
            raise ValueError("update_priorities: the buffer is not prioritized")
        dev = self.buffer.device
        for name, t, integer in (("indices", indices, True), ("td_errors", td_errors, False)):
            if not isinstance(t, torch.Tensor) or t.device.type != dev.type or t.numel() == 0 \
                    or t.is_floating_point() == integer or t.is_complex() or t.dtype == torch.bool:
                what = "integer" if integer else "real"
                got = f"{t.dtype} of shape {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) \
                    else type(t).__name__
                raise ValueError(f"{name}: expected a non-empty {what} tensor on {dev}, got {got}")
        if indices.shape != td_errors.shape:
            raise ValueError(f"td_errors: expected the shape of indices {tuple(indices.shape)}, got "
                             f"{tuple(td_errors.shape)}")
        self.buffer.storage.check_open()
        self._updates.apply(indices.reshape(-1).to(torch.int64), td_errors.detach().reshape(-1))

    @locked
    def check_updates(self) -> None:
        """Raise what :meth:`update_priorities` (or its replays in a captured graph) dropped since the last check
        (``IndexError`` for indices outside the buffer, else ``ValueError``), once; one read of the device."""
        if self.prioritized:
            self._updates.raise_pending()


def _split(batch: Transition, k: int) -> Transition:
    """``batch`` with every ``(k * B, ...)`` leaf viewed as ``(k, B, ...)``."""
    return map_leaves(batch, lambda t, _: t.view(k, -1, *t.shape[1:]))

