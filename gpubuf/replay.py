"""Transition and TransitionBuffer: a time-major circular buffer sampled as contiguous n-step windows.

Storage per leaf (every tensor of a ``Transition``, nested dicts included) is one preallocated
``(M, E, *shape)`` device tensor (``(M, *shape)`` when not vectorized; internally ``E = 1``). A sequence
start is the flat index ``step * E + env``. Which starts are valid (window inside written rows, off the
write seam, no truncation inside when next observations are inferred) is tracked on the host, where
the write position and counts already live, and enters the device as zero mass in a wide prefix-sum
tree (:class:`gpubuf.prefix_tree.PrefixSumTree`): an insert only rewrites the leaves of the starts whose
windows changed and their parents. Sampling descends that tree, then gathers the ``(B, n_steps)``
windows in one launch per leaf.

Writes are two-phase: every leaf is checked and staged first (where any conversion fails), then committed
with copies that cannot fail on staged data. Validity is kept apart from priority: a device mask per
validity kind says which starts may be drawn, and a valid start's mass is never zero.
"""

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from gpubuf import checkpoint, ops, reference
from gpubuf.inputs import as_tensor, check_cast, check_storable, positive_int
from gpubuf.interrupts import signals_held
from gpubuf.prefix_tree import PrefixSumTree
from gpubuf.staging import Staging, check_disjoint, memory_ranges, overlaps
from gpubuf.state import check_range, check_state, copy_into, host_tensor, unaliased

_ARRAYS = (torch.Tensor, np.ndarray)
FIELDS = ("observation", "action", "reward", "terminated", "truncated", "next_observation", "info")


@dataclasses.dataclass
class Transition:
    """One batch of transitions; every field may be a tensor, a (nested) dict of tensors, or ``None``.

    ``None`` fields (and empty dicts) are not stored. ``PER_weights`` is only set on batches sampled
    from a :class:`~gpubuf.PrioritizedTransitionBuffer` and is never stored.
    """

    observation: Any
    action: Any
    reward: Any
    terminated: Any
    truncated: Any
    next_observation: Any = None
    info: dict = dataclasses.field(default_factory=dict)
    PER_weights: Any = None


_NOT_IN_NUMPY = (torch.bfloat16, torch.complex32, torch.float8_e4m3fn, torch.float8_e5m2)  # storable, no numpy twin


def _leaf_name(path: tuple) -> str:
    return path[0] + "".join(f"[{p!r}]" for p in path[1:])


def _flatten(transition, name: str = "transition") -> dict[tuple, Any]:
    """``{(field, key, ...): leaf}`` over the stored fields, in field order."""
    if not isinstance(transition, Transition):
        raise TypeError(f"{name}: expected a gpubuf.Transition, got {type(transition).__name__}")
    leaves: dict[tuple, Any] = {}

    def walk(path, value):
        if value is None:
            return
        if isinstance(value, Mapping):
            for k, v in value.items():
                if not isinstance(k, str):
                    raise TypeError(f"{_leaf_name(path)}: dict keys must be str, got {k!r}")
                walk(path + (k,), v)
        else:
            leaves[path] = value

    for f in FIELDS:
        value = getattr(transition, f)
        if isinstance(value, _ARRAYS):  # the common case, without the walk
            leaves[(f,)] = value
        else:
            walk((f,), value)
    return leaves


