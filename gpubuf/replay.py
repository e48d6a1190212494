"""Transition and TransitionBuffer: a time-major circular buffer sampled as contiguous n-step windows.

Storage per leaf (every tensor of a ``Transition``, nested dicts included) is one preallocated
``(M, E, *shape)`` device tensor (``(M, *shape)`` when not vectorized; internally ``E = 1``), or a
transposed view of an env-major ``(E, M, *shape)`` file with a ``storage_dir``. A sequence start is the
flat index ``step * E + env`` in either layout. Three parts cooperate: the buffer owns the storage, staging and
window gather; a :class:`~gpubuf.ring.StartRing` keeps the host bookkeeping (write position, counts,
truncation flags, which starts are valid: window inside written rows, off the write seam, no truncation
inside when next observations are inferred); a sampling policy (:mod:`gpubuf.samplers`) turns validity
into mass in a wide prefix-sum tree and draws starts. An insert only rewrites the leaves of the starts
whose windows changed and their parents. Sampling draws starts, then gathers the ``(B, n_steps)``
windows in one launch per word type.

Writes are two-phase: every leaf is checked and staged first (where any conversion fails), then committed
with copies that cannot fail on staged data. Validity is kept apart from priority: a device mask per
validity kind says which starts may be drawn, and a valid start's mass is never zero.
"""

import warnings

import numpy as np
import torch

from gpubuf import checkpoint, ops, tiers
from gpubuf.inputs import as_tensor, check_cast, check_storable, positive_int
from gpubuf.interrupts import signals_held
from gpubuf.kernels.words import as_words
from gpubuf.ring import IN_EPISODE, NEXT_OBS, StartRing
from gpubuf.samplers import UniformSampler
from gpubuf.staging import Staging, check_disjoint, memory_ranges, overlaps
from gpubuf.state import check_range, check_state, copy_into, host_tensor, unaliased
from gpubuf.storage_dir import StorageDir
from gpubuf.transition import Transition, flatten, leaf_name, unflatten

BOUNDARIES = ("allow", "mask", "forbid")
_NOT_IN_NUMPY = (torch.bfloat16, torch.complex32, torch.float8_e4m3fn, torch.float8_e5m2)  # storable, no numpy twin


