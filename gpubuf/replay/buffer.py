"""TransitionBuffer: a time-major circular buffer sampled as contiguous n-step windows.

A buffer composes five parts, each behind a small surface and public for companions
(``ShardedBuffer``, ``GraphSampler``): ``config`` (:class:`~gpubuf.replay.config.ReplayConfig`:
sizes, leaves and their rules), ``storage`` (:mod:`gpubuf.replay.storage.memory`: device, host or memory-mapped
rows), ``ring`` (:class:`~gpubuf.replay.ring.StartRing`: host bookkeeping of positions, episode flags and
valid starts), ``sampler`` (:mod:`gpubuf.replay.sampling.samplers`: device validity, prefix-sum trees,
priorities, draws) and ``reader`` (:class:`~gpubuf.replay.sampling.readers.BatchReader`: the gathers of drawn
starts), plus the host ``generator`` that draws. A flat start is ``row * n_envs + env`` in every
storage. A sample checks its arguments, draws starts (``sampler.draw``), then reads their windows
(``reader.prepare``'s read); its signature is :meth:`gpubuf.replay.sampling.sample_args.Samples.sample`.

Episode boundaries (``sample(boundaries=...)``; an episode ends at a row whose ``terminated`` or
``truncated`` is set; needs one of those leaves):

- ``"allow"`` (default): windows run on into the next episode, unmarked;
- ``"mask"`` (Dreamer style): the same windows, and the batch carries ``is_first`` and ``mask``
  ``(B, n_steps)`` bool: ``is_first[:, j]`` is set where row ``j - 1`` ended an episode (and at
  ``j = 0``), ``mask[:, j]`` while no earlier row of the window ended one;
- ``"forbid"`` (TD-MPC2 style): only windows whose first ``n_steps - 1`` rows end no episode are
  drawn; the batch carries ``is_first`` and ``mask`` too (first step only, and all set).

Both also carry ``has_transition``, False exactly on ``info["is_last"]`` rows: they hold an
episode's last observation (inside ``mask``, as world models need it) but no transition (the
action fill, reward 0), so a learner of transitions selects ``mask & has_transition``.

With ``n_steps == 1`` the flags are ``(B,)`` and all set. An ``info["is_last"]`` row (an
:class:`~gpubuf.EnvPoolSource`'s row holding an episode's last observation and no transition)
never starts a window, and with ``"mask"`` the row after it starts the next episode.

Writes are two-phase: every leaf is checked and staged first (where any conversion fails), then
committed with copies that cannot fail on staged data, with Ctrl-C and timer signals held.
"""

import numpy as np
import torch

from gpubuf import ops
from gpubuf._core.concurrency import CallGuard, locked
from gpubuf._core.inputs import check_bool, generator_for, host_indices, index_array, int_seed
from gpubuf._core.signals import signals_held
from gpubuf._core.staging import memory_ranges
from gpubuf._core.transition import Transition
from gpubuf.replay import provenance
from gpubuf.replay.buffer_state import BufferState
from gpubuf.replay.config import BOUNDARIES, ReplayConfig
from gpubuf.replay.feeds import write_backs
from gpubuf.replay.feeds.rate_limiter import check_limiter
from gpubuf.replay.feeds.writer_doors import WriterDoors
from gpubuf.replay.ring import StartRing
from gpubuf.replay.sampling.readers import BatchReader
from gpubuf.replay.sampling.sample_args import Samples
from gpubuf.replay.sampling.samplers import TreeSampler, UniformSampler
from gpubuf.replay.sampling.selectors import check_selector
from gpubuf.replay.steady_insert import SteadyInsert
from gpubuf.replay.storage import tiers
from gpubuf.replay.storage.memory import MappedStorage, MemoryStorage

__all__ = ["BOUNDARIES", "Transition", "TransitionBuffer"]


