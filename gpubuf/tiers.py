"""Storage tiers of the replay buffers: where the transitions live, apart from where sampling runs.

A buffer samples on its ``device`` (validity masks, prefix-sum trees, priorities). Its storage may live
there too (the default), in host memory (``storage_device="cpu"``: pinned staging carries the sampled
windows to a CUDA device), or in memory-mapped files of a directory (``storage_dir``), which a later
process re-opens. :class:`StorageDir` owns such a directory:

- ``gpubuf.json``: the buffer's configuration (type, sizes, leaf shapes and dtypes);
- ``leaf<i>.bin``: one raw file per leaf (named in ``gpubuf.json``), ``(E, M, *shape)`` row-major, mapped
  shared (writes land in the file). Env-major (``"layout": "env-major"`` in the configuration): one env's
  consecutive steps are adjacent, so a sampled window is one contiguous read. The buffer writes through a
  transposed ``(M, E, *shape)`` view and gathers with :func:`env_major_gather`; flat starts stay
  ``step * E + env`` as in every other tier;
- ``counters.bin``: int64 ``(write position, rows written, total rows ever written)``, updated by every insert;
- ``state.pt``: what :meth:`flush` saves (sampling RNG state, and for prioritized buffers the priorities,
  ``max_priority`` and ``beta``), with the total rows at that moment.

Reading a mapped file: the kernel reads ahead around every page fault (up to ``read_ahead_kb``, 8 MiB on
the machine this was measured on), which for random windows reads ~50x the bytes asked for. The leaf
mappings are therefore advised ``MADV_RANDOM`` (no readahead), and before gathering, every window of a leaf
whose window spans at least a page is advised ``MADV_WILLNEED``: the kernel then reads all of a batch's
windows in parallel instead of one page fault after another (Linux; elsewhere both are skipped).

The host RAM tier (``storage_device="cpu"``) stays time-major ``(M, E, *shape)`` like device storage: in
RAM, 32 windows of 16 12-KiB frames gathered 16 % faster env-major, while a float leaf gathered 2.3x
slower (the env-major row index costs a division and a modulo more), and every insert of ``T`` rows
scatters into ``E`` places instead of one.
"""

import ctypes
import json
import mmap
import os
import pickle
from pathlib import Path

import numpy as np
import torch

from gpubuf.ops import resolve_device
from gpubuf.reference import as_words

LAYOUT = "env-major"  # of the leaf files: recorded in the configuration, checked on re-opening


