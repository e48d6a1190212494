"""TransitionBuffer: a time-major circular buffer sampled as contiguous n-step windows.

A buffer composes these parts, each behind a small surface and public for companions (``ShardedBuffer``,
``GraphSampler``): ``config`` (:class:`~gpubuf.replay.config.ReplayConfig`: sizes, leaves and their rules), ``table``
(:func:`gpubuf.ops.backend_table`: what each op call runs, decided once), ``storage``
(:mod:`gpubuf.replay.storage.memory`: device, host or memory-mapped rows), ``ring``
(:class:`~gpubuf.replay.ring.StartRing`: host bookkeeping of positions, episode flags and valid starts), ``sampler``
(:mod:`gpubuf.replay.sampling.samplers`: device validity, prefix-sum trees, priorities, draws), an optional ``selector``
(:mod:`gpubuf.replay.sampling.selectors`), ``reader`` (:class:`~gpubuf.replay.sampling.readers.BatchReader`: the plans
that gather drawn starts), an optional ``rate_limiter``, and the host ``generator`` that draws. A flat start is ``row *
n_envs + env`` in every storage. A sample (:mod:`gpubuf.replay.sampling.eager`) checks its arguments, then runs the
stages of its configuration's plan (:mod:`gpubuf.replay.sampling.plan`): draws starts (``sampler.draw``), reads their
windows, weighs them; its signature is :meth:`gpubuf.replay.sampling.sample_args.Samples.sample`.

Episode boundaries (``sample(boundaries=...)``; an episode ends at a row whose ``terminated`` or ``truncated`` is set;
needs one of those leaves):

- ``"allow"`` (default): windows run on into the next episode, unmarked;
- ``"mask"`` (Dreamer style): the same windows, and the batch carries ``is_first`` and ``mask`` ``(B, n_steps)`` bool:
  ``is_first[:, j]`` is set where row ``j - 1`` ended an episode (and at ``j = 0``), ``mask[:, j]`` while no earlier row
  of the window ended one;
- ``"forbid"`` (TD-MPC2 style): only windows whose first ``n_steps - 1`` rows end no episode are drawn; the batch
  carries ``is_first`` and ``mask`` too (first step only, and all set).

Both also carry ``has_transition``, False exactly on ``info["is_last"]`` rows: they hold an episode's last observation
(inside ``mask``, as world models need it) but no transition (the action fill, reward 0), so a learner of transitions
selects ``mask & has_transition``.

With ``n_steps == 1`` the flags are ``(B,)`` and all set. An ``info["is_last"]`` row (an
:class:`~gpubuf.EnvPoolSource`'s row holding an episode's last observation and no transition) never starts a window, and
with ``"mask"`` the row after it starts the next episode.

Writes are two-phase: every leaf is checked and staged first (where any conversion fails), then committed with copies
that cannot fail on staged data, with Ctrl-C and timer signals held.

The parts that follow the rows (``sampler``, ``selector``, ``reader``, the rate limiter's size) are told of every row
event (:class:`~gpubuf.replay.ring.RowEvents`: rows written, an episode cut, rows loaded) through one list, ``parts``,
in its order; the storage's journal brackets a write (``before_write``, ``after_write``). The doors onto held rows live
with their jobs: :class:`~gpubuf.replay.feeds.write_backs.WriteBackDoors` (``update_rows``, ``cut_episodes``),
:class:`~gpubuf.replay.provenance.Provenance` (``locate``)."""

import warnings

import torch