class TransitionBuffer(Samples, WriterDoors, BufferState):
    """A circular buffer of transitions sampled uniformly as contiguous ``n_steps`` windows.

    Args:
        max_size: transitions held across all envs; each env gets ``M = max_size // E`` rows, so
            the buffer holds ``M * E`` (a remainder of ``max_size`` is not used).
        sample_batch_size: default number of windows per :meth:`sample`.
        data_sample: a :class:`Transition` shaped like an insert: leaves ``(T, E, ...)`` when
            ``vectorized_env`` (``E`` = size of axis 1), else ``(T, ...)``; fixes keys, shapes and
            dtypes.
        vectorized_env: store env rollouts ``(T, E, ...)`` as is; the env axis folds into the batch
            on sampling.
        n_steps: window length; ``1`` returns single transitions ``(B, ...)``, else
            ``(B, n_steps, ...)``.
        device: sampling device (validity, prefix-sum trees, priorities, returned batches);
            ``None`` -> ``cuda`` when available, else ``cpu``.
        seed: an int in ``[-2**63, 2**64)`` seeding the buffer's own generator (used when
            :meth:`sample` gets ``key=None``); ``None`` seeds it from the OS.
        storage_device: where the transitions live: ``None`` (on ``device``) or ``"cpu"`` (host
            memory: a CUDA buffer then gathers sampled windows on the host, reading the starts back
            once per sample, and moves them to the device through pinned memory with non-blocking
            copies).
        storage_dir: a directory of memory-mapped files (one per leaf, env-major ``(E, M,
            *shape)``). If it holds a buffer of this configuration (a mismatch raises, naming the
            field), that buffer is re-opened: rows and counts as of its last insert, and what its
            last :meth:`flush` saved (sampling RNG; priorities, rows inserted after that flush at
            ``max_priority``). The buffer holds the directory's lock until :meth:`close`; files are
            allocated up front; a process killed at any instant re-opens to a state the buffer has
            been in (:mod:`gpubuf.replay.storage.directory` for the guarantee).
        rate_limiter: a :class:`~gpubuf.RateLimiter` (one per buffer): :meth:`insert` and
            :meth:`sample` wait for their turn (threads; holding no lock while they wait), its counts
            ride along in ``state_dict`` and a ``storage_dir``'s flushes. ``None``: no limit.
        selector: which valid starts :meth:`sample` draws (:mod:`gpubuf.replay.sampling.selectors`: ``Recency``,
            ``Mixture`` of uniform, prioritized and recency, ``Fifo``/``Lifo`` queues, DreamerV3's ``Online``
            queue; one per buffer). ``None``: the buffer's own draw.

    Sampling costs O(B * levels * fanout) for the tree descent plus the windows' bytes, whatever the
    capacity. Without replacement the draw is exact sequential sampling without replacement
    (:mod:`gpubuf.replay.sampling.samplers`).

    Threads: any number of threads may call any method at once; each call runs whole, between the
    others (:attr:`lock`, re-entrant; on CUDA, calls from different streams are ordered on the
    device as on the host: :mod:`gpubuf._core.concurrency`). ``copy.deepcopy``, ``pickle`` and
    ``torch.save`` give an independent, complete buffer (:mod:`gpubuf._core.copies`); a ``storage_dir``
    buffer refuses (use :meth:`save` or ``state_dict``).
    """

    # write-backs the last update_rows / update_priorities call given generations dropped (their rows
    # were overwritten since the sample); 0 after a call without generations
    stale_updates = 0

    def __init__(self, max_size: int, sample_batch_size: int, data_sample: Transition,
                 vectorized_env: bool = True, n_steps: int = 1, *, device=None,
                 seed: int | None = None, storage_device=None, storage_dir=None, rate_limiter=None,
                 selector=None):
        seed = None if seed is None else int_seed("seed", seed)
        self.config = config = ReplayConfig.build(type(self).__name__, max_size, sample_batch_size,
                                                  data_sample, vectorized_env, n_steps,
                                                  self._config_extra())
        self._init_storage = (storage_device, storage_dir)  # as given, for copies
        for name in ReplayConfig.STATE_FIELDS:
            setattr(self, name, getattr(config, name))
        self.device = ops.resolve_device(device)
        self.table = ops.backend_table(self.device)  # what each op call runs, decided once
        self.backend, self._guard = self.table.name, CallGuard(self.device)
        self.storage_device = tiers.storage_device_for(self.device, storage_device, storage_dir)
        self.rate_limiter = check_limiter(rate_limiter, config.max_rows * config.n_envs, self._row_items,
                                          config.sample_batch_size)
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
            self.reader = BatchReader(config, self.storage, self.ring, self.table)
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
            self.rate_limiter.attach(self._guard, self._row_items, config.sample_batch_size)
        self._hub = None  # the writers in other processes (WriterHub), once one was handed out

    def _reopen(self, state: dict | None, since: int) -> None:
        """Restore a re-opened ``storage_dir``'s flushed ``state`` (``None``: none) into the sampler and the
        rate limiter (``since``: rows held written after that flush)."""
        self.sampler.reopen(state, since)
        if self.selector is not None:
            self.selector.rows_loaded()
        if self.rate_limiter is not None:
            saved = None if state is None else state.get("rate_limiter")
            if saved is not None:  # every row written after the flush, held still or overwritten since
                after = max(0, self.ring.total - int(state["total"])) if since else 0
                saved = {**saved, "inserts": saved["inserts"] + after * self.config.n_envs}
            self.rate_limiter.load(saved, len(self))

    @property
    def _row_items(self) -> int:  # transitions of the smallest insert: one row of every env
        return self.config.n_envs if self.config.vectorized_env else 1

    def _config_extra(self) -> tuple:  # hook: the subclass's own configuration fields
        return ()

    def _make_sampler(self) -> TreeSampler:  # hook: the sampling policy composed here
        return UniformSampler(self.ring, self.table)

    @property
    def lock(self):
        """The re-entrant lock every call holds: hold it to make several calls one step, as
        another thread sees them (``with buf.lock: ...``), or around the replay of a captured
        graph that samples this buffer."""
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

    def __len__(self) -> int:  # transitions stored: rows held times envs
        return self.ring.count * self.n_envs

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
        """Number of valid sequence starts for :meth:`sample` with this ``with_next_obs`` and
        ``boundaries``."""
        return self.sampler.count_valid(self.config.kind(with_next_obs, boundaries))

    @locked
    def sampling_mass(self, with_next_obs: bool = False, boundaries: str = "allow") -> torch.Tensor:
        """``(max_size,)`` float64 copy of the mass each flat start is drawn with by :meth:`sample`:
        0 when invalid, 1 when valid (uniform), ``priority**alpha`` (prioritized). A read-only
        diagnostic."""
        return self.sampler.sampling_mass(self.config.kind(with_next_obs, boundaries))

    # an opaque call under torch.compile: no guards on host state, no recompiles
    @torch.compiler.disable
    @locked
    def insert(self, transition: Transition):
        """Write ``T`` rows per env at ``(insert_position + arange(T)) % M``; returns ``self``.
        Leaves ``(T, E, ...)`` (``(T, ...)`` not vectorized), ``1 <= T <= M``, with the leaves,
        shapes and value-preserving dtypes of ``data_sample`` (:func:`gpubuf._core.inputs.check_cast`);
        nothing is written on any error (a ``storage_dir`` buffer in a process other than the one
        that opened it, a fork, raises ``RuntimeError`` naming both pids). Device
        ``truncated``/``terminated`` are read back. Host
        storage: an insert of numpy arrays with the signature of the last one accepted takes the
        steady-state path (:mod:`gpubuf.replay.steady_insert`). With a :attr:`rate_limiter` the call first
        waits for its turn having let go of the buffer's lock (``TimeoutError`` after the limiter's
        ``timeout``); an insert that then fails gives its count back."""
        limiter = self.rate_limiter
        n = None if limiter is None else self.config.items_in(transition)
        if n is None:  # no limiter, or a malformed insert: its own error
            return self._insert(transition)
        return self.insert_in_turn(transition, n)

    def _insert(self, transition: Transition):
        """:meth:`insert` once its turn came (under the lock)."""
        staged = steady = self._steady.match(transition, self._owned)
        if steady is not None:  # the last accepted signature: numpy arrays of the stored layout
            self.storage.check_open()
            T = next(iter(staged.values())).shape[0]
            trunc, ends, last = self._steady.row_flags(staged, T)
        else:
            values, given, T = self.config.rows(transition)
            self.storage.check_open()
            trunc, ends, last = self.config.row_flags(values, T)
            # phase 1: any conversion error happens here
            staged = self.storage.stage(values, given, self._owned)
        ring = self.ring
        with signals_held():  # phase 2: commit
            self.storage.before_write(ring.pos, ring.count, ring.total, T)
            pos, before_wrap = ring.write(T, trunc, ends, last)
            self.storage.write(staged, pos, before_wrap, T)
            self.sampler.rows_written(pos, before_wrap, T)
            if self.selector is not None:
                self.selector.rows_written(pos, before_wrap, T)
            self.sampler.refresh_after_write(pos, T)
            self.reader.rows_written(pos, before_wrap, T)
            self.storage.after_write(ring.pos, ring.count, ring.total)
        if steady is None:
            self._steady.learn(transition, given)
        if self.rate_limiter is not None:
            self.rate_limiter.set_size(len(self))
        return self

    def check_sample_args(self, batch_size, with_replacement: bool, with_next_obs: bool,
                          boundaries: str = "allow") -> tuple[int, int]:
        """``(batch size, validity kind)`` of a :meth:`sample` call, or the error it raises (a
        check the sampling calls run under :attr:`lock`; it takes none itself)."""
        B, kind = self.config.batch_size(batch_size), self.config.kind(with_next_obs, boundaries)
        self._check_draw(kind, B, with_replacement)
        return B, kind

    def _check_draw(self, kind: int, B: int, with_replacement: bool) -> None:
        distinct = not with_replacement if self.selector is None else self.selector.distinct(with_replacement)
        self.sampler.check_draw(kind, B, not distinct)
        if self.selector is not None:
            self.selector.check(kind, B, with_replacement)

    @locked
    def _sample(self, key, with_replacement, batch_size, with_next_obs, boundaries, out,
                return_indices, frame_stack, frame_stride, n_step_return, return_generations=False):
        """:meth:`sample` with the buffer's defaults resolved: check, draw, read."""
        if type(with_next_obs) is not bool:
            with_next_obs = check_bool("with_next_obs", with_next_obs)
        if type(with_replacement) is not bool:
            with_replacement = check_bool("with_replacement", with_replacement)
        if type(return_indices) is not bool:
            return_indices = check_bool("return_indices", return_indices)
        if type(return_generations) is not bool:
            return_generations = check_bool("return_generations", return_generations)
        if self._hub is not None:
            self._hub.collect()
        reader = self.reader
        plain = frame_stack is None and n_step_return is None and type(frame_stride) is int and frame_stride == 1
        spec = None if plain else reader.spec(frame_stack, frame_stride, n_step_return, out)  # steady: no call
        returns = spec is not None and spec.n is not None
        if self.rate_limiter is None:
            B, kind = self.check_sample_args(batch_size, with_replacement, with_next_obs or returns,
                                             boundaries)
            return self._draw_and_read(key, B, kind, with_replacement, with_next_obs, boundaries, out,
                                       spec, return_indices, return_generations)
        B, kind = self.config.batch_size(batch_size), self.config.kind(with_next_obs or returns, boundaries)
        self.rate_limiter.take("sample", B)  # waits for its turn, letting go of the lock
        try:
            self._check_draw(kind, B, with_replacement)  # the rows as they are after the wait
            return self._draw_and_read(key, B, kind, with_replacement, with_next_obs, boundaries, out,
                                       spec, return_indices, return_generations)
        except BaseException:
            self.rate_limiter.give_back("sample", B)
            raise

    def _draw_and_read(self, key, B, kind, with_replacement, with_next_obs, boundaries, out, spec,
                       return_indices, return_generations):
        """Draw ``B`` starts of ``kind`` and read their batch (under the lock)."""
        reader = self.reader
        g = generator_for(key, self.generator)
        what = reader.check_memory(B, with_next_obs, spec, with_replacement, out is None)
        # a failed sample leaves the generator as it was (an int key's is new for this call)
        rng = g.get_state() if key is None or isinstance(key, torch.Generator) else None
        try:
            read = reader.prepare(B, with_next_obs, boundaries, spec, out, self._owned)
            idx, mass = (self.selector or self.sampler).draw(kind, B, g, with_replacement)
            batch = read(idx)
            self.sampler.weigh(batch, mass)
        except BaseException as err:
            if rng is not None:
                g.set_state(rng)
            if ops.allocation_failed(err):
                raise ops.memory_error("batch_size", what, err) from None
            raise
        if return_generations:
            return batch, idx, write_backs.generations(self.ring, idx)
        return (batch, idx) if return_indices else batch

    @locked
    def episode_marks(self):
        """The :class:`~gpubuf.replay.sampling.episode_marks.EpisodeMarks` of this buffer (built on first use,
        then kept current by every write)."""
        return self.reader.marks()

    @locked
    def gather(self, starts, jobs: dict, out=None, boundaries: str = "allow") -> Transition:
        """The flagged batch of windows of flat ``starts`` (B,) for ``storage.check_out``'s
        jobs."""
        return self.reader.windows(starts, jobs, out, boundaries)

    @locked
    def graph_sampler(self, batch_size=None, with_next_obs: bool = False, generator=None,
                      boundaries="allow", *, frame_stack: int | None = None,
                      frame_stride: int = 1, n_step_return: tuple[int, float] | None = None,
                      minibatches: int = 1):
        """A :class:`~gpubuf.GraphSampler`: sampling with replacement into fixed tensors, with
        device-side random numbers and no host sync, for capture in a CUDA graph or a
        ``torch.compile(fullgraph=True)`` learner step (``boundaries``: ``"allow"`` or
        ``"forbid"``; ``generator``: a device ``torch.Generator``, ``None``: the device default,
        the only one a compiled step can hold; ``frame_stack``, ``frame_stride``,
        ``n_step_return``: as in :meth:`sample`; ``minibatches=K``: one draw of ``K`` minibatches of
        ``batch_size``, leaves ``(K, B, ...)``)."""
        from gpubuf.replay.sampling.graph_sampler import GraphSampler

        return GraphSampler(self, batch_size, with_next_obs, generator, boundaries,
                            frame_stack=frame_stack, frame_stride=frame_stride,
                            n_step_return=n_step_return, minibatches=minibatches)

    # an opaque call under torch.compile: no guards on host state, no recompiles
    @torch.compiler.disable
    @locked
    def update_rows(self, indices, values: dict, *, generations=None):
        """Write ``values`` ``{name: (B, ...)}`` into the stored ``info`` leaves (say latents a
        world model computed from the sampled windows) at flat starts ``indices`` (B,); returns
        ``self``. A leaf's ``(B, *shape)`` values go to the start rows; with ``n_steps > 1``,
        ``(B, n_steps, *shape)`` values go to every row of the windows. With ``generations`` (from
        ``sample(..., return_generations=True)``) the starts whose rows were overwritten since the
        sample are skipped, and :attr:`stale_updates` counts them. Duplicate starts: one of their
        values is kept. Observations, actions, rewards and flags are not written back.

        Raises (writing nothing) on a name that is not an ``info`` leaf, a misshapen value or one
        its leaf's dtype cannot hold, non-integer indices or ones outside ``[0, max_size)``
        (``IndexError``), a rows not held (``IndexError``, without ``generations``), or a closed
        ``storage_dir`` buffer; on a ``storage_dir`` the values reach the files as the other rows do
        (made durable by ``flush()``)."""
        self.storage.check_open()
        idx = index_array(indices).to(torch.int64)
        checked = write_backs.row_values(self.config, values, idx.shape[0], self.config.n_steps)
        write_backs.check_range(self.ring, idx)
        if generations is None:
            self.stale_updates = 0
            self.ring.locate(idx.cpu().numpy())  # IndexError for a row not held
        else:
            keep = self._current(idx, generations)
            idx = idx[keep]
            checked = {p: (t[keep.to(t.device)], w) for p, (t, w) in checked.items()}
        if idx.numel():
            with signals_held():
                write_backs.write_rows(self.storage, self.ring, idx, checked, self.config.n_steps)
        return self

    def _current(self, idx: torch.Tensor, generations) -> torch.Tensor:
        """The mask of flat starts ``idx`` (K,) still holding ``generations``, the others counted
        into :attr:`stale_updates`."""
        keep = write_backs.current(self.ring, idx, generations)
        self.stale_updates = int(keep.numel() - keep.sum())
        return keep

    # an opaque call under torch.compile: no guards on host state, no recompiles
    @torch.compiler.disable
    @locked
    def cut_episodes(self, envs=None):
        """End every env's episode (``envs``: a ``(n_envs,)`` bool mask of the envs to end) at its newest row,
        in place: ``truncated`` is set there (unless that row
        ends an episode already, a termination say), so no window
        with ``boundaries="mask"``/``"forbid"``, next observation, n-step return or stack reaches past it
        (its successor counts as unknown, as after a truncation whose final observation was not kept).
        What a source without ``info["is_last"]`` rows does when its run is cut (a ``reset()``, the buffer
        detached). Returns ``self``; an empty buffer is left as it is; ``ValueError`` without a
        ``truncated`` leaf."""
        paths = self.config.paths("truncated")
        if not paths:
            raise ValueError("cut_episodes: the buffer stores no truncated leaf to mark the cut with")
        self.storage.check_open()
        ring = self.ring
        if ring.count == 0:
            return self
        row = (ring.pos - 1) % ring.max_rows
        cut = ~ring.ends[row]  # a row that already ends an episode (terminated: drawn with discount 0) stays
        if envs is not None:
            cut &= np.asarray(envs, bool)
        if not cut.any():
            return self
        mask = torch.from_numpy(cut)
        with signals_held():
            for path in paths:
                t = self.storage.data[path]
                if self.config.vectorized_env:
                    t[row][mask.to(t.device)] = True  # (E, ...) view of the row: written through
                else:
                    t[row] = True
            ring.truncate_row(row, cut)
            self.reader.rows_written(row, 1, 1)
            self.sampler.refresh_after_write(row, 1)
        return self

    @locked
    def num_unserved(self, with_next_obs: bool = False, boundaries: str = "allow") -> int:
        """Valid starts (for :meth:`sample` with this ``with_next_obs`` and ``boundaries``) that the buffer's queue
        selector (``Fifo``, ``Lifo``, ``Online``) has not served yet; ``ValueError`` without one."""
        if self.selector is None or not self.selector.queue:
            raise ValueError(f"num_unserved: this buffer's selector ({self.selector!r}) keeps no queue")
        kind = self.config.kind(with_next_obs, boundaries)
        self.sampler.activate(kind)
        return self.selector.unserved(kind)

    @locked
    def locate(self, indices) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(env, row, step)`` of flat starts ``indices`` (any shape), int64 shaped like
        ``indices`` on their device: ``row * n_envs + env`` splits into ring ``row`` and ``env``;
        ``step`` counts the env's rows from the first this buffer wrote (a :meth:`load_state_dict`
        numbers its rows from 0; with an :class:`~gpubuf.EnvPoolSource` in sync mode, row ``step``
        shows the env after ``step`` calls of ``step()``). ``IndexError`` for an index outside ``[0,
        max_size)`` or a row not held. A buffer of ``vectorized_env=False`` holds one stream, which a
        source with several envs interleaves: ``env`` is each row's stored ``info["env_id"]`` (a
        source's ``transition_sample(vectorized=False)`` has it), else 0, and ``step`` counts the
        stream's rows (:mod:`gpubuf.replay.provenance`)."""
        flat, device = host_indices(indices)
        return tuple(torch.from_numpy(a).to(device)
                     for a in provenance.locate(self.config, self.storage, self.ring, flat))