def _libc_madvise():
    """libc's ``madvise(addr, length, advice)``, or None where it cannot be had."""
    if not hasattr(mmap, "MADV_WILLNEED"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


_MADVISE = _libc_madvise()


def advise(address: int, nbytes: int, advice: int) -> None:
    """``madvise`` the pages holding bytes ``[address, address + nbytes)`` of a mapping; a hint: where
    ``madvise`` is missing or refuses, nothing happens."""
    if _MADVISE is not None and nbytes > 0:
        lo = address - address % mmap.PAGESIZE
        _MADVISE(lo, address + nbytes - lo, advice)


def prefetch_windows(storage: torch.Tensor, first_rows: torch.Tensor, n: int, M: int) -> None:
    """Ask the kernel to read, in parallel, the windows of ``n`` rows of a mapped env-major ``storage``
    (E*M, D) starting at rows ``first_rows`` (B,) (a window that runs past its env's last row ``M - 1``
    continues at the env's first). Only for windows of at least a page; smaller leaves read few pages."""
    row_bytes = storage.shape[1] * storage.element_size()
    if _MADVISE is None or n * row_bytes < mmap.PAGESIZE:
        return
    base, willneed = storage.data_ptr(), mmap.MADV_WILLNEED
    for row in first_rows.tolist():
        env_first = row - row % M
        head = min(n, env_first + M - row)  # rows before the window wraps to the env's first row
        advise(base + row * row_bytes, head * row_bytes, willneed)
        if head < n:
            advise(base + env_first * row_bytes, (n - head) * row_bytes, willneed)


def storage_device_for(device: torch.device, storage_device, storage_dir) -> torch.device:
    """The device the storage lives on: ``device`` unless ``storage_device`` says ``"cpu"`` or a
    ``storage_dir`` is given (memory-mapped files are host memory)."""
    if storage_dir is not None:
        if storage_device is not None and resolve_device(storage_device).type != "cpu":
            raise ValueError(f"storage_device: a storage_dir maps files into host memory; expected None or 'cpu', "
                             f"got {storage_device!r}")
        return torch.device("cpu")
    if storage_device is None:
        return device
    resolved = resolve_device(storage_device)
    if resolved != device and resolved.type != "cpu":
        raise ValueError(f"storage_device: expected None, 'cpu' or the buffer's device {device}, got "
                         f"{storage_device!r}")
    return resolved


class StorageDir:
    """A directory of memory-mapped leaf files plus the bookkeeping to re-open them.

    Args:
        path: the directory (created when missing).
        config: the buffer's configuration (JSON values): must equal the one stored when re-opening (the
            file layout is added to it).
        shapes, dtypes: ``{leaf name: (E, M, *shape)}`` and ``{leaf name: dtype}``: ``tensors`` holds
            contiguous ``(E, M, *shape)`` views of the files.

    ``reopened`` says whether the directory already held this buffer (its files are then mapped as they are).
    """

    META, COUNTERS, STATE = "gpubuf.json", "counters.bin", "state.pt"

    def __init__(self, path, config: dict, shapes: dict, dtypes: dict):
        try:
            self.path = Path(os.fspath(path))
        except TypeError:
            raise TypeError(f"storage_dir: expected a path, got {type(path).__name__}") from None
        if not os.fspath(path):
            raise ValueError("storage_dir: expected a directory path, got ''")
        if self.path.exists() and not self.path.is_dir():
            raise ValueError(f"storage_dir: {str(self.path)!r} exists and is not a directory")
        leaves = {name: {"shape": list(shapes[name]), "dtype": str(dtypes[name]), "file": f"leaf{i}.bin"}
                  for i, name in enumerate(shapes)}
        meta = {"config": {**config, "layout": LAYOUT}, "leaves": leaves}
        meta_file = self.path / self.META
        self.reopened = meta_file.exists()
        if self.reopened:
            leaves = self._check_meta(meta_file, meta)  # the stored file of each leaf, whatever the key order
        else:
            try:
                self.path.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise ValueError(f"storage_dir: cannot create {str(self.path)!r} ({err.strerror})") from None
        self.tensors = {}
        for name, shape in shapes.items():
            file = self.path / leaves[name]["file"]
            numel = int(np.prod(shape))
            nbytes = max(numel, 1) * torch.empty((), dtype=dtypes[name]).element_size()  # a file is never empty
            if self.reopened and (not file.is_file() or file.stat().st_size != nbytes):
                raise ValueError(f"storage_dir: {file} is missing or does not hold {numel} values of {dtypes[name]}")
            flat = torch.from_file(str(file), shared=True, size=max(numel, 1), dtype=dtypes[name])
            if hasattr(mmap, "MADV_RANDOM"):  # sampled windows are scattered: no readahead around page faults
                advise(flat.data_ptr(), flat.numel() * flat.element_size(), mmap.MADV_RANDOM)
            self.tensors[name] = flat[:numel].view(shape)
        counters = self.path / self.COUNTERS
        if self.reopened and (not counters.is_file() or counters.stat().st_size != 3 * 8):
            raise ValueError(f"storage_dir: {counters} is missing or is not 3 int64 counters; the rows cannot be "
                             "placed without it")
        self.counters = torch.from_file(str(counters), shared=True, size=3, dtype=torch.int64)
        if not self.reopened:  # written last: a directory without it is not a buffer yet
            tmp = meta_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(meta, indent=1))
            os.replace(tmp, meta_file)

    def _check_meta(self, meta_file: Path, meta: dict) -> dict:
        """Compare the stored configuration and leaves (shapes, dtypes) with ``meta``; returns the stored leaves."""
        try:
            stored = json.loads(meta_file.read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"storage_dir: cannot read {meta_file} ({err})") from None
        if not (isinstance(stored, dict) and all(isinstance(stored.get(k), dict) for k in ("config", "leaves"))
                and all(isinstance(v, dict) and isinstance(v.get("file"), str) and Path(v["file"]).name == v["file"]
                        for v in stored["leaves"].values())):  # leaf files are plain names inside the directory
            raise ValueError(f"storage_dir: {meta_file} is not a gpubuf buffer description")
        for key in ("config", "leaves"):
            ours = meta[key] if key == "config" else {n: {**v, "file": None} for n, v in meta[key].items()}
            theirs = stored[key] if key == "config" else {n: {**v, "file": None} for n, v in stored[key].items()}
            for field in [*ours, *sorted(set(theirs) - set(ours))]:  # the buffer type first
                if theirs.get(field) != ours.get(field):
                    raise ValueError(f"storage_dir: {str(self.path)!r} holds a buffer whose {key} '{field}' is "
                                     f"{theirs.get(field)!r}, not {ours.get(field)!r}")
        return stored["leaves"]

    def load_state_checked(self, restore) -> None:
        """``restore(state or None)`` with what the last :meth:`save_state` wrote; a state file that cannot be
        read or restored raises ValueError naming it."""
        file = self.path / self.STATE
        try:
            restore(self.load_state())
        except (KeyError, TypeError, ValueError, RuntimeError, EOFError, pickle.UnpicklingError) as err:
            raise ValueError(f"storage_dir: {file} cannot be restored ({type(err).__name__}: {err})") from None

    def set_counters(self, pos: int, count: int, total: int) -> None:
        """Record the write position, rows written and total rows ever written (three int64 stores)."""
        self.counters.numpy()[:] = (pos, count, total)

    def save_state(self, state: dict) -> None:
        """Write ``state`` (tensors and plain values) to ``state.pt`` atomically, then flush every file."""
        tmp = self.path / (self.STATE + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.path / self.STATE)
        for file in self.path.iterdir():
            if file.suffix in (".bin", ".pt"):
                fd = os.open(file, os.O_RDONLY)
                try:
                    os.fsync(fd)  # also writes back pages dirtied through the shared mappings
                finally:
                    os.close(fd)

    def load_state(self) -> dict | None:
        """What the last :meth:`save_state` wrote, or None."""
        file = self.path / self.STATE
        return torch.load(file, weights_only=True) if file.exists() else None


def env_major_gather(jobs: list, starts: torch.Tensor, n: int, E: int, M: int, prefetch: bool = False) -> None:
    """For each ``(storage (E*M, D), out (B, n, D), shift)`` in ``jobs``: out = storage rows
    ``(start % E) * M + (start // E + j + shift) % M``, j < n, for flat starts ``step * E + env`` (B,): the
    windows of :func:`gpubuf.reference.sequence_gather` from env-major storage. Host tensors; rows are
    computed once per distinct shift. ``prefetch``: the storages are file mappings (:func:`prefetch_windows`
    first)."""
    B = starts.shape[0]
    if B == 0:
        return
    env_row, step = (starts % E).mul_(M).unsqueeze_(1), (starts // E).unsqueeze_(1)  # (B, 1) each
    rows = {}
    for storage, out, shift in jobs:
        if shift not in rows:
            j = torch.arange(shift, n + shift, device=starts.device)
            rows[shift] = (step + j).remainder_(M).add_(env_row).view(-1)  # (B * n,)
        src, dst = as_words(storage, out.view(B * n, storage.shape[1]))
        if prefetch:
            prefetch_windows(src, rows[shift][::n], n, M)
        torch.index_select(src, 0, rows[shift], out=dst)