from gpubuf import ops
from gpubuf._core.concurrency import CallGuard, locked
from gpubuf._core.inputs import int_seed
from gpubuf._core.signals import signals_held
from gpubuf._core.staging import memory_ranges
from gpubuf._core.transition import Transition
from gpubuf.replay.buffer_state import BufferState
from gpubuf.replay.config import BOUNDARIES, ReplayConfig
from gpubuf.replay.feeds.rate_limiter import check_limiter
from gpubuf.replay.feeds.write_backs import WriteBackDoors
from gpubuf.replay.feeds.writer_doors import WriterDoors
from gpubuf.replay.provenance import Provenance
from gpubuf.replay.ring import LimiterSize, StartRing
from gpubuf.replay.sampling.eager import EagerSample
from gpubuf.replay.sampling.host_commit import HostCommit
from gpubuf.replay.sampling.readers import BatchReader
from gpubuf.replay.sampling.sample_args import Samples
from gpubuf.replay.sampling.samplers import TreeSampler, UniformSampler
from gpubuf.replay.sampling.selectors import check_selector
from gpubuf.replay.steady_insert import SteadyInsert
from gpubuf.replay.storage import tiers
from gpubuf.replay.storage.memory import MappedStorage, MemoryStorage

__all__ = ["BOUNDARIES", "Transition", "TransitionBuffer"]


