"""StorageDir: the directory of a memory-mapped replay buffer, safe to kill at any instant.

A directory holds:

- ``gpubuf.json``: the buffer's configuration (type, sizes, file layout) and its leaves (shape, dtype, file), written
  last at creation: a directory without it is not a buffer yet;
- ``leaf<i>.bin``: one raw file per leaf, ``(E, M, *shape)`` row-major (env-major), mapped shared, so writes land in the
  file's pages. The files are allocated on disk at creation (not sparse): a disk without room fails then, with an error,
  never with a SIGBUS on a later write;
- ``counters.bin``: the row journal (:mod:`gpubuf.replay.storage.journal`: position, rows held, rows ever written,
  flushes, in two slots so that a process killed at any instant leaves one whole). The rows held are the ``rows held``
  rows before ``position`` in each env's ring;
- ``state.pt``: what the last flush saved (sampling RNG; priorities, ``max_priority`` and ``beta`` of a prioritized
  buffer; the rows ever written at that moment; its flush number), replaced atomically, then committed by the journal's
  flush count. A ``state.pt`` one flush ahead of the journal is a flush cut short after saving it: it holds what the
  buffer held then, and the re-open completes the flush;
- ``lock``: held with ``flock`` for the buffer's life (one writer, :mod:`gpubuf.replay.storage.lock`); it names the
  holder's pid and host.

Crash consistency, as the buffer uses it: before rows that the buffer holds are overwritten, the journal commits a state
without them (fewer rows held); the rows are written; then the new state is committed. A process killed in between
re-opens without the rows in flight: every row it holds has the bytes of one write. A ``load_state_dict`` commits an
empty buffer first, so one killed half-way re-opens empty.

After an operating-system crash (power loss), pages reach the disk in an order the kernel chooses. The first write after
a flush marks the journal ``dirty`` (and syncs that to disk first); a flush syncs every file and clears the mark. A
directory re-opened dirty under another boot (Linux's boot id) therefore lost an unknown part of its unflushed writes:
it re-opens empty (with a warning), keeping its flushed sampling state. Without writes since the last flush it re-opens
exactly as flushed.

Damage is refused, never re-created over or guessed at (``ValueError`` naming the file, from the checks of
:mod:`gpubuf.replay.storage.format`; a refused open changes nothing in the directory, its lock file included):

- a directory holding a buffer's files (``leaf<i>.bin``, ``counters.bin``, ``state.pt`` or their temporary files) but no
  ``gpubuf.json`` (lost, or a creation cut short); an empty or missing directory is created as a new buffer;
- a ``counters.bin`` that is not the journal: 24 bytes are the three counters of a directory written before the journal
  (``position, rows held, rows ever written``) only where they fit the ring as that format kept it (a ring not yet full
  holds rows ``0 .. position - 1``), the ``gpubuf.json`` is not one of the journal's (which records it) and no
  ``state.pt`` was saved by a flush of the journal (which numbers it); such a directory is converted when it opens;
- a ``state.pt`` that cannot be read (truncated at any byte, not a flush's file) or restored.

A flush that cannot write ``state.pt`` (a full disk; the file-size limit ``RLIMIT_FSIZE``, reached with ``SIGXFSZ``
ignored: otherwise the OS ends the process, as for any write) raises ``OSError`` naming it and the cause; the temporary
file is removed, the previous ``state.pt`` and the journal are untouched and the buffer is as before, so a later flush
can succeed.

One process writes: the one that opened the directory (its *owner*). A process forked from it inherits the mappings and
the lock's descriptor; :meth:`StorageDir.check_writer` refuses it every write (``RuntimeError`` naming the directory and
both pids), and :attr:`StorageDir.closed` is true there, so a buffer's ``close()`` in the child does nothing; the
child's copy of the lock is closed at the fork (:mod:`gpubuf.replay.storage.lock`). Reading (sampling) in the child
stays possible: the mapping is shared, and the owner's later writes show through it."""

import contextlib
import io
import json
import mmap
import os
import pickle
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch

from gpubuf._core.state import check_range
from gpubuf.replay.storage import format as fmt
from gpubuf.replay.storage.files import fsync, replace_file
from gpubuf.replay.storage.journal import JOURNAL, WORDS, Journal
from gpubuf.replay.storage.lock import DirLock
from gpubuf.replay.storage.tiers import advise


