"""A torchrl storage whose rows live in gpubuf's storage tiers: the sampling device, host memory, or a ``storage_dir``.

:class:`ReplayStorage` is a torchrl ``TensorStorage`` (so torchrl's writers, samplers, ``Sequence`` units,
transforms, ``state_dict`` and ``dumps`` / ``loads`` work on it as on ``LazyTensorStorage``), allocated on the first
write from that row's keys, shapes and dtypes, in one of three places:

- **the sampling device** (``storage_device`` left out): like ``LazyTensorStorage(device=...)``;
- **host memory** (``storage_device="cpu"`` with a CUDA ``device``): rows stay in host RAM (asked for huge pages),
  and each draw is gathered on the host into pinned memory and sent to ``device`` with one non-blocking copy per
  key, so the GPU holds only the batches;
- **a ``storage_dir``**: gpubuf's memory-mapped files, allocated on disk at creation, with its row journal. Rows are
  written through a redo record: a block of at most 4096 rows is staged in the directory first, then armed, copied into
  place and committed, so a process killed at any instant (``SIGKILL`` mid-``extend`` included) leaves every row whole:
  a re-open finishes an armed copy, and rows whose block was not armed were never touched.
  ``ReplayStorage(max_size, storage_dir=path)`` re-opens a directory with its rows (a buffer made on it goes on writing
  after the newest row), and ``flush()`` writes it back to disk. One process writes it: the one that opened it (a forked
  child is refused, ``RuntimeError``); a second opener is refused while the first holds it.

Every tier stores a later row's leaves in the dtypes of the first, cast only where no value changes (as every gpubuf
buffer, ``docs/dtypes.md``): a lossy cast raises ``TypeError`` naming the key before any row is written, and torchrl's
round-robin writer is put back.

A ``storage_dir`` takes rows at the ring's head only (the rows torchrl's ``RoundRobinWriter`` writes; an extend of more
than ``max_size`` rows keeps its last ``max_size``): rewriting rows in place (``rb[index] = ...``, ``write_at``) raises
``ValueError`` with nothing written, and so do rows without every stored key (a staged block is written whole). A write
refused, or failing before its first block is in place, changes no row, and torchrl's round-robin writer, which moved
its cursor before the storage wrote, is put back at the head. An interrupt (``KeyboardInterrupt``) between the blocks of
an extend of more than 4096 rows keeps the blocks already in place (whole rows, held; the writer goes on after them)
without the sampler's marks for them."""

import json
import weakref
from pathlib import Path

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data.replay_buffers.storages import TensorStorage
from torchrl.data.replay_buffers.writers import RoundRobinWriter, Writer

from gpubuf._core.devices import parse_device
from gpubuf._core.host_memory import advise_huge
from gpubuf._core.inputs import check_cast, check_storage_dtypes
from gpubuf.replay.storage.directory import StorageDir

_KIND = "gpubuf.torchrl.ReplayStorage"
_STAGED = 4096  # rows of the staging block a storage_dir writes through
_REDO = "torchrl_redo.bin"  # int64 [armed, first row, rows, head, rows held, rows ever written] of the staged block


def _rows(cursor, size: int) -> torch.Tensor:
    """The (T,) int64 rows a torchrl cursor (an int, a slice, a range, a sequence or a tensor of rows) names."""
    if isinstance(cursor, slice):
        return torch.arange(*cursor.indices(size))
    if isinstance(cursor, range):
        return torch.tensor(list(cursor), dtype=torch.long)
    return torch.as_tensor(cursor, dtype=torch.long).reshape(-1).cpu()


def _leaves(row: TensorDictBase) -> dict:
    """``{key (tuple): (shape, dtype)}`` of one row's tensors."""
    return {(k,) if isinstance(k, str) else tuple(k): (tuple(v.shape), v.dtype)
            for k, v in row.items(include_nested=True, leaves_only=True)}


def _by_key(storage_dtypes) -> dict:
    """``storage_dtypes`` (``None`` or a dict) keyed by tuples, as the stored keys are."""
    if storage_dtypes is not None and not isinstance(storage_dtypes, dict):
        raise TypeError(f"storage_dtypes: expected a dict {{key: torch.dtype}}, got {type(storage_dtypes).__name__}")
    return {(k,) if isinstance(k, str) else tuple(k): v for k, v in (storage_dtypes or {}).items()}


