"""ReplayConfig: the frozen, validated configuration of a replay buffer and what its leaves imply.

One object answers every "does this agree?" question: ``state_dict`` checks, a ``storage_dir`` re-open and the agreement
of a sharded buffer's shards all compare its fields. Besides the checks of the constructor's arguments it holds the
per-leaf rules the buffer applies to every call: an insert's rows, their episode flags, the validity kind a sample draws
from, and the windows a sample returns.

Glossary (the replay modules, tiers and ops use these names with one meaning each):

- ``E``: envs (axis 1 of a vectorized insert; 1 when not vectorized); ``M``: rows per env (``max_rows``); ``T``: rows
  per env of one insert; ``B``: windows of one sample; ``n``: rows per window (``n_steps``); ``D``: words or elements
  per row of a leaf;
- *held rows*: the ``count`` rows before the write position ``pos``; *head rows*: of ``T`` rows written at ``pos``,
  those before the wrap (``min(T, M - pos)``); *window*: the rows a sampled start reads;
- *leaf*: one tensor of a :class:`~gpubuf.Transition`, named by its *path* ``(field, key, ...)``;
- *flat start*: ``row * E + env``, the index of a window's first row, also the index of its priority;
- *kind*: a validity kind (:mod:`gpubuf.replay.ring`): which starts may begin a window for one ``with_next_obs`` and
  ``boundaries``;
- *job*: one returned leaf of a sample: ``(output path, stored path, row shift, output shape)``.
"""

import dataclasses
import functools
import warnings
from typing import Any

import numpy as np
import torch

from gpubuf._core.inputs import (
    as_tensor,
    check_bool,
    check_cast,
    check_sample_dtypes,
    check_storable,
    check_storage_dtypes,
    lossless,
    positive_int,
)
from gpubuf._core.state import check_range, check_rng, check_state, host_tensor
from gpubuf._core.transition import Transition, flatten, leaf_name
from gpubuf.replay.ring import IN_EPISODE, NEXT_OBS

BOUNDARIES = ("allow", "mask", "forbid")
IS_LAST = ("info", "is_last")  # the leaf marking an env source's row that holds no transition
# no numpy twin
NOT_IN_NUMPY = (torch.bfloat16, torch.complex32, torch.float8_e4m3fn, torch.float8_e5m2)


def any_rows(rows: dict, paths: list) -> np.ndarray | None:
    """(T, E) bool: rows where any leaf of ``paths`` is set (``rows``: each leaf's (T, E) bool; maybe one of
    them, not a copy); None without such leaves."""
    if not paths:
        return None
    if len(paths) == 1:
        return rows[paths[0]]
    return np.logical_or.reduce([rows[p] for p in paths])


