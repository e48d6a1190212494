"""A torchrl storage whose rows live in gpubuf's storage tiers: the sampling device, host memory, or a ``storage_dir``.

:class:`ReplayStorage` is a torchrl ``TensorStorage`` (so torchrl's writers, samplers, ``Sequence`` units,
transforms, ``state_dict`` and ``dumps`` / ``loads`` work on it as on ``LazyTensorStorage``), allocated on the first
write from that row's keys, shapes and dtypes, in one of three places:

- **the sampling device** (``storage_device`` left out): like ``LazyTensorStorage(device=...)``;
- **host memory** (``storage_device="cpu"`` with a CUDA ``device``): rows stay in host RAM (asked for huge pages),
  and each draw is gathered on the host into pinned memory and sent to ``device`` with one non-blocking copy per
  key, so the GPU holds only the batches;
- **a ``storage_dir``**: gpubuf's memory-mapped files, allocated on disk at creation, with its row journal. A
  process killed at any instant (``SIGKILL`` mid-``extend`` included) leaves a directory that re-opens holding
  every complete row and none of the rows in flight; ``ReplayStorage(max_size, storage_dir=path)`` re-opens it
  with its rows (a buffer made on it continues writing after the newest row), and ``flush()`` writes it back to
  disk. One process writes it: the one that opened it (a forked child is refused, ``RuntimeError``); a second
  opener is refused while the first holds it.

A ``storage_dir`` takes its rows at the ring's head only (the rows torchrl's ``RoundRobinWriter`` writes):
rewriting held rows in place (``rb[index] = ...``, ``write_at``) raises ``ValueError`` with nothing written, as
the journal could not tell a half-rewritten row from a whole one. torchrl's writer moves its cursor before the
storage writes: after a write that raised (data without a stored key, say) it stands past rows that were never
written, and a ``storage_dir`` refuses its next writes until ``empty()`` (or a re-open) starts the ring again.
"""

import json
from pathlib import Path

import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data.replay_buffers.storages import TensorStorage

from gpubuf._core.devices import parse_device
from gpubuf._core.host_memory import advise_huge
from gpubuf.replay.storage_dir import StorageDir

_KIND = "gpubuf.torchrl.ReplayStorage"


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