class TransitionBuffer(Samples, EagerSample, WriterDoors, WriteBackDoors, Provenance, BufferState):
    """A circular buffer of transitions sampled uniformly as contiguous ``n_steps`` windows.

    Args:
        max_size: transitions held across all envs; each env gets ``M = max_size // E`` rows, so the buffer holds ``M *
            E`` (a remainder of ``max_size`` is not used).
        sample_batch_size: default number of windows per :meth:`sample`.
        data_sample: a :class:`Transition` shaped like an insert: leaves ``(T, E, ...)`` when ``vectorized_env`` (``E``
            = size of axis 1), else ``(T, ...)``; fixes keys, shapes and dtypes.
        vectorized_env: store env rollouts ``(T, E, ...)`` as is; the env axis folds into the batch on sampling.
        n_steps: window length; ``1`` returns single transitions ``(B, ...)``, else ``(B, n_steps, ...)``.
        device: sampling device (validity, prefix-sum trees, priorities, returned batches); ``None`` -> ``cuda`` when
            available, else ``cpu``.
        seed: an int in ``[-2**63, 2**64)`` seeding the buffer's own generator (used when :meth:`sample` gets
            ``key=None``); ``None`` seeds it from the OS.
        storage_device: where the transitions live: ``None`` (on ``device``) or ``"cpu"`` (host memory: a CUDA buffer
            then gathers sampled windows on the host, reading the starts back once per sample, and moves them to the
            device through pinned memory with non-blocking copies).
        storage_dir: a directory of memory-mapped files (one per leaf, env-major ``(E, M, *shape)``). If it holds a
            buffer of this configuration (a mismatch raises, naming the field), that buffer is re-opened: rows and
            counts as of its last insert, and what its last :meth:`flush` saved (sampling RNG; priorities, rows inserted
            after that flush at ``max_priority``). The buffer holds the directory's lock until :meth:`close`; files are
            allocated up front; a process killed at any instant re-opens to a state the buffer has been in
            (:mod:`gpubuf.replay.storage.directory` for the guarantee).
        rate_limiter: a :class:`~gpubuf.RateLimiter` (one per buffer): :meth:`insert` and :meth:`sample` wait for their
            turn (threads; holding no lock while they wait), its counts ride along in ``state_dict`` and a
            ``storage_dir``'s flushes. ``None``: no limit.
        selector: which valid starts :meth:`sample` draws (:mod:`gpubuf.replay.sampling.selectors`: ``Recency``,
            ``Mixture`` of uniform, prioritized and recency, ``Fifo``/``Lifo`` queues, DreamerV3's ``Online`` queue; one
            per buffer). ``None``: the buffer's own draw.
        storage_dtypes: ``{leaf name: torch.dtype}`` storing some leaves in another dtype of their kind than
            ``data_sample``'s, to fit more transitions in memory: ``{"observation": torch.bfloat16}`` halves a float32
            observation. Names as printed (``"observation"``, ``"info['lives']"``); a float leaf takes any float
            dtype, an integer leaf any integer dtype, a bool leaf only bool (anything else, or an unknown name,
            raises at construction naming the leaf). Inserts cast on write, rounding to the nearest value of the
            storage dtype (bfloat16 keeps 8 significant bits, float16 11); values it cannot hold still raise and
            write nothing (a finite float beyond its largest value, an integer out of its range), and on a GPU
            that check reads the device once per insert. Samples return the storage dtype (windows, stacks and
            next observations; n-step returns, discounts and importance weights are computed in float64 and
            returned as float32); ``state_dict``, copies and a ``storage_dir`` keep it.
        sample_dtypes: ``{leaf name: torch.dtype}``: :meth:`sample` returns these leaves (an observation's next
            observation and frame stacks too) in a dtype that holds every value of their storage dtype
            (``{"observation": torch.float32}`` over bfloat16 storage; a narrower or other-kind dtype raises at
            construction naming the leaf), cast after the gather. A sample into ``out=`` tensors, a
            :meth:`graph_sampler` and a ``ShardedBuffer`` return the storage dtype.

    Sampling costs O(B * levels * fanout) for the tree descent plus the windows' bytes, whatever the capacity. Without
    replacement the draw is exact sequential sampling without replacement (:mod:`gpubuf.replay.sampling.samplers`).

    Threads: any number of threads may call any method at once; each call runs whole, between the others (:attr:`lock`,
    re-entrant; on CUDA, calls from different streams are ordered on the device as on the host:
    :mod:`gpubuf._core.concurrency`). ``copy.deepcopy``, ``pickle`` and ``torch.save`` give an independent, complete
    buffer (:mod:`gpubuf._core.copies`); a ``storage_dir`` buffer refuses (use :meth:`save` or ``state_dict``)."""

    prioritized = False  # the sampler keeps a priority per start (memory_plan counts it)

    def __init__(self, max_size: int, sample_batch_size: int, data_sample: Transition, vectorized_env: bool = True,
                 n_steps: int = 1, *, device=None, seed: int | None = None, storage_device=None, storage_dir=None,
                 rate_limiter=None, selector=None, storage_dtypes=None, sample_dtypes=None):
        seed = None if seed is None else int_seed("seed", seed)
        self.config = config = ReplayConfig.build(type(self).__name__, max_size, sample_batch_size, data_sample,
                                                  vectorized_env, n_steps, self._config_extra(), storage_dtypes,
                                                  sample_dtypes)
        self._init_storage = (storage_device, storage_dir)  # as given, for copies
        self._device_ring = None  # the device copy of the ring's bookkeeping, once a GraphWriter was made
        for name in ReplayConfig.STATE_FIELDS:
            setattr(self, name, getattr(config, name))
        self.device = ops.resolve_device(device)
        self.table = ops.backend_table(self.device)  # what each op call runs, decided once
        self.backend, self._guard = self.table.name, CallGuard(self.device, self.table.tracing)
        self.storage_device = tiers.storage_device_for(self.device, storage_device, storage_dir)
        row = config.n_envs if config.vectorized_env else 1  # transitions of the smallest insert: one row of all envs
        self.rate_limiter = check_limiter(rate_limiter, config.max_rows * config.n_envs, row, config.sample_batch_size)
        self.selector = check_selector(selector)
        self.storage = MemoryStorage(config, self.storage_device) if storage_dir is None else \
            MappedStorage(config, storage_dir)
        try:  # a failure from here on releases a storage_dir's lock at once
            self.ring = StartRing(config.max_rows, config.n_envs, config.n_steps, config.kinds)
            self.sampler = self._make_sampler()
            if self.selector is not None:
                self.selector.attach(self)
                if self.selector.replacement_only:
                    self.default_with_replacement = True
            self.reader = BatchReader(config, self.storage, self.ring, self.sampler, self.table)
            self.parts = self._row_parts()
            self._commit = HostCommit.of(self.ring, self.sampler)  # parts[0]'s bookkeeping, compiled (CPU, numba)
            self._owned_at = (-1, ())  # (sampler allocations, memory ranges) of _owned
            self._steady = SteadyInsert(config, self.storage)
            # a host generator draws: one seed, the same starts on every device
            self.generator = torch.Generator()
            if seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(seed)
            if self.storage.reopen(self.ring, self._reopen, self.generator):
                self.flush()  # the directory's state was saved by a flush cut short: complete it
        except BaseException:
            if self.storage.dir is not None:
                self.storage.dir.close()
            raise
        if self.rate_limiter is not None:
            self.rate_limiter.attach(self._guard, row, config.sample_batch_size)
        self._hub = None  # the writers in other processes (WriterHub), once one was handed out

    def _row_parts(self) -> list:
        """The parts told of every row event (:class:`~gpubuf.replay.ring.RowEvents`), in the order they are told.
        Order matters for the rate limiter, last: the size it wakes waiting samples with counts rows every other
        part has taken in (and, within the sampler, new rows' priorities come before their masses)."""
        limiter = None if self.rate_limiter is None else LimiterSize(self.rate_limiter, self.ring, self.config.n_envs)
        return [p for p in (self.sampler, self.selector, self.reader, limiter) if p is not None]

    def _config_extra(self) -> tuple:  # hook: the subclass's own configuration fields
        return ()

    def _make_sampler(self) -> TreeSampler:  # hook: the sampling policy composed here
        return UniformSampler(self.ring, self.table)

    @property
    def lock(self):
        """The re-entrant lock every call holds: hold it to make several calls one step, as another thread sees them
        (``with buf.lock: ...``), or around the replay of a captured graph that samples this buffer."""
        return self._guard.lock

    @property
    def guard(self):
        """The :class:`~gpubuf._core.concurrency.CallGuard` of this buffer's calls (:attr:`lock` and the
        stream order), shared by the companions that call into it."""
        return self._guard

    @property
    def _owned(self) -> tuple:  # memory ranges of every tensor held: inputs on them are copied
        if self._owned_at[0] != self.sampler.allocations:
            self._owned_at = (self.sampler.allocations,
                              memory_ranges([*self.storage.tensors(), *self.sampler.tensors()]))
        return self._owned_at[1]

    def __len__(self) -> int:  # transitions stored: rows held times envs (after graph inserts: caught up first)
        if self._device_ring is not None:
            self.catch_up()
        return self.ring.count * self.n_envs

    @classmethod
    def memory_plan(cls, data_sample: Transition, vectorized_env: bool = True, *, max_size=None, budget=None,
                    storage_dtypes=None, kinds: int = 1, episode_marks: bool = False):
        """The bytes this class allocates for ``data_sample`` (and ``vectorized_env``, ``storage_dtypes`` as the
        constructor takes them) before building it: a :class:`~gpubuf.replay.storage.plan.MemoryPlan` of
        ``max_size`` transitions, or of the largest ``max_size`` whose bytes fit ``budget`` (bytes; exactly one of
        the two). ``kinds``: the validity kinds kept, 0 to 4 (each a tree and a mask: one per ``with_next_obs`` /
        ``boundaries`` pair sampled from a prioritized buffer; a uniform buffer keeps one only once its valid starts
        for that pair are no longer one range of rows, after a truncation, an episode end or an ``is_last`` row:
        plan the kinds it will keep at scale); ``episode_marks``: frame stacks or n-step returns sampled. Its
        ``nbytes`` is what :attr:`nbytes` reads once those kinds are kept."""
        from gpubuf.replay.storage.plan import Planner, check_plan_args

        max_size, budget, kinds, marks = check_plan_args(max_size, budget, kinds, episode_marks)
        with warnings.catch_warnings():  # a budget's rows are whole: no remainder to warn about
            warnings.simplefilter("ignore" if budget else "default")
            config = ReplayConfig.build(cls.__name__, max_size or 2**62, 1, data_sample, vectorized_env, 1, (),
                                        storage_dtypes)
        leaves = [(leaf.shape, leaf.dtype.itemsize) for leaf in config.leaves]
        planner = Planner(leaves, config.n_envs, cls.prioritized, kinds, marks)
        return planner.plan(config.max_rows) if budget is None else planner.largest(budget)

    @property
    @locked
    def nbytes(self) -> int:
        """Bytes held: storage, priorities, the tree and validity mask of each kind used so far, and
        the episode marks (one byte per row) once frame stacks or n-step returns were sampled."""
        return sum(t.numel() * t.element_size() for t in [*self.storage.tensors(),
                                                          *self.sampler.tensors(),
                                                          *self.reader.tensors()])

    @locked
    def num_valid(self, with_next_obs: bool = False, boundaries: str = "allow") -> int:
        """Number of valid sequence starts for :meth:`sample` with this ``with_next_obs`` and ``boundaries``."""
        return self.sampler.count_valid(self.config.kind(with_next_obs, boundaries))

    @locked
    def sampling_mass(self, with_next_obs: bool = False, boundaries: str = "allow") -> torch.Tensor:
        """``(max_size,)`` float64 copy of the mass each flat start is drawn with by :meth:`sample`: 0 when invalid, 1
        when valid (uniform), ``priority**alpha`` (prioritized). A read-only diagnostic."""
        return self.sampler.sampling_mass(self.config.kind(with_next_obs, boundaries))

    # an opaque call under torch.compile (so are the other writes): no guards on host state, no recompiles
    @torch.compiler.disable
    @locked
    def insert(self, transition: Transition):
        """Write ``T`` rows per env at ``(insert_position + arange(T)) % M``; returns ``self``. Leaves ``(T, E, ...)``
        (``(T, ...)`` not vectorized), ``1 <= T <= M``, with the leaves, shapes and value-preserving dtypes of
        ``data_sample`` (:func:`gpubuf._core.inputs.check_cast`); nothing is written on any error (a ``storage_dir``
        buffer in a process other than the one that opened it, a fork, raises ``RuntimeError`` naming both pids). Device
        ``truncated``/``terminated`` are read back. Host storage: an insert of numpy arrays with the signature of the
        last one accepted takes the steady-state path (:mod:`gpubuf.replay.steady_insert`). With a :attr:`rate_limiter`
        the call first waits for its turn having let go of the buffer's lock (``TimeoutError`` after the limiter's
        ``timeout``); an insert that then fails gives its count back."""
        limiter = self.rate_limiter
        n = None if limiter is None else self.config.items_in(transition)
        if n is None:  # no limiter, or a malformed insert: its own error
            return self._insert(transition)
        return self.insert_in_turn(transition, n)

    def _insert(self, transition: Transition):
        """:meth:`insert` once its turn came (under the lock)."""
        staged = self._steady.match(transition, self._owned)
        steady = staged is not None  # the last accepted signature: numpy arrays of the stored layout
        if steady:
            values, T = staged, next(iter(staged.values())).shape[0]
        else:
            values, given, T = self.config.rows(transition)
        self.storage.check_open()
        trunc, ends, last = self.config.row_flags(values, T)
        if not steady:  # phase 1: any conversion error happens here
            staged = self.storage.stage(values, given, self._owned)
        ring = self.ring
        with signals_held():  # phase 2: commit
            self.storage.before_write(ring.pos, ring.count, ring.total, T)
            if self._commit is None:
                pos, before_wrap = ring.write(T, trunc, ends, last)
                told = self.parts
            else:  # the ring's write and the sampler's refresh in compiled loops
                pos, before_wrap = self._commit.write(T, trunc, ends, last)
                told = self.parts[1:]
            self.storage.write(staged, pos, before_wrap, T)
            for part in told:
                part.rows_written(pos, before_wrap, T)
            self.storage.after_write(ring.pos, ring.count, ring.total)  # the journal's commit of the rows
        if not steady:
            self._steady.learn(transition, given)
        return self

    @locked
    def episode_marks(self):
        """The :class:`~gpubuf.replay.sampling.episode_marks.EpisodeMarks` of this buffer (built on first use,
        then kept current by every write)."""
        return self.reader.marks()

    @locked
    def graph_sampler(self, batch_size=None, with_next_obs: bool = False, generator=None, boundaries="allow", *,
                      frame_stack: int | None = None, frame_stride: int = 1,
                      n_step_return: tuple[int, float] | None = None, minibatches: int = 1):
        """A :class:`~gpubuf.GraphSampler`: sampling with replacement into fixed tensors, with device-side random
        numbers and no host sync, for capture in a CUDA graph or a ``torch.compile(fullgraph=True)`` learner step
        (``boundaries``: ``"allow"`` or ``"forbid"``; ``generator``: a device ``torch.Generator``, ``None``: the device
        default, the only one a compiled step can hold; ``frame_stack``, ``frame_stride``, ``n_step_return``: as in
        :meth:`sample`; ``minibatches=K``: one draw of ``K`` minibatches of ``batch_size``, leaves ``(K, B, ...)``)."""
        from gpubuf.replay.sampling.graph_sampler import GraphSampler

        return GraphSampler(self, batch_size, with_next_obs, generator, boundaries, frame_stack=frame_stack,
                            frame_stride=frame_stride, n_step_return=n_step_return, minibatches=minibatches)

    @locked
    def graph_writer(self):
        """A :class:`~gpubuf.replay.capturable.writer.GraphWriter`: inserts with device ops only (no host
        read, nothing the host decides from the data), for a step traced by ``torch.compile(fullgraph=True)`` or
        captured in a CUDA graph with the env step and a :meth:`graph_sampler`. From then on the host's bookkeeping
        is a copy that :meth:`catch_up` refreshes, which every eager call of the buffer runs first."""
        from gpubuf.replay.capturable.writer import GraphWriter

        return GraphWriter(self)

    def device_ring(self):
        """The :class:`~gpubuf.replay.capturable.device_ring.DeviceRing` of this buffer (made on first use, then kept
        current by every eager write, and caught up by :meth:`catch_up`)."""
        if self._device_ring is None:
            from gpubuf.replay.capturable.device_ring import DeviceRing

            self._device_ring = DeviceRing(self.ring, self.device)
            self.parts.append(self._device_ring)
            self._guard.behind = self.catch_up
        return self._device_ring

    def catch_up(self) -> None:
        """Bring the host's bookkeeping up to the device's after :class:`~gpubuf.replay.capturable.writer.GraphWriter`
        inserts: one read of the device counters, then of the rows' flags and validity written since (nothing before
        a graph writer was made, or while a CUDA graph is captured). Raises ``ValueError`` once for graph inserts that
        wrote nothing since the last catch-up (a value its stored dtype cannot hold)."""
        ring = self._device_ring
        if ring is None or self.table.capturing():
            return
        with self.lock:
            behind, dropped = ring.catch_up()
            if behind:
                self.sampler.valid_to_host()
            if dropped:
                from gpubuf.replay.capturable.writer import dropped_error

                raise dropped_error(dropped)

    @locked
    def num_unserved(self, with_next_obs: bool = False, boundaries: str = "allow") -> int:
        """Valid starts (for :meth:`sample` with this ``with_next_obs`` and ``boundaries``) that the buffer's queue
        selector (``Fifo``, ``Lifo``, ``Online``) has not served yet; ``ValueError`` without one."""
        if self.selector is None or not self.selector.queue:
            raise ValueError(f"num_unserved: this buffer's selector ({self.selector!r}) keeps no queue")
        kind = self.config.kind(with_next_obs, boundaries)
        self.sampler.activate(kind)
        return self.selector.unserved(kind)