def _exact_rows(data, spec: dict, chosen: frozenset = frozenset()):
    """``data`` (a ``TensorDict``; anything else as it is) with each stored leaf in its stored dtype (``spec``: ``{key
    (tuple): (shape, dtype)}``), cast only where no value changes (the rule of every gpubuf buffer,
    :func:`~gpubuf._core.inputs.check_cast`; for ``chosen`` keys, whose dtype ``storage_dtypes`` chose, rounding is
    accepted and a device input's range is read), else ``TypeError`` naming the leaf, before anything is written."""
    if not isinstance(data, TensorDictBase):
        return data
    out = None
    for key, t in data.items(include_nested=True, leaves_only=True):
        want = spec.get((key,) if isinstance(key, str) else tuple(key))
        if want is None or t.dtype == want[1]:
            continue
        path = (key,) if isinstance(key, str) else tuple(key)
        check_cast(t, want[1], f"data[{key!r}]", read_device=path in chosen)
        out = data.clone(recurse=False) if out is None else out
        out.set(key, t.to(want[1]))
    return data if out is None else out


class _Attached:
    """The buffers attached to a storage (torchrl's ``_attached_entities``), held weakly: each buffer holds its
    storage, so a strong list back would keep both (and a ``storage_dir``'s lock) alive after the buffer is dropped,
    until Python's cyclic collector runs. Iterates the buffers still alive; copies and pickles keep them."""

    def __init__(self, entities=()):
        self._refs = [weakref.ref(e) for e in entities]

    def live(self) -> list:
        return [e for e in (r() for r in self._refs) if e is not None]

    def __iter__(self):
        return iter(self.live())

    def __len__(self) -> int:
        return len(self.live())

    def __contains__(self, entity) -> bool:
        return any(e is entity for e in self.live())

    def append(self, entity) -> None:
        self._refs = [r for r in self._refs if r() is not None] + [weakref.ref(entity)]

    def __reduce__(self):
        return type(self), (self.live(),)


