"""GraphSampler: replay sampling with fixed tensors, device-side random numbers and no host sync, so that a learner
step calling it can be captured in a CUDA graph (``torch.cuda.graph``) or traced by ``torch.compile(fullgraph=True)``.

It drives a fixed :class:`~gpubuf.replay.sampling.plan.SamplePlan` on the device: nothing reads the device or
allocates, and the host decides nothing that depends on the buffer's fill. The tree it descends is the buffer's own,
kept current by every insert and priority update, so a graph replayed after more inserts samples the buffer as it is.
"""

import torch

from gpubuf._core.concurrency import locked, locked_on_device
from gpubuf._core.copies import refuse_copies
from gpubuf._core.inputs import check_bool, check_device_updates
from gpubuf._core.transition import Transition
from gpubuf.replay.sampling.plan import check_fixed, fixed_plan, minibatch_count, split


@refuse_copies("its tensors may be captured in a CUDA graph of its buffer; build a new one with "
               "copy.graph_sampler(...) on the buffer's copy")
class GraphSampler:
    """Fixed-tensor sampling with replacement from a :class:`~gpubuf.TransitionBuffer` (or prioritized one), built by
    :meth:`TransitionBuffer.graph_sampler`. Draws are exact, as :meth:`TransitionBuffer.sample` with
    ``with_replacement=True`` (uniform, ``priority**alpha``, or a ``Recency`` or ``Mixture`` selector's probabilities),
    from ``generator`` (on the buffer's device; register it with the graph, ``CUDAGraph.register_generator_state``) or,
    when ``None``, the device's default one (``torch.manual_seed``; compiled, draw from ``generator=None``).

    ``frame_stack``, ``frame_stride`` and ``n_step_return`` as in :meth:`TransitionBuffer.sample` (from the episode
    marks and held rows, device tensors every insert keeps current). ``boundaries``: ``"allow"`` or ``"forbid"``
    (constant ``is_first`` / ``mask``, ``has_transition`` refreshed by each draw); ``"mask"`` is not offered.

    ``beta`` (prioritized) is the buffer's: each draw reads its device copy
    (:attr:`~gpubuf.PrioritizedTransitionBuffer.beta_tensor`), which ``buffer.update_beta``, ``load_state_dict`` and
    :meth:`set_beta` refresh in place, so a replayed graph uses the new value. A draw needs a valid start; the buffer
    must not be emptied while a captured graph is replayed. ``minibatches=K`` draws ``K * batch_size`` starts at once
    (:meth:`sample`); :meth:`update_priorities` is the prioritized update a captured or compiled step holds.

    :meth:`sample`, :meth:`update_priorities` and :meth:`set_beta` hold the buffer's lock (the first two read nothing
    of the host's bookkeeping: after a graph writer's inserts they do not bring it up to date); a captured graph
    replays, and a compiled step runs, without it: run them under ``buffer.lock`` when other threads write the buffer.
    """

    def __init__(self, buffer, batch_size: int | None = None, with_next_obs: bool = False,
                 generator: torch.Generator | None = None, boundaries: str = "allow", *,
                 frame_stack: int | None = None, frame_stride: int = 1,
                 n_step_return: tuple[int, float] | None = None, minibatches: int = 1):
        with_next_obs = check_bool("with_next_obs", with_next_obs)
        if boundaries not in ("allow", "forbid"):
            raise ValueError(f"boundaries: expected 'allow' or 'forbid' for a GraphSampler, got {boundaries!r}")
        check_fixed(buffer)
        K = self.minibatches = minibatch_count(minibatches)
        spec = buffer.reader.spec(frame_stack, frame_stride, n_step_return, None)
        returns = spec is not None and spec.n is not None
        B, kind = buffer.check_sample_args(batch_size, True, with_next_obs or returns, boundaries)
        if generator is not None and (not isinstance(generator, torch.Generator)
                                      or generator.device.type != buffer.device.type):
            got = generator.device if isinstance(generator, torch.Generator) else type(generator).__name__
            raise ValueError(f"generator: expected a torch.Generator on {buffer.device} or None, got {got}")
        self._guard = buffer.guard  # calls hold the buffer's lock
        self.buffer, self.batch_size, self.generator = buffer, B, generator
        self._plan, self._draw = fixed_plan(buffer, B, kind, with_next_obs, boundaries, spec, K)
        self.prioritized, self.u = self._draw.prioritized, self._draw.u
        self._updates = buffer.sampler.device_updates() if self.prioritized else None  # max_priority on the device
        self.out: Transition = split(self._plan.out, K)
        self.indices = self._draw.starts if K == 1 else self._draw.starts.view(K, -1)

    @locked
    def set_beta(self, beta: float) -> "GraphSampler":
        """Set the buffer's importance-sampling exponent (as ``buffer.update_beta``), read by every later draw, graph
        replay and ``buffer.sample``; returns ``self``. A bad value raises naming ``beta`` and changes nothing."""
        if not self.prioritized:
            raise ValueError("set_beta: the buffer is not prioritized (its batches carry no PER_weights)")
        self.buffer.update_beta(beta)
        return self

    @locked_on_device
    def sample(self) -> tuple[Transition, torch.Tensor]:
        """``(out, indices)``: ``B`` fresh windows (plus ``PER_weights`` when prioritized) and their flat starts (B,)
        int64, the same tensors at every call (traced: views of them); with ``minibatches=K``, ``K`` minibatches of one
        draw (leaves ``(K, B, ...)``, ``indices`` ``(K, B)``), each weighed by its own largest."""
        plan, draw = self._plan, self._draw
        if self.generator is not None and self.buffer.table.tracing():
            raise ValueError("generator: torch.compile cannot trace a torch.Generator; build the GraphSampler with "
                             "generator=None (the device's default generator, seeded by torch.manual_seed)")
        draw.draw(self.generator)
        batch = plan.read(draw.starts, plan.held)
        if self.prioritized:
            draw.weigh(plan.out.PER_weights)
        if batch is plan.out:
            return self.out, self.indices
        return split(batch, self.minibatches), draw.starts.view(self.indices.shape)

    @locked_on_device
    def update_priorities(self, indices: torch.Tensor, td_errors: torch.Tensor) -> None:
        """Priorities ``|td| + eps`` of flat starts ``indices`` with no host sync (checks and ``max_priority`` on the
        device), so a captured or compiled learner step holds it. ``indices``, ``td_errors``: integer and real
        tensors of one shape (``(B,)`` or ``(K, B)``) on the buffer's device, checked on the host (``ValueError``).
        Duplicates keep their largest value. All or nothing: an index outside the buffer, a non-finite ``|td| +
        eps`` or an overflowing mass writes nothing, raised at the first of :meth:`check_updates`,
        ``buffer.max_priority``, ``buffer.state_dict()`` or a ``storage_dir`` flush (never silent)."""
        if not self.prioritized:
            raise ValueError("update_priorities: the buffer is not prioritized")
        check_device_updates(indices, td_errors, self.buffer.device)
        self.buffer.storage.check_open()
        self._updates.apply(indices.reshape(-1).to(torch.int64), td_errors.detach().reshape(-1))

    @locked_on_device
    def check_updates(self) -> None:
        """Raise what :meth:`update_priorities` (or its replays in a captured graph) dropped since the last check
        (``IndexError`` for indices outside the buffer, else ``ValueError``), once; one read of the device."""
        if self.prioritized:
            self._updates.raise_pending()