class StorageDir:
    """A directory of memory-mapped leaf files plus the bookkeeping to re-open them (module docstring).

    Args:
        path: the directory (created when missing).
        config: the buffer's configuration (JSON values): must equal the one stored when re-opening (the file
            layout is added to it).
        shapes, dtypes: ``{leaf name: (E, M, *shape)}`` and ``{leaf name: dtype}``: ``tensors`` holds contiguous
            ``(E, M, *shape)`` views of the files.

    ``reopened`` says whether the directory already held this buffer (its files are then mapped as they are); ``pid``
    is the process that opened it, the only one that may write it (:meth:`check_writer`). The lock is taken before
    anything is read or written; any error releases it and leaves the directory as it was (for a new directory, what
    was created is removed, the lock file too where it was made here). Once the buffer restored what it holds,
    :meth:`claim` names this process in the lock file."""

    META, COUNTERS, STATE = fmt.META, fmt.COUNTERS, fmt.STATE

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
            raise ValueError(f"storage_dir: cannot create {str(self.path)!r} ({err.strerror})") from None
        self.lock = DirLock(self.path)
        self.pid = os.getpid()
        created, self.reopened = [], False
        try:
            self._open(config, shapes, dtypes, created)
        except BaseException:
            self.lock.release()
            if self.lock.created:  # made by this open: leave nothing behind
                created.append(self.path / "lock")
            for file in created:
                with contextlib.suppress(OSError):
                    file.unlink()
            if made:
                shutil.rmtree(self.path, ignore_errors=True)
            raise

    def _open(self, config: dict, shapes: dict, dtypes: dict, created: list) -> None:
        leaves = {name: {"shape": list(shapes[name]), "dtype": str(dtypes[name]), "file": f"leaf{i}.bin"}
                  for i, name in enumerate(shapes)}
        meta = {"config": {**config, "layout": fmt.LAYOUT}, "leaves": leaves, "journal": JOURNAL}
        meta_file = self.path / self.META
        self.reopened = os.path.lexists(meta_file)
        sizes = {name: max(int(np.prod(shape)), 1) * torch.empty((), dtype=dtypes[name]).element_size()
                 for name, shape in shapes.items()}  # a file is never empty
        if self.reopened:
            stored = fmt.check_meta(self.path, meta)
            leaves = stored["leaves"]  # the stored file of each leaf, whatever the key order
        else:
            fmt.check_no_buffer_files(self.path)
            self._allocate({self.path / leaves[n]["file"]: size for n, size in sizes.items()}, created)
        self.tensors = {}
        for name, shape in shapes.items():
            file = self.path / leaves[name]["file"]
            numel = int(np.prod(shape))
            if self.reopened and (not file.is_file() or file.stat().st_size != sizes[name]):
                raise ValueError(f"storage_dir: {file} is missing or does not hold {numel} values of {dtypes[name]}")
            flat = torch.from_file(str(file), shared=True, size=max(numel, 1), dtype=dtypes[name])
            if hasattr(mmap, "MADV_RANDOM"):  # sampled windows are scattered: no readahead around page faults
                advise(flat.data_ptr(), flat.numel() * flat.element_size(), mmap.MADV_RANDOM)
            self.tensors[name] = flat[:numel].view(shape)
        counters = self.path / self.COUNTERS
        if not self.reopened:
            created.append(counters)
            self.journal = Journal(counters, Journal.fresh())
            self.journal.write()
            # written last: a directory without it is not a buffer yet
            replace_file(meta_file, json.dumps(meta, indent=1).encode(), meta_file.with_suffix(".tmp"))
        elif fmt.is_legacy_counters(self.path):
            M = next(iter(shapes.values()))[1]  # (E, M, *shape)
            # converted by claim(), once the buffer opened
            self.journal = Journal(counters, Journal.fresh(fmt.legacy_counters(self.path, stored, M)))
        else:
            self.journal = Journal(counters)

    def claim(self) -> None:
        """The buffer opened: write a journal converted from the earlier format; name this process in the lock file."""
        self.journal.write()
        self.lock.claim()

    def _allocate(self, files: dict, created: list) -> None:
        """Create ``{file: bytes}`` with their blocks allocated on disk; no room raises before any is written."""
        need = sum(files.values()) + WORDS * 8
        free = shutil.disk_usage(self.path).free
        if need > free:
            raise ValueError(f"storage_dir: the buffer's files need {need} bytes, but the disk holding "
                             f"{str(self.path)!r} has {free} bytes free")
        for file, nbytes in files.items():
            fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            created.append(file)
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as err:
                raise ValueError(f"storage_dir: cannot allocate {nbytes} bytes for {file} ({err.strerror}); the "
                                 f"buffer's files need {need} bytes in all") from None
            finally:
                os.close(fd)

    # ------------------------------------------------------------------ the row journal

    def opened_counters(self, M: int) -> tuple[int, int, int, int]:
        """``(position, rows held, rows ever written, flushes)`` to re-open with, checked against ``M`` rows per
        env; a directory left dirty by another boot re-opens with no rows (module docstring)."""
        self.journal.check(M)
        pos, count, total, flushes = self.journal.read()
        if self.journal.crashed_since_flush():
            warnings.warn(f"storage_dir: {str(self.path)!r} was written after its last flush() and the machine "
                          "restarted since; the unflushed writes may be partial, so it re-opens with no rows (its "
                          "flushed sampling state is kept)", stacklevel=3)
            self.journal.commit(pos, 0, total)
            self.journal.mark_clean()
            count = 0
        return pos, count, total, flushes

    def before_write(self, pos: int, count: int, total: int, T: int, M: int) -> None:
        """About to write ``T`` rows per env at ``pos`` of a ring holding ``count`` rows: commit a state without
        the held rows that the write overwrites."""
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
        """Restore what the last flush saved into ``generator`` and, through ``reopen(state, since)``, the sampler,
        given the ``ring`` re-opened from the journal (``flushes``: its flush count). Everything is checked first; a
        ``state.pt`` that cannot be read or restored raises ``ValueError`` naming it. Returns whether the state was one
        flush ahead of the journal (a flush cut short after saving it: the caller completes it)."""
        state = fmt.read_state(self.path)
        journal = f"the row journal {self.path / self.COUNTERS}"
        since, ahead = ring.count, False  # held rows written after the flushed state: at max_priority
        try:
            if state is None and flushes:
                raise ValueError(f"missing, while {journal} counts {flushes} flushes")
            if state is not None:
                rng = state["rng"]
                if not isinstance(rng, torch.Tensor) or rng.dtype != torch.uint8 or rng.dim() != 1:
                    raise ValueError(f"rng: expected a uint8 generator state, got {type(rng).__name__}")
                torch.Generator().set_state(rng)  # checked before anything is restored
                flush = check_range("flush", state.get("flush", 0), 0, 2**62)
                flushed = check_range("total", state["total"], 0, 2**62)
                # one flush ahead (a flush or a load cut short) the state may hold rows the journal does not
                if not (flush - flushes in (0, 1) and flushed <= (2**62 if flush > flushes else ring.total)):
                    raise ValueError(f"it was saved by flush {flush} with {flushed} rows ever written, which "
                                     f"{journal} ({flushes} flushes, {ring.total} rows ever written) cannot follow: "
                                     "one of the two files is damaged, or they come from different buffers")
                ahead = flush > flushes  # a flush cut short: its state is what the rows held then
                since = 0 if ahead else min(ring.total - flushed, ring.count)
            reopen(state, since)
            if state is not None:
                generator.set_state(rng)
        except (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError, OverflowError, EOFError,
                pickle.UnpicklingError) as err:
            raise ValueError(f"storage_dir: {self.path / self.STATE} cannot be restored "
                             f"({type(err).__name__}: {err})") from None
        return ahead

    def save_state(self, state: dict, counters: tuple[int, int, int]) -> None:
        """Write ``state`` (tensors and plain values) with the next flush number to ``state.pt`` atomically
        (serialized in memory, written with plain writes, renamed into place), commit ``counters`` with that
        number, write every file back to disk, then mark the journal clean. A ``state.pt`` that cannot be written
        raises ``OSError`` before anything else changed (module docstring)."""
        flush = self.journal.read()[3] + 1
        file = self.path / self.STATE
        data = io.BytesIO()
        torch.save({**state, "flush": flush}, data)
        try:
            replace_file(file, data.getbuffer(), self.path / (self.STATE + ".tmp"))
        except OSError as err:
            raise OSError(err.errno, f"storage_dir: cannot write {file} ({err.strerror or err}); the flush changed "
                                     f"nothing (the previous {self.STATE} and the row journal are kept); once "
                                     "there is room (disk space, the file-size limit), flush() again") from err
        self.journal.commit(*counters, flush)
        for part in self.path.iterdir():
            if part.suffix in (".bin", ".pt"):
                fsync(part)  # also writes back pages dirtied through the shared mappings
        self.journal.mark_clean()

    # ------------------------------------------------------------------ the writing process

    def check_writer(self) -> None:
        """Raise ``RuntimeError`` in a process other than the one that opened the directory (a forked child), which
        would write rows and counters the owner holds and samples; nothing is written, reading stays possible."""
        if os.getpid() != self.pid:
            raise RuntimeError(f"storage_dir: {str(self.path)!r} is owned by pid {self.pid} (which opened it); "
                               f"this process (pid {os.getpid()}) may not write it: open the directory in this "
                               "process after the owner closes it, or send rows to the owner")

    def close(self) -> None:
        """Release the lock (the mappings stay readable while tensors use them). In a process other than the owner only
        that process's copy of the lock's descriptor is closed: the owner's lock is untouched and nothing is flushed."""
        self.lock.release()

    @property
    def closed(self) -> bool:
        """No longer writable from this process: closed, or open in another (the owner)."""
        return self.lock.closed or os.getpid() != self.pid
