"""StorageDir: the directory of a memory-mapped replay buffer, safe to kill at any instant.

A directory holds:

- ``gpubuf.json``: the buffer's configuration (type, sizes, file layout) and its leaves
  (shape, dtype, file), written last at creation: a directory without it is not a buffer yet;
- ``leaf<i>.bin``: one raw file per leaf, ``(E, M, *shape)`` row-major (env-major), mapped shared,
  so writes land in the file's pages. The files are allocated on disk at creation (not sparse): a
  disk without room fails then, with an error, never with a SIGBUS on a later write;
- ``counters.bin``: the row journal, twelve int64:
  ``[active slot, dirty, slot 0 (position, rows held, rows ever written, flushes), slot 1
  (likewise), boot id (2 words)]``. A commit writes the inactive slot, then flips ``active`` with
  one aligned 8-byte store, so a process killed at any instant leaves one whole slot. The rows held
  are the ``rows held`` rows before ``position`` in each env's ring;
- ``state.pt``: what the last flush saved
  (sampling RNG; priorities, ``max_priority`` and ``beta`` of a prioritized buffer; the rows ever
  written at that moment; its flush number), replaced atomically, then committed by the journal's
  flush count. A ``state.pt`` one flush ahead of the journal is a flush cut short after saving it:
  it holds what the buffer held then, and the re-open completes the flush;
- ``lock``: held with ``flock`` for the buffer's life (one writer); it names the holder's pid and
  host.

Crash consistency, as the buffer uses it: before rows that the buffer holds are overwritten, the
journal commits a state without them (fewer rows held); the rows are written; then the new state is
committed. A process killed in between re-opens without the rows in flight: every row it holds has
the bytes of one write. A ``load_state_dict`` commits an empty buffer first, so one killed half-way
re-opens empty.

After an operating-system crash (power loss), pages reach the disk in an order the kernel chooses.
The first write after a flush marks the journal ``dirty`` (and syncs that to disk first); a flush
syncs every file and clears the mark. A directory re-opened dirty under another boot
(Linux's boot id) therefore lost an unknown part of its unflushed writes: it re-opens empty
(with a warning), keeping its flushed sampling state. Without writes since the last flush it
re-opens exactly as flushed.
"""

import contextlib
import fcntl
import json
import mmap
import os
import pickle
import re
import shutil
import socket
import uuid
import warnings
from pathlib import Path

import numpy as np
import torch

from gpubuf.state import check_range
from gpubuf.tiers import advise

LAYOUT = "env-major"  # of the leaf files: recorded in the configuration, checked on re-opening
RESERVED = ("gpubuf.json", "counters.bin", "state.pt", "lock")
_ACTIVE, _DIRTY, _SLOTS, _BOOT = 0, 1, (2, 6), 10  # word offsets in counters.bin
_WORDS = 12
LEAF_FILE = re.compile(r"leaf[0-9]+\.bin")  # the only names a leaf file may have


def _boot_id() -> tuple[int, int]:
    """This boot's id as two int64 words ((0, 0) where the OS does not say)."""
    try:
        raw = uuid.UUID(Path("/proc/sys/kernel/random/boot_id").read_text().strip()).bytes
    except (OSError, ValueError):
        return 0, 0
    return tuple(int(v) for v in np.frombuffer(raw, dtype=np.int64))