class ReplayStorage(TensorStorage):
    """torchrl ``TensorStorage`` of ``max_size`` rows in one of gpubuf's tiers (module docstring).

    Args:
        max_size: rows held (``int >= 1``).
        device: where sampled rows are returned (default: the CPU).
        storage_device: where rows live (default: ``device``); ``"cpu"`` with a CUDA ``device`` is the host tier.
        storage_dir: a directory of memory-mapped files (rows on the host, ``storage_device`` must be the CPU); an
            existing one is re-opened with its rows (its ``max_size`` must match).
    """

    def __init__(self, max_size: int, *, device=None, storage_device=None, storage_dir=None):
        if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1:
            raise ValueError(f"max_size: expected an int >= 1, got {max_size!r}")
        device = parse_device("cpu" if device is None else device)
        storage_device = device if storage_device is None else parse_device(storage_device)
        if storage_dir is not None and storage_device.type != "cpu":
            raise ValueError(f"storage_device: a storage_dir keeps rows on the host (cpu), got {storage_device}")
        super().__init__(storage=None, max_size=max_size, device=device)
        self.storage_device, self.storage_dir = storage_device, storage_dir
        self._dir = None
        self._ring = (0, 0, 0)  # a storage_dir's (head, rows held, rows ever written), as its journal holds them
        self._head_known = True
        if storage_dir is not None and (Path(storage_dir) / StorageDir.META).exists():
            self._reopen()

    # ------------------------------------------------------------------ allocation

    def _init(self, row) -> None:
        if not isinstance(row, TensorDictBase):
            raise TypeError(f"data: expected a TensorDict, got {type(row).__name__}")
        leaves = _leaves(row)
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

    def _open_dir(self, leaves: dict) -> None:
        config = {"type": _KIND, "max_size": self.max_size, "keys": [list(k) for k in leaves]}
        shapes = {f"key{i}": (1, self.max_size, *shape) for i, (shape, _) in enumerate(leaves.values())}
        dtypes = {f"key{i}": dtype for i, (_, dtype) in enumerate(leaves.values())}
        self._dir = StorageDir(self.storage_dir, config, shapes, dtypes)
        self._adopt({key: self._dir.tensors[f"key{i}"][0] for i, key in enumerate(leaves)})

    def _reopen(self) -> None:
        path = Path(self.storage_dir)
        try:
            meta = json.loads((path / StorageDir.META).read_text())
            config, stored = meta["config"], meta["leaves"]
            if config.get("type") != _KIND:
                raise ValueError(f"it holds a {config.get('type')!r}, not a {_KIND}")
            if config["max_size"] != self.max_size:
                raise ValueError(f"it holds {config['max_size']} rows, not max_size={self.max_size}")
            leaves = {tuple(k): (tuple(stored[f"key{i}"]["shape"][2:]), getattr(torch, stored[f"key{i}"]["dtype"]
                                                                               .removeprefix("torch.")))
                      for i, k in enumerate(config["keys"])}
        except (OSError, KeyError, TypeError, AttributeError, json.JSONDecodeError) as err:
            raise ValueError(f"storage_dir: {str(path / StorageDir.META)!r} cannot be read "
                             f"({type(err).__name__}: {err})") from None
        except ValueError as err:
            raise ValueError(f"storage_dir: {str(path)!r} cannot re-open as this storage: {err}") from None
        self._open_dir(leaves)
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
        from torchrl.data.replay_buffers.writers import RoundRobinWriter, Writer

        writer = getattr(buffer, "_writer", None) or getattr(buffer, "_init_writer", None)
        if writer is None or not isinstance(writer, Writer):  # torchrl's default, or a factory: made now
            writer = RoundRobinWriter() if writer is None else writer()
            buffer._init_writer = writer  # noqa: SLF001 (the buffer registers this one)
        if isinstance(writer, RoundRobinWriter):
            writer._cursor, writer._write_count = self._ring[0], self._ring[2]  # noqa: SLF001

    # ------------------------------------------------------------------ writes

    def set(self, cursor, data, *, set_cursor: bool = True):
        if self.storage_dir is None:
            return super().set(cursor, data, set_cursor=set_cursor)
        if not self.initialized:
            self._init(data[0] if not isinstance(cursor, int) and isinstance(data, TensorDictBase) else data)
        self._check_open()
        M, (pos, count, total) = self.max_size, self._ring
        rows = _rows(cursor, M)
        T = rows.numel()
        if not self._head_known and T:  # after a load: a full ring's head is where its writer goes on
            pos = int(rows[0]) if count == M else count
        if T > M or not torch.equal(rows, (pos + torch.arange(T)) % M):
            raise ValueError(f"cursor: a storage_dir takes rows at its head ({T} rows from row {pos}, at most "
                             f"{M}), got rows {rows[:8].tolist()}{' ...' if T > 8 else ''}; nothing was written")
        self._dir.before_write(pos, count, total, T, M)
        try:
            super().set(cursor, data, set_cursor=set_cursor)
        except BaseException:  # the journal holds what before_write left: the rows not overwritten
            held = M - T if count + T > M else count
            self._ring, self._len = (pos, held, total), held
            raise
        self._ring = ((pos + T) % M, min(count + T, M), total + T)
        self._head_known = True
        self._dir.commit(*self._ring)

    def _check_open(self) -> None:
        self._dir.check_writer()
        if self._dir.lock.file.closed:
            raise ValueError(f"storage_dir: {str(self._dir.path)!r} was closed; open a new storage on it to write")

    def _empty(self):
        super()._empty()
        if self._dir is not None and self.initialized:
            self._check_open()
            self._dir.before_load(self._ring[2])
            self._ring = (0, 0, self._ring[2])

    def load_state_dict(self, state_dict):
        """torchrl's ``load_state_dict``, the rows copied into this storage's tier (a ``storage_dir`` commits an
        empty ring first, so a process killed half-way re-opens empty)."""
        rows = TensorDict().load_state_dict(state_dict["_storage"], strict=False) if state_dict["initialized"] \
            else None
        self._load_rows(rows, state_dict["_len"])

    def _load_rows(self, rows, length: int) -> None:
        if rows is None:
            self._empty()
            return
        if not self.initialized:
            self._init(rows[0])
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