def cut_rows(rows: dict, trunc: list, term: list) -> np.ndarray | None:
    """(T, E) bool: rows set in a ``trunc`` leaf and in no ``term`` leaf; None without ``trunc`` leaves."""
    cut, done = any_rows(rows, trunc), any_rows(rows, term)
    return cut if cut is None or done is None else cut & ~done


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One stored leaf: its ``path``, printable ``name``, per-row ``shape`` (without ``E``), storage ``dtype`` and
    whether that dtype was ``chosen`` by the constructor's ``storage_dtypes`` (else: the data sample's)."""

    path: tuple
    name: str
    shape: tuple
    dtype: torch.dtype
    chosen: bool = False


@dataclasses.dataclass(frozen=True)
class ReplayConfig:
    """The configuration of a replay buffer (built and checked by :meth:`build`); ``extra`` holds a
    subclass's own fields (``(("alpha", 0.6), ("eps", 1e-6))`` for a prioritized buffer)."""

    buffer: str
    max_size: int
    sample_batch_size: int
    vectorized_env: bool
    n_steps: int
    n_envs: int
    max_rows: int
    leaves: tuple[Leaf, ...]
    extra: tuple[tuple[str, Any], ...] = ()
    sample_dtypes: tuple[tuple[tuple, torch.dtype], ...] = ()  # (leaf path, dtype) samples return instead

    STATE_FIELDS = ("max_size", "sample_batch_size", "vectorized_env", "n_steps", "n_envs", "max_rows")

    @classmethod
    def build(cls, buffer: str, max_size, sample_batch_size, data_sample: Transition,
              vectorized_env: bool, n_steps, extra: tuple = (), storage_dtypes=None,
              sample_dtypes=None) -> "ReplayConfig":
        """Check the constructor's arguments (``ValueError`` naming the argument) and derive ``E`` and ``M``."""
        max_size = positive_int("max_size", max_size)
        sample_batch_size = positive_int("sample_batch_size", sample_batch_size)
        n_steps = positive_int("n_steps", n_steps)
        vectorized_env = check_bool("vectorized_env", vectorized_env)
        samples = {p: as_tensor(v, leaf_name(p)) for p, v in flatten(data_sample, "data_sample").items()}
        if not samples:
            raise ValueError("data_sample: expected at least one non-None field")
        lead = 2 if vectorized_env else 1
        for p, t in samples.items():
            check_storable(t.dtype, f"data_sample.{leaf_name(p)}")
        chosen = check_storage_dtypes(storage_dtypes, {leaf_name(p): t.dtype for p, t in samples.items()})
        for p, t in samples.items():
            if t.dim() < lead:
                want = "(T, E, ...)" if vectorized_env else "(T, ...)"
                hint = ("; single transitions shaped (T, ...), such as a source's "
                        "transition_sample(vectorized=False), need vectorized_env=False") if vectorized_env else ""
                raise ValueError(f"data_sample.{leaf_name(p)}: expected leaves shaped {want}, got "
                                 f"{tuple(t.shape)}{hint}")
        E = 1
        if vectorized_env:
            envs = {p: t.shape[1] for p, t in samples.items()}
            E = next(iter(envs.values()))
            if any(e != E for e in envs.values()) or E < 1:
                raise ValueError("data_sample: every leaf needs the same env axis (axis 1) >= 1, "
                                 f"got { {leaf_name(p): e for p, e in envs.items()} }")
        if max_size < E:
            raise ValueError(f"max_size: expected at least one row per env ({E} envs), got {max_size}")
        if max_size % E:
            warnings.warn(f"max_size: {max_size} is not divisible by {E} envs; rounded down to "
                          f"{max_size // E * E}",
                          stacklevel=3)
        M = max_size // E
        if not 1 <= n_steps <= M:
            raise ValueError(f"n_steps: expected 1 <= n_steps <= {M} rows per env, got {n_steps}")
        most = E * (M - n_steps + 1)
        if sample_batch_size > most:
            raise ValueError(f"sample_batch_size: expected at most {most} (= E*(M-n_steps+1)), got {sample_batch_size}")
        leaves = tuple(Leaf(p, leaf_name(p), tuple(t.shape[lead:]), chosen.get(leaf_name(p), t.dtype),
                            leaf_name(p) in chosen) for p, t in samples.items())
        wanted = check_sample_dtypes(sample_dtypes, {leaf.name: leaf.dtype for leaf in leaves})
        widen = tuple((leaf.path, wanted[leaf.name]) for leaf in leaves if leaf.name in wanted)
        return cls(buffer, M * E, sample_batch_size, vectorized_env, n_steps, E, M, leaves, tuple(extra), widen)

    # ------------------------------------------------------------------ what the leaves imply

    # derived from the leaves alone: computed once (a steady sample reads them on every call)
    @functools.cached_property
    def by_path(self) -> dict[tuple, Leaf]:
        return {leaf.path: leaf for leaf in self.leaves}

    def paths(self, *fields: str) -> list[tuple]:
        """Paths of the leaves of these fields, in leaf order."""
        return [leaf.path for leaf in self.leaves if leaf.path[0] in fields]

    @functools.cached_property
    def stores_next_obs(self) -> bool:
        return bool(self.paths("next_observation"))

    @functools.cached_property
    def flag_paths(self) -> tuple[list, list, list]:
        """Leaves of the row flags: ``(truncated, episode ends, no transition)``."""
        last = [leaf.path for leaf in self.leaves if leaf.path == IS_LAST]
        return self.paths("truncated"), self.paths("terminated", "truncated"), last

    @functools.cached_property
    def term_paths(self) -> list:
        """Leaves of ``terminated`` (a row set in one needs no successor, truncated or not)."""
        return self.paths("terminated")

    @functools.cached_property
    def kinds(self) -> tuple[int, ...]:
        """Validity kinds (:mod:`gpubuf.replay.ring`): ``NEXT_OBS`` when next observations are read from
        the following row, ``IN_EPISODE`` when windows may not cross an episode end."""
        kinds = (0,) if self.stores_next_obs or not self.paths("observation") else (0, NEXT_OBS)
        return kinds + tuple(k | IN_EPISODE for k in kinds) if self.flag_paths[1] else kinds

    def widened(self, batch: Transition) -> Transition:
        """``batch`` (a sample's, built here) with each leaf of :attr:`sample_dtypes` (and, when next observations are
        read from the following rows, the next observation of an observation leaf) cast to its sample dtype where
        that widens it (a computed output, an n-step return say, is left as it is); fields replaced in place, nested
        dicts rebuilt, not mutated."""
        derived = not self.stores_next_obs
        for path, dtype in self.sample_dtypes:
            for field in (path[0], "next_observation") if path[0] == "observation" and derived else (path[0],):
                value = getattr(batch, field, None)
                if value is not None:
                    setattr(batch, field, _cast_at(value, path[1:], dtype))
        return batch

    def as_dict(self, *, batch: bool = True) -> dict:
        """Plain values to compare: type, version, sizes and ``extra`` (``batch``: with ``sample_batch_size``)."""
        fields = {name: getattr(self, name) for name in self.STATE_FIELDS if batch or name != "sample_batch_size"}
        return {"buffer": self.buffer, "version": 1, **fields, **dict(self.extra)}

    def items_in(self, transition) -> int | None:
        """Transitions an insert of ``transition`` adds (``T * n_envs``, or ``T`` not vectorized), read from its
        first leaf's length; ``None`` when that cannot be read (:meth:`rows` then names the error)."""
        try:
            first = next(iter(flatten(transition).values()))
            T = int(first.shape[0])
        except (StopIteration, AttributeError, IndexError, TypeError, ValueError):
            return None
        return T * (self.n_envs if self.vectorized_env else 1)

    def rows(self, transition) -> tuple[dict, dict, int]:
        """``(tensors, inputs, T)`` of an insert: every leaf as a tensor and as given, after checking the key set,
        shapes ``(T, E, ...)`` and value-preserving casts (``ValueError``/``TypeError`` naming the leaf)."""
        given = flatten(transition)
        by_path = self.by_path
        if given.keys() != by_path.keys():
            missing = [leaf.name for leaf in self.leaves if leaf.path not in given]
            extra = [leaf_name(p) for p in given if p not in by_path]
            raise ValueError(f"transition: leaves are fixed by data_sample {[leaf.name for leaf in self.leaves]}; "
                             f"missing {missing}, unexpected {extra}")
        values, T = {}, None
        env = (self.n_envs,) if self.vectorized_env else ()
        for p, v in given.items():
            leaf = by_path[p]
            t, want = as_tensor(v, leaf.name), env + leaf.shape
            if t.dim() != len(want) + 1 or t.shape[1:] != want:
                raise ValueError(f"{leaf.name}: expected shape (T, {', '.join(map(str, want))}), got {tuple(t.shape)}")
            if T is None:
                T = t.shape[0]
            elif t.shape[0] != T:
                raise ValueError(f"{leaf.name}: expected T = {T} rows like the other leaves, got {t.shape[0]}")
            check_cast(t, leaf.dtype, leaf.name, read_device=leaf.chosen)
            values[p] = t
        if not 1 <= T <= self.max_rows:
            raise ValueError(f"transition: expected 1 <= T <= {self.max_rows} rows per insert, got T = {T}")
        return values, given, T

    def row_flags(self, leaves: dict, T: int, *, raw: bool = False) -> tuple:
        """(T, E) host bool ``(cut, episode ends, no transition)`` of ``T`` rows of ``leaves`` (tensors or numpy
        arrays; each None without its leaves; a device leaf is read back). ``cut``: the rows whose transition needs
        a successor it does not have, ``truncated`` and not ``terminated`` (a row both terminated and truncated is a
        termination: discount 0, no successor read); ``raw``: every ``truncated`` row."""
        trunc, ends, last = self.flag_paths
        rows = {p: self._set_rows(leaves[p], T) for p in dict.fromkeys(ends + last)}  # one pass
        return cut_rows(rows, trunc, [] if raw else self.term_paths), any_rows(rows, ends), any_rows(rows, last)

    def check_state(self, state, template: dict) -> tuple:
        """``(pos, count, rng, row flags)`` of a ``state_dict`` checked against this configuration
        and a current ``template`` state (type, configuration, keys, shapes, dtypes, counters, RNG,
        flags); a mismatch raises naming the key. The rows held are the ``count`` before ``pos``."""
        check_state(state, template, ("version", *self.STATE_FIELDS, *dict(self.extra), "shapes"))
        count = check_range("state_dict['count']", state["count"], 0, self.max_rows)
        pos = check_range("state_dict['pos']", state["pos"], 0, self.max_rows - 1)
        return pos, count, check_rng("state_dict['rng']", state["rng"]), self.state_flags(state)

    def state_flags(self, state: dict) -> tuple:
        """(M, E) host bool ``(truncated, episode ends, no transition)`` of a state dict's rows (ends and no transition
        None without their leaves), checking that its ``trunc`` matches its ``truncated`` rows."""
        trunc = host_tensor(state["trunc"]).numpy().copy()
        paths = set(sum(self.flag_paths, []))
        flags = {leaf.path: host_tensor(state["data"][leaf.name]) for leaf in self.leaves if leaf.path in paths}
        stored, ends, last = self.row_flags(flags, self.max_rows)
        if stored is None:
            stored = np.zeros_like(trunc)
        # earlier releases counted the rows both terminated and truncated in `trunc` too
        if not np.array_equal(trunc, stored) and \
                not np.array_equal(trunc, self.row_flags(flags, self.max_rows, raw=True)[0]):
            raise ValueError("state_dict['trunc']: does not match the stored `truncated` rows of state_dict['data']")
        return stored, ends, last

    def _set_rows(self, t: torch.Tensor | np.ndarray, T: int) -> np.ndarray:
        """(T, E) host bool: whether leaf ``t`` (T, E, ...), a tensor or a numpy array, is nonzero anywhere in each
        row (maybe a view of a (T, E) bool host leaf: callers copy what they keep)."""
        if type(t) is not np.ndarray:
            t = t.detach()
            if t.device.type != "cpu" or t.dtype in NOT_IN_NUMPY:
                return (t.reshape(T, self.n_envs, -1) != 0).any(2).cpu().numpy()
            t = t.numpy()  # host flags: numpy, a few microseconds
        if t.dtype == np.bool_ and t.size == T * self.n_envs:
            return t.reshape(T, self.n_envs)
        t = t.reshape(T, self.n_envs, -1)
        return t.any(2) if t.dtype == np.bool_ else (t != 0).any(2)

    def kind(self, with_next_obs: bool, boundaries: str = "allow") -> int:
        """The validity kind that ``with_next_obs`` (a bool: ``TypeError`` otherwise) and ``boundaries`` sample from."""
        if type(with_next_obs) is not bool:
            with_next_obs = check_bool("with_next_obs", with_next_obs)
        if boundaries not in BOUNDARIES:
            raise ValueError(f"boundaries: expected one of {BOUNDARIES}, got {boundaries!r}")
        if boundaries != "allow" and not self.flag_paths[1]:
            raise ValueError(f"boundaries: {boundaries!r} needs episode ends, but the buffer "
                             "stores neither terminated nor truncated")
        kind = (0 if (not with_next_obs or self.stores_next_obs) else NEXT_OBS) | \
            (IN_EPISODE if boundaries == "forbid" else 0)
        if kind not in self.kinds:
            raise ValueError("with_next_obs: the buffer stores neither next_observation nor observation")
        return kind

    def batch_size(self, batch_size) -> int:
        """``batch_size`` (``None``: the default) checked: a positive int whose windows fit int32 row indices."""
        B = self.sample_batch_size if batch_size is None else batch_size
        if isinstance(B, bool) or not isinstance(B, (int, np.integer)) or B < 1:
            raise ValueError(f"batch_size: expected a positive int or None, got {batch_size!r}")
        if B * (self.n_steps + 1) >= 2**31:
            raise ValueError("batch_size: expected fewer than 2**31 window rows per sample, got "
                             f"{B} windows of {self.n_steps} rows")
        return int(B)

    def jobs(self, B: int, with_next_obs: bool) -> list[tuple]:
        """``(output path, stored path, row shift, output shape)`` of every returned leaf."""
        n = self.n_steps
        shifted = [] if (not with_next_obs or self.stores_next_obs) else self.paths("observation")
        pairs = [(leaf.path, leaf.path, 0) for leaf in self.leaves]
        pairs += [(("next_observation",) + p[1:], p, 1) for p in shifted]
        by_path = self.by_path
        return [(d, s, shift, ((B, n) if n > 1 else (B,)) + by_path[s].shape) for d, s, shift in pairs]

    def with_flags(self, batch: Transition, boundaries: str, device) -> Transition:
        """``batch`` with ``is_first``, ``mask`` and ``has_transition`` (B, n_steps) bool (``(B,)`` when ``n_steps
        == 1``) from its sampled rows, unless ``boundaries == "allow"`` (their meaning: :mod:`gpubuf.replay.buffer`).
        ``is_first`` and ``mask`` follow the episode ends (``info["is_last"]`` rows when stored: an episode ends
        after the row holding its last observation, so that row stays inside its episode's ``mask``);
        ``has_transition`` is False exactly on the ``info["is_last"]`` rows (True everywhere in a buffer without
        that leaf), a flag of its own because a world model needs those rows inside the episode while a learner of
        transitions drops them. With ``n_steps == 1`` it is all set (such a row never starts a window);
        ``"forbid"`` windows may end on one (their last row). A batch refilled in place (a ``GraphSampler``'s)
        keeps it current with :meth:`refresh_flags`."""
        if boundaries == "allow":
            return batch
        leaves = flatten(batch, "out")
        ends = self.flag_paths[1]
        B, n = leaves[ends[0]].shape[0], self.n_steps
        ones = torch.ones(B, *((n,) if n > 1 else ()), dtype=torch.bool, device=device)
        if n == 1 or IS_LAST not in leaves:
            batch.has_transition = ones.clone()
        else:
            batch.has_transition = (leaves[IS_LAST] == 0).reshape(B, n, -1).all(2)
        # no episode end before a window's last row: constant flags
        if n == 1 or boundaries == "forbid":
            batch.mask = ones
            batch.is_first = ones.clone()
            if n > 1:
                batch.is_first[:, 1:] = False
            return batch
        done = torch.zeros(B, n, dtype=torch.bool, device=device)
        # an env source's rows: an episode ends after its `is_last` row (which holds its last observation)
        for p in [IS_LAST] if IS_LAST in leaves else ends:
            done |= (leaves[p] != 0).reshape(B, n, -1).any(2)
        ended = done[:, :-1]  # (B, n-1): row j ended an episode
        batch.is_first = torch.cat([ones[:, :1], ended], 1)
        batch.mask = torch.cat([ones[:, :1], (~ended).cumprod(1).bool()], 1)
        return batch

    def refresh_flags(self, batch: Transition) -> None:
        """Recompute, in place, ``batch.has_transition`` of a batch :meth:`with_flags` flagged whose rows were refilled
        since (a ``GraphSampler``'s fixed outputs after each gather): from its ``info["is_last"]`` rows, without
        allocating for a ``(B, n_steps)`` bool leaf (the source's), so a captured CUDA graph may hold it. Nothing to do
        for an unflagged batch, for ``n_steps == 1`` or without that leaf (the flag is constant then)."""
        has = batch.has_transition
        if has is None or self.n_steps == 1 or IS_LAST not in self.by_path:
            return
        last = batch.info[IS_LAST[1]]
        if last.dtype == torch.bool and last.shape == has.shape:
            torch.logical_not(last, out=has)
        else:
            has.copy_((last == 0).reshape(*has.shape, -1).all(2))


def _cast_at(value, keys: tuple, dtype: torch.dtype):
    """``value`` (a tensor, or nested dicts of them) with the tensor at ``keys`` cast to ``dtype`` (dicts copied)."""
    if not keys:
        return value.to(dtype) if value.dtype != dtype and lossless(value.dtype, dtype) else value
    return {**value, keys[0]: _cast_at(value[keys[0]], keys[1:], dtype)}