class TransitionBuffer(checkpoint.Checkpointable):
    """A circular buffer of transitions sampled uniformly as contiguous ``n_steps`` windows.

    Args:
        max_size: transitions held across all envs; each env gets ``M = max_size // E`` rows.
        sample_batch_size: default number of windows per :meth:`sample`.
        data_sample: a :class:`Transition` shaped like an insert: leaves ``(T, E, ...)`` when
            ``vectorized_env`` (``E`` = size of axis 1), else ``(T, ...)``; fixes keys, shapes and dtypes.
        vectorized_env: store env rollouts ``(T, E, ...)`` as is; the env axis folds into the batch on sampling.
        n_steps: window length; ``1`` returns single transitions ``(B, ...)``, else ``(B, n_steps, ...)``.
        device: sampling device (validity, prefix-sum trees, priorities, returned batches); ``None`` ->
            ``cuda`` when available, else ``cpu``.
        seed: seed of the buffer's own generator (used when :meth:`sample` gets ``key=None``).
        storage_device: where the transitions live: ``None`` (on ``device``) or ``"cpu"`` (host memory: a
            CUDA buffer then gathers sampled windows on the host, reading the starts back once per sample,
            and moves them to the device through pinned memory with non-blocking copies). Host RAM keeps the
            time-major layout: there an env-major one gathers large frames only about 15 % faster, small
            leaves about 2x slower, and scatters every insert over the envs (:mod:`gpubuf.tiers`).
        storage_dir: a directory for memory-mapped storage (host memory backed by one file per leaf, laid out
            env-major ``(E, M, *shape)``: a window's rows are adjacent on disk, one read). If it already
            holds a buffer of this configuration and layout (any mismatch raises, naming the field), that
            buffer is re-opened: its rows, write position and counts as of its last insert, and what its last
            :meth:`flush` saved (sampling RNG; priorities for a prioritized buffer, with rows inserted after
            that flush at ``max_priority``). One writer: the buffer holds the directory's lock until
            :meth:`close` (or until it is garbage collected or its process ends); a second opener gets a
            ``ValueError`` naming the holder. The files are allocated on disk up front (no room: a
            ``ValueError`` before anything is written). Crash safety: a process killed at any instant re-opens
            to a state the buffer has been in (rows being overwritten are dropped, a half-done
            :meth:`load_state_dict` re-opens empty); after an operating-system crash, exact as of the last
            :meth:`flush` when nothing was written after it, else empty (:mod:`gpubuf.storage_dir`).

    Sampling cost is O(B * levels * fanout) for the tree descent plus the bytes of the windows: it does not
    grow with capacity (with replacement and no stored truncation, a uniform draw skips the tree: the valid
    starts are then one ring range of rows). Without replacement the draw is exact sequential sampling
    without replacement (here: uniform over valid starts): rounds of draws with replacement from the tree,
    keeping first appearances, with the drawn starts' mass zeroed between rounds and restored at the end.
    Each round reads the number of distinct draws back from the device (one sync per round; typically one
    or two rounds unless the batch is a large fraction of the valid starts).
    """

    def __init__(self, max_size: int, sample_batch_size: int, data_sample: Transition, vectorized_env: bool = True,
                 n_steps: int = 1, *, device=None, seed: int | None = None, storage_device=None, storage_dir=None):
        max_size = positive_int("max_size", max_size)
        self.sample_batch_size = positive_int("sample_batch_size", sample_batch_size)
        self.n_steps = positive_int("n_steps", n_steps)
        self.vectorized_env = bool(vectorized_env)
        samples = {p: as_tensor(v, leaf_name(p)) for p, v in flatten(data_sample, "data_sample").items()}
        if not samples:
            raise ValueError("data_sample: expected at least one non-None field")
        for p, t in samples.items():
            check_storable(t.dtype, f"data_sample.{leaf_name(p)}")
        lead = 2 if self.vectorized_env else 1
        for p, t in samples.items():
            if t.dim() < lead:
                want = "(T, E, ...)" if self.vectorized_env else "(T, ...)"
                raise ValueError(f"data_sample.{leaf_name(p)}: expected leaves shaped {want}, got {tuple(t.shape)}")
        if self.vectorized_env:
            envs = {p: t.shape[1] for p, t in samples.items()}
            E = next(iter(envs.values()))
            if any(e != E for e in envs.values()) or E < 1:
                raise ValueError(f"data_sample: every leaf needs the same env axis (axis 1) >= 1, got "
                                 f"{ {leaf_name(p): e for p, e in envs.items()} }")
        else:
            E = 1
        self.n_envs = E
        if max_size < E:
            raise ValueError(f"max_size: expected at least one row per env ({E} envs), got {max_size}")
        if max_size % E:
            warnings.warn(f"max_size: {max_size} is not divisible by {E} envs; rounded down to {max_size // E * E}",
                          stacklevel=2)
        self.max_rows = M = max_size // E
        self.max_size = M * E
        if not 1 <= self.n_steps <= M:
            raise ValueError(f"n_steps: expected 1 <= n_steps <= {M} rows per env, got {self.n_steps}")
        most = E * (M - self.n_steps + 1)
        if self.sample_batch_size > most:
            raise ValueError(f"sample_batch_size: expected at most {most} (= E*(M-n_steps+1)), "
                             f"got {self.sample_batch_size}")
        self.device = ops.resolve_device(device)
        self.backend = ops.backend_for(self.device)
        self.storage_device = tiers.storage_device_for(self.device, storage_device, storage_dir)
        self._storage_backend = ops.backend_for(self.storage_device)
        self._shapes = {p: tuple(t.shape[lead:]) for p, t in samples.items()}
        self._want = {p: ((E,) if self.vectorized_env else ()) + s for p, s in self._shapes.items()}  # per-row
        self._names = {p: leaf_name(p) for p in samples}
        self._dtypes = {p: t.dtype for p, t in samples.items()}
        self._has_next_obs = any(p[0] == "next_observation" for p in samples)
        self._obs_paths = [p for p in samples if p[0] == "observation"]
        self._trunc_paths = [p for p in samples if p[0] == "truncated"]
        self._end_paths = [p for p in samples if p[0] in ("terminated", "truncated")]
        self._last_paths = [p for p in samples if p == self._IS_LAST]  # rows holding no transition
        # Validity kinds (gpubuf.ring): NEXT_OBS when next observations are inferred from the following row,
        # IN_EPISODE when windows may not cross an episode end
        kinds = (0,) if self._has_next_obs or not self._obs_paths else (0, NEXT_OBS)
        if self._end_paths:
            kinds += tuple(k | IN_EPISODE for k in kinds)

        dtypes = {leaf_name(p): self._dtypes[p] for p in samples}
        if storage_dir is None:  # time-major (M, E, *shape)
            shapes = {leaf_name(p): ((M, E) if self.vectorized_env else (M,)) + s for p, s in self._shapes.items()}
            self._dir = None
            storage = base = ops.allocate(shapes, dtypes, self.storage_device)
        else:  # env-major files (E, M, *shape), written through (M, E, *shape) views
            shapes = {leaf_name(p): (E, M) + s for p, s in self._shapes.items()}
            self._dir = StorageDir(storage_dir, self._dir_config(), shapes, dtypes)
            base = self._dir.tensors
            storage = {k: t.transpose(0, 1) if self.vectorized_env else t[0] for k, t in base.items()}
        try:  # a failure from here on releases the storage_dir's lock at once
            self._ring = StartRing(M, E, self.n_steps, kinds)  # host bookkeeping
            self._sampler = self._make_sampler()  # trees, validity masks (and priorities) on the device
            self._data = {p: storage[leaf_name(p)] for p in samples}
            self._flat = {p: base[leaf_name(p)].view(M * E, -1) for p in samples}  # (M*E, D) contiguous views
            # the same rows as int words (gpubuf.kernels.words.as_words): windows are gathered and allocated as words
            self._words = {p: as_words(t)[0] for p, t in self._flat.items()}
            self._owned_at = (-1, ())  # (sampler allocations, memory ranges) of _owned
            # CPU storage as numpy views (dtypes numpy has): a same-dtype host array is written by one numpy
            # slice assignment
            self._host = {p: t.numpy() for p, t in self._data.items()
                          if self.storage_device.type == "cpu" and t.dtype not in _NOT_IN_NUMPY}
            self._staging = Staging(self.device)  # inputs bound for the sampling device
            self._store_staging = Staging(self.storage_device)  # inputs bound for the storage
            # draws come from a host generator (uniforms, or starts drawn on the host) and travel through pinned
            # staging: the same seed samples the same starts on every device, and the RNG state round-trips
            # exactly across devices
            self._gen = torch.Generator()
            if seed is not None:
                self._gen.manual_seed(int(seed))
            else:
                self._gen.seed()
            if self._dir is not None and self._dir.reopened:
                self._reopen()
        except BaseException:
            if self._dir is not None:
                self._dir.close()
            raise

    @property
    def _owned(self) -> tuple:
        """Memory ranges of every device tensor held: inputs reading them are copied before a write."""
        if self._owned_at[0] != self._sampler.allocations:
            self._owned_at = (self._sampler.allocations,
                              memory_ranges([*self._data.values(), *self._sampler.tensors()]))
        return self._owned_at[1]

    def _make_sampler(self) -> UniformSampler:
        """The sampling policy composed into this buffer."""
        return UniformSampler(self._ring, self.device, self.backend)

    # ------------------------------------------------------------------ bookkeeping

    def __len__(self) -> int:
        """Transitions stored (rows written times envs)."""
        return self._ring.count * self.n_envs

    @property
    def nbytes(self) -> int:
        """Device bytes held: storage, priorities, and the prefix-sum tree and validity mask of each sampling
        kind used so far (allocated on the first draw that needs them)."""
        return sum(t.numel() * t.element_size() for t in [*self._data.values(), *self._sampler.tensors()])

    def num_valid(self, with_next_obs: bool = False, boundaries: str = "allow") -> int:
        """Number of valid sequence starts for :meth:`sample` with this ``with_next_obs`` and ``boundaries``."""
        kind = self._kind(with_next_obs, boundaries)
        return self._ring.range_starts(kind)[1] if self._ring.one_range(kind) else self._active_valid(kind)

    def _active_valid(self, kind: int) -> int:
        self._sampler.activate(kind)
        return self._ring.n_valid[kind]

    def sampling_mass(self, with_next_obs: bool = False, boundaries: str = "allow") -> torch.Tensor:
        """``(max_size,)`` float64 copy of the mass each flat start is drawn with by :meth:`sample` with this
        ``with_next_obs`` and ``boundaries``: 0 for an invalid start, 1 for a valid one (uniform),
        ``priority**alpha`` (prioritized). A read-only diagnostic (one device copy); the sampler's own state
        is not exposed."""
        return self._sampler.sampling_mass(self._kind(with_next_obs, boundaries))

    def _kind(self, with_next_obs: bool, boundaries: str = "allow") -> int:
        """The validity kind that ``with_next_obs`` and ``boundaries`` sample from."""
        if boundaries not in BOUNDARIES:
            raise ValueError(f"boundaries: expected one of {BOUNDARIES}, got {boundaries!r}")
        if boundaries != "allow" and not self._end_paths:
            raise ValueError(f"boundaries: {boundaries!r} needs episode ends, but the buffer stores neither "
                             "terminated nor truncated")
        kind = (0 if (not with_next_obs or self._has_next_obs) else NEXT_OBS) | \
            (IN_EPISODE if boundaries == "forbid" else 0)
        if kind not in self._ring.kinds:
            raise ValueError("with_next_obs: the buffer stores neither next_observation nor observation")
        return kind

    # ------------------------------------------------------------------ insert

    @torch.compiler.disable  # an opaque call under torch.compile: no guards on host state, no recompiles
    def insert(self, transition: Transition):
        """Write ``T`` rows per env at ``(insert_position + arange(T)) % M``; returns ``self``.

        Leaves are shaped ``(T, E, ...)`` (``(T, ...)`` when not vectorized), ``1 <= T <= M``, with the key
        set and per-row shapes of ``data_sample``, and dtypes that store without changing values (narrowing casts
        of host data are checked on the values: :func:`gpubuf.inputs.check_cast`). Nothing is written on any error.
        """
        leaves = flatten(transition)
        if leaves.keys() != self._shapes.keys():
            missing = [leaf_name(p) for p in self._shapes if p not in leaves]
            extra = [leaf_name(p) for p in leaves if p not in self._shapes]
            raise ValueError(f"transition: leaves are fixed by data_sample {[leaf_name(p) for p in self._shapes]}; "
                             f"missing {missing}, unexpected {extra}")
        values, T = {}, None
        for p, v in leaves.items():
            name = self._names[p]
            t = as_tensor(v, name)
            want = self._want[p]
            if t.dim() != len(want) + 1 or t.shape[1:] != want:
                raise ValueError(f"{name}: expected shape (T, {', '.join(map(str, want))}), got {tuple(t.shape)}")
            if T is None:
                T = t.shape[0]
            elif t.shape[0] != T:
                raise ValueError(f"{name}: expected T = {T} rows like the other leaves, got {t.shape[0]}")
            check_cast(t, self._dtypes[p], name)
            values[p] = t
        M = self.max_rows
        if not 1 <= T <= M:
            raise ValueError(f"transition: expected 1 <= T <= {M} rows per insert, got T = {T}")
        if self._dir is not None:
            self._check_open()
        # a device `truncated` is read back here (pass host arrays, as env outputs are, to avoid the sync)
        trunc, ends, last = self._row_flags(values, T)
        # ---- phase 1: stage every leaf (any conversion error happens here, before the first write)
        staged = {}
        for p, t in values.items():
            v = leaves[p]
            fast = p in self._host and type(v) is np.ndarray and t.dtype == self._dtypes[p]
            if fast and not overlaps(t, self._owned):
                staged[p] = t.numpy()  # CPU storage, same dtype: one numpy slice assignment, which cannot fail
            else:
                staged[p] = self._store_staging.stage(t, self._names[p], self._dtypes[p], self._owned)
        with signals_held():  # ---- phase 2: commit
            if self._dir is not None:  # the journal forgets the held rows about to be overwritten
                self._dir.before_write(self._ring.pos, self._ring.count, self._ring.total, T, M)
            pos, first = self._ring.write(T, trunc, ends, last)  # first: rows before the ring wraps
            for p, src in staged.items():
                dst = self._host[p] if isinstance(src, np.ndarray) else self._data[p]
                if first == T:
                    dst[pos:pos + T] = src
                else:
                    dst[pos:] = src[:first]
                    dst[:T - first] = src[first:]
            self._sampler.rows_written(pos, first, T)
            self._sampler.refresh_after_write(pos, T)
            if self._dir is not None:
                self._dir.commit(self._ring.pos, self._ring.count, self._ring.total)
        return self

    def _row_flags(self, leaves: dict, T: int) -> tuple:
        """(T, E) host bool ``(truncated, episode ends, no transition)`` of ``T`` rows of ``leaves`` (each None
        without its leaves)."""
        return tuple(self._any_set(leaves, paths, T) for paths in (self._trunc_paths, self._end_paths,
                                                                    self._last_paths))

    def _any_set(self, leaves: dict, paths: list, T: int) -> np.ndarray | None:
        """(T, E) host bool: whether any of the leaves ``paths`` is nonzero in each row (None without one)."""
        if not paths:
            return None
        flags = []
        for p in paths:
            t = leaves[p].detach()
            if t.device.type == "cpu" and t.dtype not in _NOT_IN_NUMPY:
                a = t.numpy().reshape(T, self.n_envs, -1)  # host flags: numpy, a few microseconds
                flags.append(a.any(2) if a.dtype == np.bool_ else (a != 0).any(2))
            else:
                flags.append((t.reshape(T, self.n_envs, -1) != 0).any(2).cpu().numpy())
        return flags[0] if len(flags) == 1 else np.logical_or.reduce(flags)

    # ------------------------------------------------------------------ sample

    def _generator(self, key) -> torch.Generator:
        if key is None:
            return self._gen
        if isinstance(key, torch.Generator):
            return key
        if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
            if not -(2**63) <= int(key) < 2**64:
                raise ValueError(f"key: an int seed must lie in [-2**63, 2**64), got {key}")
            g = torch.Generator()
            g.manual_seed(int(key))
            return g
        raise TypeError(f"key: expected a torch.Generator, an int seed or None, got {type(key).__name__}")

    def _check_sample_args(self, batch_size, with_replacement: bool, with_next_obs: bool,
                           boundaries: str = "allow") -> tuple[int, int]:
        B = self.sample_batch_size if batch_size is None else batch_size
        if isinstance(B, bool) or not isinstance(B, (int, np.integer)) or B < 1:
            raise ValueError(f"batch_size: expected a positive int or None, got {batch_size!r}")
        if B * (self.n_steps + 1) >= 2**31:
            raise ValueError(f"batch_size: expected fewer than 2**31 window rows per sample, got {B} windows of "
                             f"{self.n_steps} rows")
        kind = self._kind(with_next_obs, boundaries)
        n = self.num_valid(with_next_obs, boundaries)
        if n == 0:
            what = (" without truncation" if kind & NEXT_OBS else "") + (" inside one episode" if kind & IN_EPISODE
                                                                          else "")
            raise ValueError(f"sample: no valid sequence start yet ({self._ring.count} rows written per env, windows "
                             f"of {self._ring.window(kind)} rows{what})")
        if not with_replacement and B > n:
            raise ValueError(f"batch_size: {B} exceeds the {n} valid starts, which sampling without replacement "
                             "needs")
        return int(B), kind

    @torch.compiler.disable  # an opaque call under torch.compile: no guards on host state, no recompiles
    def sample(self, key=None, with_replacement: bool = True, batch_size: int | None = None,
               with_next_obs: bool = False, boundaries: str = "allow", *, out: Transition | None = None,
               return_indices: bool = False):
        """A batch of ``B`` windows of ``n_steps`` rows from uniformly drawn valid starts; with
        ``return_indices=True``, ``(batch, indices)``: the windows' flat starts ``(B,)`` int64 on the device,
        ``row * n_envs + env`` (:meth:`locate` maps them to env, ring row and the env's own row count).

        Leaves come back ``(B, n_steps, ...)`` (``(B, ...)`` when ``n_steps == 1``). ``with_next_obs`` fills
        ``next_observation`` with the observation one row later (unless it is stored), and then never
        samples a window whose first ``n_steps`` rows hold a truncation. Raises ``ValueError`` when there
        is no valid start, or fewer valid starts than ``batch_size`` without replacement.

        ``boundaries`` says what a window may do at an episode end (a row whose ``terminated`` or ``truncated``
        is set; needs one of those leaves):

        - ``"allow"`` (default): windows run on into the next episode, unmarked;
        - ``"mask"`` (Dreamer style): the same windows, and the batch carries ``is_first`` and ``mask``
          ``(B, n_steps)`` bool: ``is_first[:, j]`` is set where row ``j - 1`` ended an episode (and at
          ``j = 0``: a window starts its own sequence), ``mask[:, j]`` while no earlier row of the window
          ended one (the steps of the start's episode);
        - ``"forbid"`` (TD-MPC2 style): only windows whose first ``n_steps - 1`` rows end no episode are
          drawn (the last row may end one; episodes shorter than the window are never drawn); the batch
          carries ``is_first`` and ``mask`` too (first step only, and all set).

        With ``n_steps == 1`` the flags are ``(B,)`` and all set.

        Rows of an :class:`~gpubuf.EnvPoolSource` (a buffer holding an ``info["is_last"]`` leaf, built from
        ``transition_sample()``) follow its row convention instead: a row whose ``is_last`` is set holds the
        last observation of its episode and no transition, and never starts a window (whatever
        ``boundaries`` and ``with_next_obs``); with ``"mask"``, ``is_first[:, j]`` is set where row ``j - 1``
        is such a row (row ``j`` then holds the env's reset frame) and ``mask[:, j]`` while no earlier row of
        the window is, so the last observation stays inside its episode's mask.

        ``out`` may be a :class:`Transition` of preallocated tensors of exactly the returned shapes and dtypes
        on the buffer's device: the windows are written there and ``out`` is returned (no allocation; large
        fresh CPU outputs otherwise pay page faults on every call).
        """
        if not isinstance(return_indices, bool):
            raise TypeError(f"return_indices: expected a bool, got {return_indices!r}")
        B, kind = self._check_sample_args(batch_size, with_replacement, with_next_obs, boundaries)
        dst = self._check_out(out, B, with_next_obs)
        idx, _ = self._sampler.draw(kind, B, self._generator(key), with_replacement)
        batch = self._with_flags(self._gather(idx, dst, out), boundaries)
        return (batch, idx) if return_indices else batch

    def _with_flags(self, batch: Transition, boundaries: str) -> Transition:
        """``batch`` with ``is_first`` and ``mask`` (B, n_steps) bool set from its sampled episode ends, unless
        ``boundaries == "allow"``."""
        if boundaries == "allow":
            return batch
        leaves = flatten(batch, "out")
        B, n = leaves[self._end_paths[0]].shape[0], self.n_steps
        if n == 1:
            batch.is_first = torch.ones(B, dtype=torch.bool, device=self.device)
            batch.mask = torch.ones(B, dtype=torch.bool, device=self.device)
            return batch
        if boundaries == "forbid":  # no episode end before a window's last row: constant flags
            batch.mask = torch.ones(B, n, dtype=torch.bool, device=self.device)
            batch.is_first = torch.zeros(B, n, dtype=torch.bool, device=self.device)
            batch.is_first[:, 0] = True
            return batch
        done = torch.zeros(B, n, dtype=torch.bool, device=self.device)
        # the source's rows: an episode ends after its `is_last` row (which holds its last observation)
        for p in [self._IS_LAST] if self._IS_LAST in leaves else self._end_paths:
            done |= (leaves[p] != 0).reshape(B, n, -1).any(2)
        ended = done[:, :-1]  # (B, n-1): row j ended an episode
        first = torch.ones(B, 1, dtype=torch.bool, device=self.device)
        batch.is_first = torch.cat([first, ended], 1)
        batch.mask = torch.cat([first, (~ended).cumprod(1).bool()], 1)
        return batch

    def graph_sampler(self, batch_size: int | None = None, with_next_obs: bool = False, generator=None,
                      boundaries: str = "allow"):
        """A :class:`~gpubuf.GraphSampler`: sampling with replacement into fixed tensors, with device-side
        random numbers and no host sync, for capture in a CUDA graph. ``batch_size``, ``with_next_obs`` and
        ``boundaries`` (``"allow"`` or ``"forbid"``) are fixed at construction; ``generator`` is a device
        ``torch.Generator`` (``None``: the device default)."""
        from gpubuf.graph_sampling import GraphSampler

        return GraphSampler(self, batch_size, with_next_obs, generator, boundaries)

    def _jobs(self, B: int, with_next_obs: bool):
        """(output path, source path, shift, output shape) of every returned leaf."""
        n = self.n_steps
        shifted = [] if (not with_next_obs or self._has_next_obs) else self._obs_paths
        pairs = [(p, p, 0) for p in self._data] + [(("next_observation",) + p[1:], p, 1) for p in shifted]
        return [(d, s, shift, ((B, n) if n > 1 else (B,)) + self._shapes[s]) for d, s, shift in pairs]

    def _check_out(self, out, B: int, with_next_obs: bool) -> dict:
        """{output path: (destination tensor or None, source path, shift)}, checking a caller's ``out``."""
        jobs = self._jobs(B, with_next_obs)
        if out is None:
            return {d: (None, s, shift, shape) for d, s, shift, shape in jobs}
        given = flatten(out, "out")
        result = {}
        for d, s, shift, shape in jobs:
            t = given.get(d)
            dtype = self._dtypes[s]
            if (not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype
                    or t.device != self.device or not t.is_contiguous()):
                got = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"out.{leaf_name(d)}: expected a contiguous {dtype} tensor of shape {shape} on "
                                 f"{self.device}, got {got}")
            result[d] = (t, s, shift, shape)
        check_disjoint({f"out.{leaf_name(d)}": t for d, (t, *_) in result.items()}, self._owned)
        return result

    def _gather(self, starts: torch.Tensor, jobs: dict, out: Transition | None = None) -> Transition:
        B = starts.shape[0]
        if self.storage_device == self.device:
            result, work = self._outputs(B, jobs)
            self._gather_windows(work, starts)
            return unflatten(result) if out is None else out
        # host storage: gather on the host (into pinned memory for CUDA), then one non-blocking copy per leaf
        host, work = self._outputs(B, {d: (None, *rest) for d, (_, *rest) in jobs.items()},
                                   self.storage_device, pin=self.device.type == "cuda")
        self._gather_windows(work, starts.to(self.storage_device))
        result = {}
        for d, t in host.items():
            dst = jobs[d][0]
            result[d] = t.to(self.device, non_blocking=True) if dst is None else dst.copy_(t, non_blocking=True)
        return unflatten(result) if out is None else out

    def _gather_windows(self, work: list, starts: torch.Tensor) -> None:
        """Fill :meth:`_outputs`' ``work`` with the windows of flat ``starts`` (B,) on the storage's device,
        read in the storage's layout (env-major files, else time-major)."""
        args = (self.n_steps, self.n_envs, self.max_rows)
        if self._dir is not None:
            tiers.env_major_gather(work, starts, *args, prefetch=True)
        else:
            ops.sequence_gather(self._storage_backend, work, starts, *args)

    def _outputs(self, B: int, jobs: dict, device=None, pin: bool = False) -> tuple[dict, list]:
        """``({output path: tensor}, [(source words, output words (B, n, D), shift)])`` for :meth:`_check_out`'s
        ``jobs``: the given output tensors, or fresh ones on ``device`` (default: the buffer's; ``pin``:
        in pinned host memory)."""
        n, device = self.n_steps, self.device if device is None else device
        result, work = {}, []
        for d, (dst, s, shift, shape) in jobs.items():
            src = self._words[s]
            if dst is None and src.shape[1] == 0:  # zero-width leaf: nothing to gather
                dst = torch.empty(shape, dtype=self._dtypes[s], device=device)
                result[d] = dst
                continue
            if dst is None:
                try:
                    words = torch.empty((B, n, src.shape[1]), dtype=src.dtype, device=device, pin_memory=pin)
                except (RuntimeError, torch.OutOfMemoryError) as err:
                    raise MemoryError(f"batch_size: {B} windows need an output of shape {shape} for "
                                      f"{leaf_name(d)}, which cannot be allocated on {device} "
                                      f"({str(err).splitlines()[0]})") from None
                dst = words.view(torch.uint8).view(self._dtypes[s]).view(shape)
            else:  # a caller's tensor may sit at any offset: both sides get a word type they share
                flat = self._flat[s]
                src, words = as_words(flat, dst.view(B * n, flat.shape[1]))
                words = words.view(B, n, src.shape[1])
            work.append((src, words, shift))
            result[d] = dst
        return result, work

    # ------------------------------------------------------------------ state

    _CONFIG = ("version", "max_size", "sample_batch_size", "vectorized_env", "n_steps", "n_envs", "max_rows")

    def state_dict(self) -> dict:
        """Configuration, data, write position, truncation flags and the sampling RNG state: tensors and
        plain Python values only (``torch.load`` reads it with its defaults). Data tensors are the storage
        itself, not copies (as ``nn.Module.state_dict``): save or clone them before the buffer changes.
        Validity and the prefix-sum trees are derived from these and rebuilt on load."""
        state = {"buffer": type(self).__name__, "version": 1}
        state.update({name: getattr(self, name) for name in self._CONFIG[1:]})
        state.update(
            shapes={leaf_name(p): s for p, s in self._shapes.items()},
            data={leaf_name(p): t for p, t in self._data.items()},
            pos=self._ring.pos,
            count=self._ring.count,
            trunc=torch.from_numpy(self._ring.trunc.copy()),
            rng=self._gen.get_state(),
        )
        return state

    def load_state_dict(self, state) -> None:
        """Restore a :meth:`state_dict` (saved on any device); the sampling generator lives on the host, so
        its state is restored exactly on any device.

        The whole state is validated first (buffer type, configuration, keys, shapes, dtypes, write position
        and count in range, RNG state): a mismatch raises naming the key and leaves the buffer as it was.
        The copy runs with Ctrl-C and timer signals held; should reading the data itself fail after
        validation (an I/O error on a checkpoint file), the buffer is emptied rather than left half-loaded.
        """
        check_state(state, self.state_dict(), self._CONFIG + ("shapes",))
        M = self.max_rows
        count = check_range("state_dict['count']", state["count"], 0, M)
        pos = check_range("state_dict['pos']", state["pos"], 0, M - 1)  # rows held: the `count` rows before it
        rng = host_tensor(state["rng"])
        try:
            torch.Generator().set_state(rng)
        except RuntimeError as err:
            raise ValueError(f"state_dict['rng']: not a generator state ({err})") from None
        trunc = host_tensor(state["trunc"]).numpy().copy()
        flags = {p: host_tensor(state["data"][self._names[p]]) for p in self._end_paths + self._last_paths}
        stored, ends, last = self._row_flags(flags, M)
        if not np.array_equal(trunc, np.zeros_like(trunc) if stored is None else stored):
            raise ValueError("state_dict['trunc']: does not match the stored `truncated` rows of state_dict['data']")
        extra = self._check_extra_state(state)
        sources = unaliased({leaf_name(p): state["data"][leaf_name(p)] for p in self._data},
                            {leaf_name(p): t for p, t in self._data.items()}, self._owned)
        if self._dir is not None:
            self._check_open()
        with signals_held():
            if self._dir is not None:  # a load killed half-way re-opens as an empty buffer
                self._dir.before_load(self._ring.total)
            try:
                for p, t in self._data.items():
                    copy_into(t, sources[leaf_name(p)])
                self._load_extra_state(state, extra)
            except BaseException:
                # the data is half-read (a read error): forget every row
                self._ring.restore(0, 0, np.zeros_like(self._ring.trunc), np.zeros_like(self._ring.ends))
                self._sampler.forget()
                raise
            # validity and trees are rebuilt from the rows on next use
            self._ring.restore(pos, count, trunc, np.zeros_like(trunc) if ends is None else ends, last=last)
            self._sampler.forget()
            self._gen.set_state(rng)
        if self._dir is not None:  # the directory now holds the loaded state
            self.flush()

    # ------------------------------------------------------------------ storage_dir

    def _dir_config(self) -> dict:
        """The configuration a storage directory must match to be re-opened by this buffer."""
        config = {"buffer": type(self).__name__, "version": 1}
        config.update({name: getattr(self, name) for name in self._CONFIG[1:] if name != "sample_batch_size"})
        return config

    def flush(self):
        """With a ``storage_dir``: save the sampling RNG state (and priorities, ``max_priority``, ``beta`` when
        prioritized) beside the storage and write every file back to disk, so that a later process re-opens
        this buffer as it is now. Without one: nothing to do. Returns ``self``."""
        if self._dir is not None:
            self._check_open()
            ring = self._ring
            with signals_held():
                self._dir.save_state({"total": ring.total, "rng": self._gen.get_state(), **self._flush_extra()},
                                     (ring.pos, ring.count, ring.total))
        return self

    def close(self) -> None:
        """With a ``storage_dir``: :meth:`flush`, then release the directory's lock, so another buffer (in this
        process or another) may open it; this buffer can still be sampled but no longer written. Without one:
        nothing to do. Closing twice is harmless; ``with TransitionBuffer(...) as buf:`` closes on exit."""
        if self._dir is not None and not self._dir.closed:
            self.flush()
            self._dir.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._dir.closed:
            raise ValueError(f"storage_dir: {str(self._dir.path)!r} was closed; open a new buffer on it to write")

    def _flush_extra(self) -> dict:
        """Hook: the subclass's own entries of a :meth:`flush`."""
        return {}

    def _reopen(self) -> None:
        """Take the rows, counters and last flushed state of a re-opened storage directory (a flush cut short
        after saving its state is completed here)."""
        M = self.max_rows
        pos, count, total, flushes = self._dir.opened_counters(M)
        trunc, ends, last = self._row_flags({p: self._data[p] for p in self._end_paths + self._last_paths}, M)
        zeros = np.zeros((M, self.n_envs), dtype=bool)
        self._ring.restore(pos, count, zeros if trunc is None else trunc, zeros if ends is None else ends, total,
                           last)
        ahead = []

        def restore(state):
            since = count  # held rows written after the flushed state: at max_priority
            if state is None and flushes:
                raise ValueError(f"missing, while the row journal counts {flushes} flushes")
            if state is not None:
                if not isinstance(state, dict):
                    raise ValueError(f"expected the dict a flush saves, got {type(state).__name__}")
                rng = state["rng"]
                if not isinstance(rng, torch.Tensor) or rng.dtype != torch.uint8 or rng.dim() != 1:
                    raise ValueError(f"rng: expected a uint8 generator state, got {type(rng).__name__}")
                torch.Generator().set_state(rng)  # checked before anything is restored
                flush = check_range("flush", state.get("flush", 0), flushes, flushes + 1)
                ahead.append(flush > flushes)  # a flush cut short: its state is what the rows held then
                flushed = check_range("total", state["total"], 0, 2**62 if ahead[0] else total)
                since = 0 if ahead[0] else min(total - flushed, count)
            self._reopen_extra(state, since)
            if state is not None:
                self._gen.set_state(rng)

        self._dir.load_state_checked(restore)
        if any(ahead):
            self.flush()

    def _reopen_extra(self, state: dict | None, since: int) -> None:
        """Hook: restore the subclass's flushed entries; ``since`` rows (the newest) were written after it."""

    def _check_extra_state(self, state):
        """Hook: validate the subclass's own state entries (before any write); returns what to load."""

    def _load_extra_state(self, state, extra) -> None:
        """Hook: write the subclass's own state entries (after validation), given what the check returned."""

    # ------------------------------------------------------------------ the source's rows, provenance

    _IS_LAST = ("info", "is_last")  # the leaf marking an EnvPoolSource row that holds no transition

    def locate(self, indices) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(env, row, step)`` of flat starts ``indices`` (any shape; the indices :meth:`sample` returns with
        ``return_indices=True`` and a prioritized buffer's ``sample`` returns), each int64 shaped like
        ``indices`` on their device.

        A flat start is ``row * n_envs + env``: ``row`` in ``[0, M)`` is the ring row, ``env`` the env (always
        0 when not ``vectorized_env``). ``step`` is the row's number in its env's stream of rows: 0 for the
        first row this buffer ever wrote (overwritten rows count; a :meth:`load_state_dict` numbers the rows
        it loads from 0). With an :class:`~gpubuf.EnvPoolSource` in sync mode, row ``step`` holds the
        observation its env showed after ``step`` calls of ``step()`` since the first ``reset()`` (each
        ``reset()`` after rows were written adds one row). Raises ``IndexError`` for an index outside
        ``[0, max_size)`` or a row not held. Device indices are read back once.
        """
        t = as_tensor(np.asarray(indices) if isinstance(indices, (list, tuple, int)) else indices, "indices")
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise TypeError(f"indices: expected integer flat starts, got {t.dtype}")
        flat = t.detach().cpu().numpy().astype(np.int64)
        ring, E = self._ring, self.n_envs
        bad = (flat < 0) | (flat >= self.max_size)
        if bad.any():
            raise IndexError(f"indices: expected flat starts in [0, {self.max_size}), got {flat[bad][:5].tolist()}")
        row, env = flat // E, flat % E
        age = (row - (ring.pos - ring.count)) % ring.max_rows  # 0 = the oldest row held
        bad = age >= ring.count
        if bad.any():
            raise IndexError(f"indices: rows {np.unique(row[bad])[:5].tolist()} are not held (the buffer holds "
                             f"{ring.count} rows per env)")
        step = ring.total - ring.count + age
        return tuple(torch.from_numpy(np.ascontiguousarray(a)).to(t.device) for a in (env, row, step))


__all__ = ["Transition", "TransitionBuffer"]