def _unflatten(leaves: dict[tuple, torch.Tensor]) -> Transition:
    fields: dict[str, Any] = {f: None for f in FIELDS}
    fields["info"] = {}
    for path, t in leaves.items():
        if len(path) == 1:
            fields[path[0]] = t
            continue
        node = fields[path[0]] if fields[path[0]] is not None else {}
        fields[path[0]] = node
        for p in path[1:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = t
    return Transition(**fields)


class TransitionBuffer(checkpoint.Checkpointable):
    """A circular buffer of transitions sampled uniformly as contiguous ``n_steps`` windows.

    Args:
        max_size: transitions held across all envs; each env gets ``M = max_size // E`` rows.
        sample_batch_size: default number of windows per :meth:`sample`.
        data_sample: a :class:`Transition` shaped like an insert: leaves ``(T, E, ...)`` when
            ``vectorized_env`` (``E`` = size of axis 1), else ``(T, ...)``; fixes keys, shapes and dtypes.
        vectorized_env: store env rollouts ``(T, E, ...)`` as is; the env axis folds into the batch on sampling.
        n_steps: window length; ``1`` returns single transitions ``(B, ...)``, else ``(B, n_steps, ...)``.
        device: storage device; ``None`` -> ``cuda`` when available, else ``cpu``.
        seed: seed of the buffer's own generator (used when :meth:`sample` gets ``key=None``).

    Sampling cost is O(B * levels * fanout) for the tree descent plus the bytes of the windows: it does not
    grow with capacity. Without replacement the draw is exact sequential sampling without replacement
    (here: uniform over valid starts): rounds of draws with replacement from the tree, keeping first
    appearances, with the drawn starts' mass zeroed between rounds and restored at the end. Each round
    reads the number of distinct draws back from the device (one sync per round; typically one or two
    rounds unless the batch is a large fraction of the valid starts).
    """

    _prioritized = False

    def __init__(self, max_size: int, sample_batch_size: int, data_sample: Transition, vectorized_env: bool = True,
                 n_steps: int = 1, *, device=None, seed: int | None = None):
        max_size = positive_int("max_size", max_size)
        self.sample_batch_size = positive_int("sample_batch_size", sample_batch_size)
        self.n_steps = positive_int("n_steps", n_steps)
        self.vectorized_env = bool(vectorized_env)
        samples = {p: as_tensor(v, _leaf_name(p)) for p, v in _flatten(data_sample, "data_sample").items()}
        if not samples:
            raise ValueError("data_sample: expected at least one non-None field")
        for p, t in samples.items():
            check_storable(t.dtype, f"data_sample.{_leaf_name(p)}")
        lead = 2 if self.vectorized_env else 1
        for p, t in samples.items():
            if t.dim() < lead:
                want = "(T, E, ...)" if self.vectorized_env else "(T, ...)"
                raise ValueError(f"data_sample.{_leaf_name(p)}: expected leaves shaped {want}, got {tuple(t.shape)}")
        if self.vectorized_env:
            envs = {p: t.shape[1] for p, t in samples.items()}
            E = next(iter(envs.values()))
            if any(e != E for e in envs.values()) or E < 1:
                raise ValueError(f"data_sample: every leaf needs the same env axis (axis 1) >= 1, got "
                                 f"{ {_leaf_name(p): e for p, e in envs.items()} }")
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
        self._shapes = {p: tuple(t.shape[lead:]) for p, t in samples.items()}
        self._want = {p: ((E,) if self.vectorized_env else ()) + s for p, s in self._shapes.items()}  # per-row
        self._names = {p: _leaf_name(p) for p in samples}
        self._dtypes = {p: t.dtype for p, t in samples.items()}
        self._has_next_obs = any(p[0] == "next_observation" for p in samples)
        self._obs_paths = [p for p in samples if p[0] == "observation"]
        self._trunc_paths = [p for p in samples if p[0] == "truncated"]
        # Validity kinds: 0 = plain windows of n_steps rows; 1 = windows of n_steps+1 rows whose first
        # n_steps rows hold no truncation (next observations inferred from the following row).
        self._kinds = (0,) if self._has_next_obs or not self._obs_paths else (0, 1)

        shapes = {_leaf_name(p): ((M, E) if self.vectorized_env else (M,)) + s for p, s in self._shapes.items()}
        dtypes = {_leaf_name(p): self._dtypes[p] for p in samples}
        self._trees = {k: PrefixSumTree(M * E, self.device, self.backend) for k in self._kinds}
        for k, tree in self._trees.items():
            shapes[f"__tree{k}__"], dtypes[f"__tree{k}__"] = (tree.size,), torch.float64
            shapes[f"__valid{k}__"], dtypes[f"__valid{k}__"] = (M * E,), torch.bool
        if self._prioritized:
            shapes["__priority__"], dtypes["__priority__"] = (M * E,), torch.float32
        storage = ops.allocate(shapes, dtypes, self.device)
        for k, tree in self._trees.items():
            tree.tree = storage.pop(f"__tree{k}__")
        self._valid_dev = {k: storage.pop(f"__valid{k}__") for k in self._kinds}  # (M*E,) device validity masks
        self._priority = storage.pop("__priority__", None)
        self._data = {p: storage[_leaf_name(p)] for p in samples}
        self._flat = {p: t.view(M * E, -1) for p, t in self._data.items()}  # (M*E, D) views
        # the same rows as int words (reference.as_words): windows are gathered and allocated as words
        self._words = {p: reference.as_words(t)[0] for p, t in self._flat.items()}
        own = [*self._data.values(), *self._valid_dev.values(), *(t.tree for t in self._trees.values())]
        if self._priority is not None:
            own.append(self._priority)
        self._owned = memory_ranges(own)  # every device tensor held: inputs reading them are copied first
        # CPU storage as numpy views (dtypes numpy has): a same-dtype host array is written by one numpy
        # slice assignment
        self._host = {p: t.numpy() for p, t in self._data.items()
                      if self.device.type == "cpu" and t.dtype not in _NOT_IN_NUMPY}
        # host mirrors: write position, rows written, truncation flags, per-start validity and counts
        self._pos = 0
        self._count = 0
        self._trunc = np.zeros((M, E), dtype=bool)
        self._n_trunc = 0  # truncated rows stored: while 0, every kind's valid starts are one ring range of rows
        self._valid = {k: np.zeros((M, E), dtype=bool) for k in self._kinds}
        self._n_valid = dict.fromkeys(self._kinds, 0)
        self._active: set[int] = set()  # trees kept up to date; each is built on first use (one linear pass)
        self._staging = Staging(self.device)
        # uniforms come from a host generator and travel through pinned staging: the same seed samples the
        # same starts on every device, and the RNG state round-trips exactly across devices
        self._gen = torch.Generator()
        if seed is not None:
            self._gen.manual_seed(int(seed))
        else:
            self._gen.seed()

    # ------------------------------------------------------------------ bookkeeping

    def __len__(self) -> int:
        """Transitions stored (rows written times envs)."""
        return self._count * self.n_envs

    @property
    def nbytes(self) -> int:
        """Device bytes held: storage, prefix-sum trees, validity masks and priorities."""
        ts = list(self._data.values()) + [t.tree for t in self._trees.values()] + list(self._valid_dev.values())
        if self._priority is not None:
            ts.append(self._priority)
        return sum(t.numel() * t.element_size() for t in ts)

    def num_valid(self, with_next_obs: bool = False) -> int:
        """Number of valid sequence starts for :meth:`sample` with this ``with_next_obs``."""
        return self._n_valid[self._kind(with_next_obs)]

    def sampling_mass(self, with_next_obs: bool = False) -> torch.Tensor:
        """``(max_size,)`` float64 copy of the mass each flat start is drawn with by :meth:`sample` with this
        ``with_next_obs``: 0 for an invalid start, 1 for a valid one (uniform), ``priority**alpha``
        (prioritized). A read-only diagnostic (one device copy); the sampler's own state is not exposed."""
        kind = self._kind(with_next_obs)
        return self._trees[kind].tree[:self.max_size].clone()

    def _kind(self, with_next_obs: bool) -> int:
        """The validity kind (and its tree, activated here on first use) that ``with_next_obs`` samples from."""
        kind = 0 if (not with_next_obs or self._has_next_obs) else 1
        if kind not in self._kinds:
            raise ValueError("with_next_obs: the buffer stores neither next_observation nor observation")
        if kind not in self._active:
            self._active.add(kind)
            self._set_rows(kind, 0, self.max_rows)
        return kind

    def _window(self, kind: int) -> int:
        return self.n_steps + kind

    def _upload(self, arr: np.ndarray, key: str) -> torch.Tensor:
        return self._staging.to_device(torch.from_numpy(np.ascontiguousarray(arr)), key)

    # ------------------------------------------------------------------ insert

    @torch.compiler.disable  # an opaque call under torch.compile: no guards on host state, no recompiles
    def insert(self, transition: Transition):
        """Write ``T`` rows per env at ``(insert_position + arange(T)) % M``; returns ``self``.

        Leaves are shaped ``(T, E, ...)`` (``(T, ...)`` when not vectorized), ``1 <= T <= M``, with the key
        set and per-row shapes of ``data_sample``, and dtypes that store without changing values (narrowing casts
        of host data are checked on the values: :func:`gpubuf.inputs.check_cast`). Nothing is written on any error.
        """
        leaves = _flatten(transition)
        if leaves.keys() != self._shapes.keys():
            missing = [_leaf_name(p) for p in self._shapes if p not in leaves]
            extra = [_leaf_name(p) for p in leaves if p not in self._shapes]
            raise ValueError(f"transition: leaves are fixed by data_sample {[_leaf_name(p) for p in self._shapes]}; "
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
        # a device `truncated` is read back here (pass host arrays, as env outputs are, to avoid the sync)
        trunc = self._truncation(values, T)
        # ---- phase 1: stage every leaf (any conversion error happens here, before the first write)
        staged = {}
        for p, t in values.items():
            v = leaves[p]
            fast = p in self._host and type(v) is np.ndarray and t.dtype == self._dtypes[p]
            if fast and not overlaps(t, self._owned):
                staged[p] = t.numpy()  # CPU storage, same dtype: one numpy slice assignment, which cannot fail
            else:
                staged[p] = self._staging.stage(t, self._names[p], self._dtypes[p], self._owned)
        with signals_held():  # ---- phase 2: commit
            pos = self._pos
            first = min(T, M - pos)  # rows before the ring wraps
            for p, src in staged.items():
                dst = self._host[p] if isinstance(src, np.ndarray) else self._data[p]
                if first == T:
                    dst[pos:pos + T] = src
                else:
                    dst[pos:] = src[:first]
                    dst[:T - first] = src[first:]
            if trunc is not None:
                self._n_trunc += int(np.count_nonzero(trunc)) - int(np.count_nonzero(self._trunc[pos:pos + first])) \
                    - int(np.count_nonzero(self._trunc[:T - first]))
                self._trunc[pos:pos + first] = trunc[:first]
                if first < T:
                    self._trunc[:T - first] = trunc[first:]
            self._on_rows_written(pos, first, T)
            self._pos = (pos + T) % M
            self._count = min(self._count + T, M)
            self._refresh_validity(pos, T)
        return self

    def _truncation(self, leaves: dict, T: int) -> np.ndarray | None:
        """(T, E) host bool: whether any ``truncated`` leaf of each row is nonzero (None without one)."""
        if not self._trunc_paths:
            return None
        flags = []
        for p in self._trunc_paths:
            t = leaves[p].detach()
            if t.device.type == "cpu" and t.dtype not in _NOT_IN_NUMPY:
                a = t.numpy().reshape(T, self.n_envs, -1)  # host flags: numpy, a few microseconds
                flags.append(a.any(2) if a.dtype == np.bool_ else (a != 0).any(2))
            else:
                flags.append((t.reshape(T, self.n_envs, -1) != 0).any(2).cpu().numpy())
        return flags[0] if len(flags) == 1 else np.logical_or.reduce(flags)

    def _on_rows_written(self, pos: int, first: int, T: int) -> None:
        """Hook for new rows ``pos .. pos+first-1`` and ``0 .. T-first-1`` (the prioritized buffer gives their
        starts the running max priority)."""

    def _refresh_validity(self, old_pos: int, T: int) -> None:
        """Recompute validity (host) and tree leaves (device) of the starts whose windows changed: rows
        ``old_pos - W + 1 .. old_pos + T - 1`` (the seam moved, rows were overwritten), at most two
        contiguous row ranges, hence contiguous ranges of flat starts."""
        if not self._active:
            return
        M = self.max_rows
        W = max(self._window(k) for k in self._active)
        K = min(T + W - 1, M)
        a = (old_pos + T - K) % M
        segments = [(a, min(a + K, M))] + ([(0, a + K - M)] if a + K > M else [])
        for kind in sorted(self._active):
            for r0, r1 in segments:
                self._set_rows(kind, r0, r1)

    def _validity(self, r0: int, r1: int, kind: int) -> np.ndarray:
        """((r1 - r0) * E,) bool: is the window of this kind starting at each flat start of rows ``[r0, r1)`` valid."""
        M, E = self.max_rows, self.n_envs
        # rows r0 + i have time indices (t0 + i) % M (0 = oldest); valid ones are <= last: two slices of rows
        t0 = (r0 - (self._pos if self._count == M else 0)) % M
        last = self._count - self._window(kind)
        ok = np.zeros(r1 - r0, dtype=bool)
        ok[:max(last - t0 + 1, 0)] = True  # before the time index wraps past M
        ok[M - t0:max(last - t0 + M + 1, 0)] = True  # after it
        if kind == 1 and self._trunc_paths:
            win = (np.arange(r0, r1)[:, None] + np.arange(self.n_steps)) % M  # (K, n)
            return (ok[:, None] & ~self._trunc[win].any(1)).reshape(-1)
        return ok if E == 1 else np.repeat(ok, E)

    def _set_rows(self, kind: int, r0: int, r1: int) -> None:
        """Refresh validity (host mirror and device mask) and tree leaves (then their parents) of the starts in
        rows ``[r0, r1)``."""
        ok = self._validity(r0, r1, kind)
        lo, hi = r0 * self.n_envs, r1 * self.n_envs
        valid = self._valid[kind].reshape(-1)  # (M*E,) view
        n_ok = int(np.count_nonzero(ok))
        self._n_valid[kind] += n_ok - int(np.count_nonzero(valid[lo:hi]))
        valid[lo:hi] = ok
        mask = self._valid_dev[kind][lo:hi]
        if n_ok == hi - lo:
            mask.fill_(True)
        else:
            mask.copy_(self._upload(ok, f"__valid{kind}_{r0 == 0}__"))
        self._trees[kind].update_range(lo, self._mass(slice(lo, hi), mask, n_ok == hi - lo))

    def _mass(self, starts, valid: torch.Tensor, all_valid: bool) -> torch.Tensor:
        """Sampling mass (float64, on the device) of flat ``starts`` (a slice or index tensor) given their device
        validity ``valid`` (``all_valid``: all of them valid): 1 per valid start here, 0 per invalid one."""
        return valid.to(torch.float64)

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

    def _uniform(self, g: torch.Generator, n: int) -> torch.Tensor:
        """(n,) float64 uniforms on the buffer's device, drawn on the generator's device."""
        u = torch.rand(n, dtype=torch.float64, generator=g, device=g.device)
        return self._staging.to_device(u, "__uniform__")

    def _check_sample_args(self, batch_size, with_replacement: bool, with_next_obs: bool) -> tuple[int, int]:
        B = self.sample_batch_size if batch_size is None else batch_size
        if isinstance(B, bool) or not isinstance(B, (int, np.integer)) or B < 1:
            raise ValueError(f"batch_size: expected a positive int or None, got {batch_size!r}")
        if B * (self.n_steps + 1) >= 2**31:
            raise ValueError(f"batch_size: expected fewer than 2**31 window rows per sample, got {B} windows of "
                             f"{self.n_steps} rows")
        kind = self._kind(with_next_obs)
        n = self._n_valid[kind]
        if n == 0:
            raise ValueError(f"sample: no valid sequence start yet ({self._count} rows written per env, windows of "
                             f"{self._window(kind)} rows{' without truncation' if kind else ''})")
        if not with_replacement and B > n:
            raise ValueError(f"batch_size: {B} exceeds the {n} valid starts, which sampling without replacement "
                             "needs")
        return int(B), kind

    def _draw(self, tree, B: int, g: torch.Generator, with_replacement: bool):
        """(flat starts (B,) int64, their masses (B,) float64) drawn from ``tree``."""
        if with_replacement:
            idx = tree.sample(self._uniform(g, B))
            return idx, tree.leaves(idx)
        # Drawn starts are zeroed between rounds, so later rounds draw among the rest; they are restored
        # whatever happens: an exception restores them, and asynchronous signals (Ctrl-C, alarms) are held
        # until the tree is whole again, so their handlers never run half-way.
        chosen, masses = [], []
        need = B
        with signals_held():
            try:
                while need > 0:
                    draws = tree.sample(self._uniform(g, max(2 * need, 16)))
                    uniq, inv = torch.unique(draws, return_inverse=True)
                    first = torch.full_like(uniq, draws.numel()).scatter_reduce_(
                        0, inv, torch.arange(draws.numel(), device=draws.device), "amin")
                    new = uniq[torch.argsort(first)][:need]  # distinct draws in order of first appearance
                    masses.append(tree.leaves(new))
                    chosen.append(new)
                    tree.update(new, torch.zeros(new.shape, dtype=torch.float64, device=self.device))
                    need -= new.numel()
            finally:
                if chosen:
                    idx, mass = torch.cat(chosen), torch.cat(masses)
                    tree.update(idx, mass)  # restore: leaves as before, parents recomputed from them
        return idx, mass

    @torch.compiler.disable  # an opaque call under torch.compile: no guards on host state, no recompiles
    def sample(self, key=None, with_replacement: bool = True, batch_size: int | None = None,
               with_next_obs: bool = False, *, out: Transition | None = None) -> Transition:
        """A batch of ``B`` windows of ``n_steps`` rows from uniformly drawn valid starts.

        Leaves come back ``(B, n_steps, ...)`` (``(B, ...)`` when ``n_steps == 1``). ``with_next_obs`` fills
        ``next_observation`` with the observation one row later (unless it is stored), and then never
        samples a window whose first ``n_steps`` rows hold a truncation. Raises ``ValueError`` when there
        is no valid start, or fewer valid starts than ``batch_size`` without replacement.

        ``out`` may be a :class:`Transition` of preallocated tensors of exactly the returned shapes and dtypes
        on the buffer's device: the windows are written there and ``out`` is returned (no allocation; large
        fresh CPU outputs otherwise pay page faults on every call).
        """
        B, kind = self._check_sample_args(batch_size, with_replacement, with_next_obs)
        dst = self._check_out(out, B, with_next_obs)
        g = self._generator(key)
        if with_replacement and (kind == 0 or self._n_trunc == 0):
            idx = self._ring_starts(kind, self._uniform(g, B))  # no tree descent needed
        else:
            idx, _ = self._draw(self._trees[kind], B, g, with_replacement)
        return self._gather(idx, dst, out)

    def _ring_starts(self, kind: int, u: torch.Tensor) -> torch.Tensor:
        """(B,) flat starts drawn uniformly by ``u`` (B,) in [0, 1) when the valid starts of ``kind`` are exactly
        every env's start in one ring range of rows (kind 0 always; kind 1 while no truncation is stored): the
        ``L = count - window + 1`` rows from the oldest one."""
        M, E = self.max_rows, self.n_envs
        n = (self._count - self._window(kind) + 1) * E  # == num_valid(kind)
        k = u.mul(n).long().clamp_max_(n - 1)  # uniform over the n valid (row, env) pairs
        base = self._pos if self._count == M else 0  # row of the oldest time index
        return k.div(E, rounding_mode="floor").add_(base).remainder_(M).mul_(E).add_(k.remainder(E))

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
        given = _flatten(out, "out")
        result = {}
        for d, s, shift, shape in jobs:
            t = given.get(d)
            dtype = self._dtypes[s]
            if (not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype
                    or t.device != self.device or not t.is_contiguous()):
                got = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"out.{_leaf_name(d)}: expected a contiguous {dtype} tensor of shape {shape} on "
                                 f"{self.device}, got {got}")
            result[d] = (t, s, shift, shape)
        check_disjoint({f"out.{_leaf_name(d)}": t for d, (t, *_) in result.items()}, self._owned)
        return result

    def _gather(self, starts: torch.Tensor, jobs: dict, out: Transition | None = None) -> Transition:
        B, n = starts.shape[0], self.n_steps
        result, work = {}, []
        for d, (dst, s, shift, shape) in jobs.items():
            src = self._words[s]
            if dst is None and src.shape[1] == 0:  # zero-width leaf: nothing to gather
                dst = torch.empty(shape, dtype=self._dtypes[s], device=self.device)
                result[d] = dst
                continue
            if dst is None:
                try:
                    words = torch.empty((B, n, src.shape[1]), dtype=src.dtype, device=self.device)
                except (RuntimeError, torch.OutOfMemoryError) as err:
                    raise MemoryError(f"batch_size: {B} windows need an output of shape {shape} for "
                                      f"{_leaf_name(d)}, which cannot be allocated on {self.device} "
                                      f"({str(err).splitlines()[0]})") from None
                dst = words.view(torch.uint8).view(self._dtypes[s]).view(shape)
            else:  # a caller's tensor may sit at any offset: both sides get a word type they share
                flat = self._flat[s]
                src, words = reference.as_words(flat, dst.view(B * n, flat.shape[1]))
                words = words.view(B, n, src.shape[1])
            work.append((src, words, shift))
            result[d] = dst
        ops.sequence_gather(self.backend, work, starts, n, self.n_envs, self.max_rows)
        if out is None:
            return _unflatten(result)
        return out

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
            shapes={_leaf_name(p): s for p, s in self._shapes.items()},
            data={_leaf_name(p): t for p, t in self._data.items()},
            pos=self._pos,
            count=self._count,
            trunc=torch.from_numpy(self._trunc.copy()),
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
        pos = check_range("state_dict['pos']", state["pos"], 0, M - 1)
        if count < M and pos != count:
            raise ValueError(f"state_dict['pos']: a buffer holding {count} of {M} rows writes at row {count}, "
                             f"got {pos}")
        rng = host_tensor(state["rng"])
        try:
            torch.Generator().set_state(rng)
        except RuntimeError as err:
            raise ValueError(f"state_dict['rng']: not a generator state ({err})") from None
        trunc = host_tensor(state["trunc"]).numpy().copy()
        stored = self._truncation({p: host_tensor(state["data"][self._names[p]]) for p in self._trunc_paths}, M)
        if not np.array_equal(trunc, np.zeros_like(trunc) if stored is None else stored):
            raise ValueError("state_dict['trunc']: does not match the stored `truncated` rows of state_dict['data']")
        extra = self._check_extra_state(state)
        sources = unaliased({_leaf_name(p): state["data"][_leaf_name(p)] for p in self._data},
                            {_leaf_name(p): t for p, t in self._data.items()}, self._owned)
        with signals_held():
            try:
                for p, t in self._data.items():
                    copy_into(t, sources[_leaf_name(p)])
                self._load_extra_state(state, extra)
            except BaseException:
                self._pos, self._count = 0, 0  # the data is half-read (a read error): forget every row
                self._forget_validity()
                raise
            self._pos, self._count, self._trunc = pos, count, trunc
            self._n_trunc = int(np.count_nonzero(trunc))
            self._gen.set_state(rng)
            self._forget_validity()

    def _forget_validity(self) -> None:
        """Drop validity and trees: each is rebuilt from the rows on its next use."""
        for kind in self._kinds:
            self._valid[kind][:] = False
            self._n_valid[kind] = 0
        self._active = set()

    def _check_extra_state(self, state):
        """Hook: validate the subclass's own state entries (before any write); returns what to load."""

    def _load_extra_state(self, state, extra) -> None:
        """Hook: write the subclass's own state entries (after validation), given what the check returned."""


__all__ = ["Transition", "TransitionBuffer"]