def _fsync(path: Path) -> None:
    """Write a file's dirty pages (those dirtied through shared mappings too) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DirLock:
    """An exclusive ``flock`` on ``<path>/lock`` held while this object lives
    (or until :meth:`release`)."""

    def __init__(self, path: Path):
        self.file = open(path / "lock", "a+")  # noqa: SIM115 - held for the buffer's life
        try:
            fcntl.flock(self.file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.file.seek(0)
            holder = self.file.read().strip() or "another process"
            self.file.close()
            raise ValueError(f"storage_dir: {str(path)!r} is open for writing by {holder}; one "
                             "buffer at a time "
                             "may hold a directory (close() it, or let its process end)") from None
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        self.file.flush()

    def release(self) -> None:
        if not self.file.closed:
            self.file.close()  # closing the descriptor drops the flock


class Journal:
    """The crash-safe counters of ``counters.bin``:
    ``(position, rows held, rows ever written, flushes)``."""

    def __init__(self, file: Path, create: bool):
        self.file = file
        # new, or written before the journal
        if create or (file.is_file() and file.stat().st_size == 3 * 8):
            words = np.zeros(_WORDS, dtype=np.int64)
            if not create:  # one clean slot holding the three counters, no flush counted
                words[_SLOTS[0]:_SLOTS[0] + 3] = np.fromfile(file, dtype=np.int64)
            words[_BOOT:_BOOT + 2] = _boot_id()
            tmp = file.with_suffix(".tmp")
            tmp.write_bytes(words.tobytes())
            os.replace(tmp, file)
        elif not file.is_file() or file.stat().st_size != _WORDS * 8:
            raise ValueError(f"storage_dir: {file} is missing or is not the row journal ({_WORDS} "
                             "int64 words); "
                             "the rows cannot be placed without it")
        self.words = torch.from_file(str(file), shared=True, size=_WORDS, dtype=torch.int64).numpy()

    def read(self) -> tuple[int, int, int, int]:
        a = _SLOTS[int(self.words[_ACTIVE])]
        return tuple(int(v) for v in self.words[a:a + 4])

    def commit(self, pos: int, count: int, total: int, flushes: int | None = None) -> None:
        """Write the inactive slot (``flushes``: default, unchanged), then make it the active one
        (one aligned 8-byte store)."""
        if flushes is None:
            flushes = self.read()[3]
        spare = 1 - int(self.words[_ACTIVE])
        a = _SLOTS[spare]
        self.words[a:a + 4] = (pos, count, total, flushes)
        self.words[_ACTIVE] = spare

    @property
    def dirty(self) -> bool:
        return bool(self.words[_DIRTY])

    def mark_dirty(self) -> None:
        """Before the first write since the last flush: say so on disk (synced) with this boot's
        id."""
        if not self.words[_DIRTY]:
            self.words[_BOOT:_BOOT + 2] = _boot_id()
            self.words[_DIRTY] = 1
            _fsync(self.file)

    def mark_clean(self) -> None:
        """After every file was synced: nothing unflushed."""
        self.words[_DIRTY] = 0
        _fsync(self.file)

    def check(self, M: int) -> None:
        """Raise unless the words describe a ring of ``M`` rows per env."""
        active, dirty = int(self.words[_ACTIVE]), int(self.words[_DIRTY])
        if active not in (0, 1) or dirty not in (0, 1):
            raise ValueError(f"storage_dir: counters in {self.file} (active slot {active}, dirty "
                             f"{dirty}) are not a "
                             "row journal's")
        pos, count, total, flushes = self.read()
        if not (0 <= count <= M and 0 <= pos < M and total >= count and flushes >= 0):
            raise ValueError(f"storage_dir: counters in {self.file} (position {pos}, rows {count}, "
                             f"total {total}, "
                             f"flushes {flushes}) do not fit a buffer of {M} rows per env")

    def crashed_since_flush(self) -> bool:
        """Dirty, and written under another boot: the OS went down with unflushed writes."""
        here = _boot_id()
        return self.dirty and here != (0,
                                       0) and tuple(int(v)
                                                    for v in self.words[_BOOT:_BOOT + 2]) != here


class StorageDir:
    """A directory of memory-mapped leaf files plus the bookkeeping to re-open them
    (module docstring).

    Args:
        path: the directory (created when missing).
        config: the buffer's configuration (JSON values): must equal the one stored when re-opening
            (the file layout is added to it).
        shapes, dtypes: ``{leaf name: (E, M, *shape)}`` and ``{leaf name: dtype}``: ``tensors``
            holds contiguous ``(E, M, *shape)`` views of the files.

    ``reopened`` says whether the directory already held this buffer
    (its files are then mapped as they are). The lock is taken before anything is read or written;
    any error releases it and, for a new directory, removes what was created.
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
        made = not self.path.exists()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ValueError(f"storage_dir: cannot create {str(self.path)!r} "
                             f"({err.strerror})") from None
        self.lock = DirLock(self.path)
        created, self.reopened = [], False
        try:
            self._open(config, shapes, dtypes, created)
        except BaseException:
            self.lock.release()
            if not self.reopened:  # nothing of a buffer was here: leave nothing behind
                created.append(self.path / "lock")
            for file in created:
                with contextlib.suppress(OSError):
                    file.unlink()
            if made:
                shutil.rmtree(self.path, ignore_errors=True)
            raise

    def _open(self, config: dict, shapes: dict, dtypes: dict, created: list) -> None:
        leaves = {name: {"shape": list(shapes[name]), "dtype": str(dtypes[name]),
                         "file": f"leaf{i}.bin"}
                  for i, name in enumerate(shapes)}
        meta = {"config": {**config, "layout": LAYOUT}, "leaves": leaves}
        meta_file = self.path / self.META
        self.reopened = meta_file.exists()
        sizes = {name: max(int(np.prod(shape)),
                           1) * torch.empty((), dtype=dtypes[name]).element_size()
                 for name, shape in shapes.items()}  # a file is never empty
        if self.reopened:
            # the stored file of each leaf, whatever the key order
            leaves = self._check_meta(meta_file, meta)
        else:
            self._allocate({self.path / leaves[n]["file"]: size for n, size in sizes.items()},
                           created)
        self.tensors = {}
        for name, shape in shapes.items():
            file = self.path / leaves[name]["file"]
            numel = int(np.prod(shape))
            if self.reopened and (not file.is_file() or file.stat().st_size != sizes[name]):
                raise ValueError(f"storage_dir: {file} is missing or does not hold {numel} values "
                                 f"of {dtypes[name]}")
            flat = torch.from_file(str(file), shared=True, size=max(numel, 1), dtype=dtypes[name])
            # sampled windows are scattered: no readahead around page faults
            if hasattr(mmap, "MADV_RANDOM"):
                advise(flat.data_ptr(), flat.numel() * flat.element_size(), mmap.MADV_RANDOM)
            self.tensors[name] = flat[:numel].view(shape)
        if not self.reopened:
            created.append(self.path / self.COUNTERS)
        self.journal = Journal(self.path / self.COUNTERS, create=not self.reopened)
        if not self.reopened:  # written last: a directory without it is not a buffer yet
            tmp = meta_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(meta, indent=1))
            os.replace(tmp, meta_file)

    def _allocate(self, files: dict, created: list) -> None:
        """Create ``{file: bytes}`` with their blocks allocated on disk; no room raises before any
        is written."""
        need = sum(files.values()) + _WORDS * 8
        free = shutil.disk_usage(self.path).free
        if need > free:
            raise ValueError(f"storage_dir: the buffer's files need {need} bytes, but the disk "
                             "holding "
                             f"{str(self.path)!r} has {free} bytes free")
        for file, nbytes in files.items():
            fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            created.append(file)
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as err:
                raise ValueError(f"storage_dir: cannot allocate {nbytes} bytes for {file} "
                                 f"({err.strerror}); "
                                 f"the buffer's files need {need} bytes in all") from None
            finally:
                os.close(fd)

    def _check_meta(self, meta_file: Path, meta: dict) -> dict:
        """Compare the stored configuration and leaves (shapes, dtypes) with ``meta``; returns the
        stored leaves, each in a file of its own (a plain name inside the directory, distinct from
        the bookkeeping files)."""
        try:
            stored = json.loads(meta_file.read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"storage_dir: cannot read {meta_file} ({err})") from None
        if not (isinstance(stored, dict)
                and all(isinstance(stored.get(k), dict) for k in ("config", "leaves"))
                and all(isinstance(v, dict) and isinstance(v.get("file"), str)
                        and Path(v["file"]).name == v["file"]
                        # leaf files are plain names inside the directory
                        for v in stored["leaves"].values())):
            raise ValueError(f"storage_dir: {meta_file} is not a gpubuf buffer description")
        for key in ("config", "leaves"):
            ours = meta[key] if key == "config" else {n: {**v, "file": None}
                                                      for n, v in meta[key].items()}
            theirs = stored[key] if key == "config" else {n: {**v, "file": None}
                                                          for n, v in stored[key].items()}
            for field in [*ours, *sorted(set(theirs) - set(ours))]:  # the buffer type first
                if theirs.get(field) != ours.get(field):
                    raise ValueError(f"storage_dir: {str(self.path)!r} holds a buffer whose {key} "
                                     f"'{field}' is "
                                     f"{theirs.get(field)!r}, not {ours.get(field)!r}")
        owners: dict[str, str] = {}
        for name, leaf in stored["leaves"].items():
            file = leaf["file"]
            if file in RESERVED or file in owners:
                other = (f"leaf {owners[file]!r}" if file in owners
                         else "the directory's bookkeeping")
                raise ValueError(f"storage_dir: {meta_file} names the file {file!r} for leaf "
                                 f"{name!r} and for "
                                 f"{other}; every leaf needs a file of its own")
            if not LEAF_FILE.fullmatch(file):
                raise ValueError(f"storage_dir: {meta_file} names the file {file!r} for leaf "
                                 f"{name!r}; expected "
                                 "a name like 'leaf0.bin'")
            owners[file] = name
        self._check_distinct([self.path / f for f in owners] + [self.path / self.COUNTERS])
        return stored["leaves"]

    def _check_distinct(self, files: list) -> None:
        """Raise if a file is a symbolic link or two are one file (hard links): each leaf owns its
        bytes."""
        seen: dict[tuple, Path] = {}
        for file in files:
            if file.is_symlink():
                raise ValueError(f"storage_dir: {file} is a symbolic link; a leaf file must be a "
                                 "file of the "
                                 "directory's own")
            if file.is_file():
                st = file.stat()
                key = (st.st_dev, st.st_ino)
                if key in seen:
                    raise ValueError(f"storage_dir: {file} and {seen[key]} are one file (hard "
                                     "links); every "
                                     "leaf needs a file of its own")
                seen[key] = file

    # ------------------------------------------------------------------ the row journal

    def opened_counters(self, M: int) -> tuple[int, int, int, int]:
        """``(position, rows held, rows ever written, flushes)`` to re-open with, checked against
        ``M`` rows per env; a directory left dirty by another boot re-opens with no rows
        (module docstring)."""
        self.journal.check(M)
        pos, count, total, flushes = self.journal.read()
        if self.journal.crashed_since_flush():
            warnings.warn(f"storage_dir: {str(self.path)!r} was written after its last flush() and "
                          "the machine "
                          "restarted since; the unflushed writes may be partial, so it re-opens "
                          "with no rows "
                          "(its flushed sampling state is kept)", stacklevel=3)
            self.journal.commit(pos, 0, total)
            self.journal.mark_clean()
            count = 0
        return pos, count, total, flushes

    def before_write(self, pos: int, count: int, total: int, T: int, M: int) -> None:
        """About to write ``T`` rows per env at ``pos`` of a ring holding ``count`` rows: commit a
        state without the held rows that the write overwrites."""
        self.journal.mark_dirty()
        if count + T > M:
            self.journal.commit(pos, M - T, total)

    def before_load(self, total: int) -> None:
        """About to overwrite every row (a load): commit an empty buffer."""
        self.journal.mark_dirty()
        self.journal.commit(0, 0, total)

    def commit(self, pos: int, count: int, total: int) -> None:
        """The rows are written: commit the write position, rows held and rows ever written."""
        self.journal.commit(pos, count, total)

    # ------------------------------------------------------------------ flushed state

    def restore_flushed(self, ring, flushes: int, reopen, generator: torch.Generator) -> bool:
        """Restore what the last flush saved into ``generator`` and, through
        ``reopen(state, since)``, the sampler, given the ``ring`` re-opened from the journal
        (``flushes``: its flush count). Everything is checked first
        (``ValueError`` naming ``state.pt``); returns whether the state was one flush ahead of the
        journal (a flush cut short after saving it: the caller completes it)."""
        ahead = []

        def restore(state):
            since = ring.count  # held rows written after the flushed state: at max_priority
            if state is None and flushes:
                raise ValueError(f"missing, while the row journal counts {flushes} flushes")
            if state is not None:
                if not isinstance(state, dict):
                    raise ValueError(f"expected the dict a flush saves, got {type(state).__name__}")
                rng = state["rng"]
                if not isinstance(rng, torch.Tensor) or rng.dtype != torch.uint8 or rng.dim() != 1:
                    raise ValueError("rng: expected a uint8 generator state, got "
                                     f"{type(rng).__name__}")
                torch.Generator().set_state(rng)  # checked before anything is restored
                flush = check_range("flush", state.get("flush", 0), flushes, flushes + 1)
                # a flush cut short: its state is what the rows held then
                ahead.append(flush > flushes)
                flushed = check_range("total", state["total"], 0, 2**62 if ahead[0] else ring.total)
                since = 0 if ahead[0] else min(ring.total - flushed, ring.count)
            reopen(state, since)
            if state is not None:
                generator.set_state(rng)

        self.load_state_checked(restore)
        return bool(ahead and ahead[0])

    def load_state_checked(self, restore) -> None:
        """``restore(state or None)`` with what the last :meth:`save_state` wrote; a state file that
        cannot be read or restored raises ValueError naming it."""
        file = self.path / self.STATE
        try:
            restore(self.load_state())
        except (KeyError, TypeError, ValueError, RuntimeError, EOFError,
                pickle.UnpicklingError) as err:
            raise ValueError(f"storage_dir: {file} cannot be restored "
                             f"({type(err).__name__}: {err})") from None

    def save_state(self, state: dict, counters: tuple[int, int, int]) -> None:
        """Write ``state`` (tensors and plain values) with the next flush number to ``state.pt``
        atomically, commit ``counters`` with that number, write every file back to disk, then mark
        the journal clean."""
        flush = self.journal.read()[3] + 1
        tmp = self.path / (self.STATE + ".tmp")
        torch.save({**state, "flush": flush}, tmp)
        os.replace(tmp, self.path / self.STATE)
        self.journal.commit(*counters, flush)
        for file in self.path.iterdir():
            if file.suffix in (".bin", ".pt"):
                _fsync(file)  # also writes back pages dirtied through the shared mappings
        self.journal.mark_clean()

    def load_state(self) -> dict | None:
        """What the last :meth:`save_state` wrote, or None."""
        file = self.path / self.STATE
        return torch.load(file, weights_only=True) if file.exists() else None

    def close(self) -> None:
        """Release the lock (the mappings stay readable while tensors use them)."""
        self.lock.release()

    @property
    def closed(self) -> bool:
        return self.lock.file.closed