class ReplayStorage(TensorStorage):
    """torchrl ``TensorStorage`` of ``max_size`` rows in one of gpubuf's tiers (module docstring).

    Args:
        max_size: rows held (``int >= 1``).
        device: where sampled rows are returned (default: the CPU).
        storage_device: where rows live (default: ``device``); ``"cpu"`` with a CUDA ``device`` is the host tier.
        storage_dir: a directory of memory-mapped files (rows on the host, ``storage_device`` must be the CPU); an
            existing one is re-opened with its rows (its ``max_size`` must match).
        storage_dtypes: ``{key: torch.dtype}`` storing some keys (a string, or a tuple for a nested key) in another
            dtype of their kind than the first row's, as the replay buffers' ``storage_dtypes`` do: rows cast on write
            (rounded to the nearest storage value), values the dtype cannot hold refused naming the key; checked when
            the first row arrives (an unknown key or a dtype of another kind raises then, nothing allocated).
    """

    def __init__(self, max_size: int, *, device=None, storage_device=None, storage_dir=None, storage_dtypes=None):
        if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1:
            raise ValueError(f"max_size: expected an int >= 1, got {max_size!r}")
        device = parse_device("cpu" if device is None else device)
        storage_device = device if storage_device is None else parse_device(storage_device)
        if storage_dir is not None and storage_device.type != "cpu":
            raise ValueError(f"storage_device: a storage_dir keeps rows on the host (cpu), got {storage_device}")
        self.storage_dtypes, self._chosen = _by_key(storage_dtypes), frozenset()  # _chosen: set at the first row
        super().__init__(storage=None, max_size=max_size, device=device)
        self.storage_device, self.storage_dir = storage_device, storage_dir
        self._dir = None
        self._ring = (0, 0, 0)  # a storage_dir's (head, rows held, rows ever written), as its journal holds them
        self._head_known = True
        if storage_dir is not None and (Path(storage_dir) / StorageDir.META).exists():
            self._reopen()

    @property
    def _attached_entities(self) -> _Attached:  # torchrl's list of the buffers on this storage, held weakly
        entities = self.__dict__.get("_attached_entities_list")
        if not isinstance(entities, _Attached):
            entities = self._attached_entities_list = _Attached(entities or ())
        return entities

    # ------------------------------------------------------------------ allocation

    def _init(self, row) -> None:
        if not isinstance(row, TensorDictBase):
            raise TypeError(f"data: expected a TensorDict, got {type(row).__name__}")
        leaves = _leaves(row)
        chosen = check_storage_dtypes(self.storage_dtypes or None, {k: dtype for k, (_, dtype) in leaves.items()},
                                      "the first row")
        leaves = {k: (shape, chosen.get(k, dtype)) for k, (shape, dtype) in leaves.items()}
        self._chosen = frozenset(chosen)
        if self.storage_dir is not None:
            self._open_dir(leaves)
            self._dir.claim()
            return
        tensors = {}
        for key, (shape, dtype) in leaves.items():
            t = torch.empty((self.max_size, *shape), dtype=dtype, device=self.storage_device)
            if t.device.type == "cpu":
                advise_huge(t)
            tensors[key] = t
        self._adopt(tensors)

    def _adopt(self, tensors: dict) -> None:
        td = TensorDict({}, batch_size=[self.max_size], device=self.storage_device)
        for key, t in tensors.items():
            td.set(key, t)
        self._storage, self.initialized = td, True
        self._spec = {key: (tuple(t.shape[1:]), t.dtype) for key, t in tensors.items()}  # a row's keys, shapes

    def _open_dir(self, leaves: dict) -> None:
        M, S = self.max_size, min(self.max_size, _STAGED)
        config = {"type": _KIND, "max_size": M, "keys": [list(k) for k in leaves]}
        shapes, dtypes = {}, {}
        for i, (shape, dtype) in enumerate(leaves.values()):
            shapes[f"key{i}"], shapes[f"staged{i}"] = (1, M, *shape), (1, S, *shape)
            dtypes[f"key{i}"] = dtypes[f"staged{i}"] = dtype
        self._dir = StorageDir(self.storage_dir, config, shapes, dtypes)
        self._adopt({key: self._dir.tensors[f"key{i}"][0] for i, key in enumerate(leaves)})
        staged = TensorDict({}, batch_size=[S])
        for i, key in enumerate(leaves):
            staged.set(key, self._dir.tensors[f"staged{i}"][0])
        redo = Path(self._dir.path) / _REDO
        if not redo.exists():
            redo.write_bytes(bytes(6 * 8))
        self._staged, self._redo = staged, np.memmap(redo, dtype=np.int64, mode="r+", shape=(6,))

    def _reopen(self) -> None:
        path = Path(self.storage_dir)
        try:
            meta = json.loads((path / StorageDir.META).read_text())
            config, stored = meta["config"], meta["leaves"]
            if config.get("type") != _KIND:
                raise ValueError(f"it was not made by {_KIND} (its gpubuf.json names no such storage)")
            if config["max_size"] != self.max_size:
                raise ValueError(f"it holds {config['max_size']} rows, not max_size={self.max_size}")
            leaves = {tuple(k): (tuple(stored[f"key{i}"]["shape"][2:]), getattr(torch, stored[f"key{i}"]["dtype"]
                                                                               .removeprefix("torch.")))
                      for i, k in enumerate(config["keys"])}
            differ = {k: v for k, v in self.storage_dtypes.items() if k not in leaves or leaves[k][1] != v}
            if differ:
                raise ValueError(f"storage_dtypes {differ} differ from its stored keys' dtypes")
        except (OSError, KeyError, TypeError, AttributeError, json.JSONDecodeError) as err:
            raise ValueError(f"storage_dir: {str(path / StorageDir.META)!r} cannot be read "
                             f"({type(err).__name__}: {err})") from None
        except ValueError as err:
            raise ValueError(f"storage_dir: {str(path)!r} cannot re-open as this storage: {err}") from None
        self._open_dir(leaves)
        self._chosen = frozenset(self.storage_dtypes)
        if self._redo[0]:  # a block armed but perhaps not copied: copy it again (the same bytes), then commit
            self._copy_staged(*(int(x) for x in self._redo[1:]))
        pos, count, total, _ = self._dir.opened_counters(self.max_size)
        self._dir.claim()
        self._ring = (pos, count, total)
        self._len = count
        self._set_last_cursor((pos - 1) % self.max_size if count else None)

    def attach(self, buffer) -> None:
        """torchrl calls this as a buffer is made on the storage: a re-opened ``storage_dir`` hands the buffer's
        writer (torchrl's default, or one it was given) the position after its newest row."""
        super().attach(buffer)
        if self._dir is None or not self._ring[2]:
            return
        writer = getattr(buffer, "_writer", None) or getattr(buffer, "_init_writer", None)
        if writer is None or not isinstance(writer, Writer):  # torchrl's default, or a factory: made now
            writer = RoundRobinWriter() if writer is None else writer()
            buffer._init_writer = writer  # noqa: SLF001 (the buffer registers this one)
        self._place(writer)

    def _place(self, writer) -> None:
        """A torchrl round-robin writer at the ring's head, its write count the rows ever written."""
        if isinstance(writer, RoundRobinWriter):
            writer._cursor, writer._write_count = self._ring[0], self._ring[2]  # noqa: SLF001

    # ------------------------------------------------------------------ writes

    def set(self, cursor, data, *, set_cursor: bool = True):
        if self.storage_dir is None:
            if not self.initialized and self.storage_dtypes and isinstance(data, TensorDictBase):
                self._init(data if isinstance(cursor, int) else data[0])  # the first rows cast as the rest
            try:
                data = _exact_rows(data, self._spec, self._chosen) if self.initialized else data
            except TypeError:
                self._rewind_writers(cursor if set_cursor else None)  # set_cursor: a writer's add or extend
                raise
            return super().set(cursor, data, set_cursor=set_cursor)
        if not self.initialized:
            self._init(data[0] if not isinstance(cursor, int) and isinstance(data, TensorDictBase) else data)
        self._check_open()  # in a forked child: refused before anything (the writer's cursor there is shared)
        try:
            data = _exact_rows(data, self._spec, self._chosen)
            self._write(_rows(cursor, self.max_size), cursor, data, set_cursor)
        except BaseException:
            self._rewind_writers()
            raise
        self._set_last_cursor(cursor)
        self._bump_mutation_revision()

    def _write(self, rows: torch.Tensor, cursor, data, set_cursor: bool) -> None:
        """Rows ``rows`` (T,) = ``data``, in staged blocks (module docstring): a not-full ring fills from its first
        free row on, so after each block the rows held are the rows torchrl serves."""
        M, (pos, count, total) = self.max_size, self._ring
        T = rows.numel()
        if not self._head_known and T:  # after a load: a full ring's head is where its writer goes on
            pos = int(rows[0]) if count == M else count
        if not set_cursor or not torch.equal(rows, (pos + torch.arange(T)) % M):
            raise ValueError(f"cursor: a storage_dir takes rows at its head (from row {pos}), got rows "
                             f"{rows[:8].tolist()}{' ...' if T > 8 else ''}{'' if set_cursor else ' in place'}; "
                             "nothing was written")
        if not isinstance(data, TensorDictBase):
            raise TypeError(f"data: expected a TensorDict, got {type(data).__name__}")
        data = data.unsqueeze(0) if isinstance(cursor, int) else data
        given = {(k,) if isinstance(k, str) else tuple(k) for k in data.keys(include_nested=True, leaves_only=True)}
        missing = set(self._spec) - given
        if missing:
            raise ValueError(f"data: a storage_dir writes whole rows, got rows without {sorted(missing)}; nothing "
                             "was written")
        kept = min(T, M)  # an extend longer than the ring keeps its last M rows, row pos + j taking row j
        first_kept = (-(T - kept)) % M if T > M else 0  # the kept row that lands on row pos
        S = self._staged.shape[0]
        for k in range(0, kept, S):
            t = min(S, kept - k)
            take = (T - kept) + (first_kept + torch.arange(k, k + t)) % kept
            self._staged[:t] = data[take]  # staged first: a failure here changes no row
            first = (pos + k) % M
            count, total = min(count + t, M), total + t
            head = (pos + T) % M if k + t == kept else (first + t) % M
            self._redo[1:] = (first, t, head, count, total)
            self._redo[0] = 1  # armed: from here a re-open finishes the copy
            self._copy_staged(first, t, head, count, total)
            self._ring, self._len, self._head_known = (head, count, total), count, True
        if T > kept:
            self._ring = (self._ring[0], count, total + T - kept)
            self._dir.commit(*self._ring)

    def _rewind_writers(self, cursor=None) -> None:
        """torchrl's round-robin writers moved their cursor before a write that raised: put them back at the head (a
        ``storage_dir``'s; else, for a writer whose cursor is just past the rows of ``cursor``, the first of them,
        its write count less their number)."""
        for buffer in self._attached_entities:
            writer = getattr(buffer, "_writer", None)
            if getattr(writer, "_storage", None) is not self:
                continue
            if self._dir is not None:
                self._place(writer)
            elif isinstance(writer, RoundRobinWriter) and cursor is not None:
                rows = _rows(cursor, self.max_size)
                if rows.numel() and writer._cursor == (int(rows[-1]) + 1) % self.max_size:  # noqa: SLF001
                    writer._cursor, writer._write_count = int(rows[0]), writer._write_count - rows.numel()  # noqa: SLF001

    def _copy_staged(self, first: int, t: int, head: int, count: int, total: int) -> None:
        """Rows ``first .. first + t - 1`` (around the ring) = the staged block; commit the journal; disarm."""
        self._dir.journal.mark_dirty()
        M, staged = self.max_size, self._staged
        split = min(t, M - first)
        self._storage[first:first + split] = staged[:split]
        if split < t:
            self._storage[:t - split] = staged[split:t]
        self._dir.commit(head, count, total)
        self._redo[0] = 0

    def _check_open(self) -> None:
        self._dir.check_writer()
        if self._dir.lock.file.closed:
            raise ValueError(f"storage_dir: {str(self._dir.path)!r} was closed; open a new storage on it to write")

    def _empty(self):
        if self._dir is not None:
            self._check_open()  # before anything changes here (torchrl's buffer reset its writer before calling)
            self._dir.before_load(self._ring[2])
            self._ring = (0, 0, self._ring[2])
        super()._empty()

    def load_state_dict(self, state_dict):
        """torchrl's ``load_state_dict``, the rows copied into this storage's tier (a ``storage_dir`` commits an
        empty ring first, so a process killed half-way re-opens empty)."""
        rows = TensorDict().load_state_dict(state_dict["_storage"], strict=False) if state_dict["initialized"] else None
        self._load_rows(rows, state_dict["_len"])

    def _load_rows(self, rows, length: int) -> None:
        if rows is None:
            self._empty()
            return
        if not self.initialized:
            self._init(rows[0])
        mine, theirs = self._spec, _leaves(rows[0])
        if mine != theirs or length > self.max_size or rows.shape[0] != self.max_size:
            raise ValueError(f"state: expected {self.max_size} rows of {mine} (at most {self.max_size} held), got "
                             f"{rows.shape[0]} rows of {theirs} ({length} held); nothing was loaded")
        if self._dir is not None:
            self._check_open()
            self._dir.before_load(self._ring[2])
        self._storage.update_(rows.to(self.storage_device))
        self._len = length
        if self._dir is not None:
            total = self._ring[2] + length
            self._ring = (length % self.max_size, length, total)
            self._head_known = length < self.max_size
            self._dir.commit(*self._ring)
        self._bump_mutation_revision()

    def loads(self, path):
        """Read what torchrl's ``dumps`` wrote under ``path`` into this storage's tier."""
        path = Path(path)
        meta = json.loads((path / "storage_metadata.json").read_text())
        self._load_rows(TensorDict.load_memmap(path), meta["len"])

    def __getstate__(self):
        if self.storage_dir is not None:
            raise TypeError(f"ReplayStorage(storage_dir={str(self.storage_dir)!r}) cannot be pickled or copied: "
                            "close() it and open the directory by path in the other process")
        return super().__getstate__()

    def flush(self) -> None:
        """Write a ``storage_dir``'s rows and journal back to disk (nothing to do for the other tiers)."""
        if self._dir is not None:
            self._check_open()
            self._dir.save_state({"total": self._ring[2]}, self._ring)

    def close(self) -> None:
        """Release a ``storage_dir`` (its lock; the rows stay readable): another process may then open it."""
        if self._dir is not None:
            self._dir.close()

    # ------------------------------------------------------------------ reads

    def get(self, index):
        """The rows ``index`` names, on ``device``; a slice (the view torchrl's samplers read episode keys from)
        stays where the rows live."""
        out = super().get(index)
        if self.device == self.storage_device or isinstance(index, slice) or not isinstance(out, TensorDictBase):
            return out
        if self.device.type == "cuda" and out.device.type == "cpu":
            out = out.pin_memory()  # one non-blocking copy per key to the device
            return out.to(self.device, non_blocking=True)
        return out.to(self.device)

    def __repr__(self) -> str:
        tier = (f"storage_dir={str(self.storage_dir)!r}" if self.storage_dir is not None
                else f"storage_device={self.storage_device}")
        return f"{type(self).__name__}(max_size={self.max_size}, device={self.device}, {tier}, len={len(self)})"
