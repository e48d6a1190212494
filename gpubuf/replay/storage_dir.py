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

Damage is refused, never re-created over or guessed at (``ValueError`` naming the file; a refused
open changes nothing in the directory, its lock file included):

- a directory holding a buffer's files (``leaf<i>.bin``, ``counters.bin``, ``state.pt`` or their
  temporary files) but no ``gpubuf.json`` (lost, or a creation cut short); an empty or missing
  directory is created as a new buffer;
- a ``counters.bin`` that is not the journal: 24 bytes are the three counters of a directory
  written before the journal (``position, rows held, rows ever written``) only where they fit the
  ring as that format kept it (a ring not yet full holds rows ``0 .. position - 1``), the
  ``gpubuf.json`` is not one of the journal's (which records it) and no ``state.pt`` was saved by a
  flush of the journal (which numbers it); such a directory is converted when it opens;
- a ``state.pt`` that cannot be read (truncated at any byte, not a flush's file) or restored.

A flush that cannot write ``state.pt`` (a full disk; the file-size limit ``RLIMIT_FSIZE``, reached
with ``SIGXFSZ`` ignored: otherwise the OS ends the process, as for any write) raises ``OSError``
naming it and the cause; the temporary file is removed, the previous ``state.pt`` and the journal
are untouched and the buffer is as before, so a later flush can succeed.

One process writes: the one that opened the directory (its *owner*). A process forked from it
inherits the mappings and the lock's descriptor; :meth:`StorageDir.check_writer` refuses it every
write (``RuntimeError`` naming the directory and both pids), and :attr:`StorageDir.closed` is true
there, so a buffer's ``close()`` in the child does nothing. At the fork the child's copy of each
lock descriptor is closed (``os.register_at_fork``): the owner's ``flock`` is unaffected (it
belongs to the owner's open file), a child neither keeps the directory locked after the owner
closes it nor blocks itself from opening it then. Reading (sampling) in the child stays possible:
the mapping is shared, and the owner's later writes show through it.
"""

import contextlib
import fcntl
import io
import json
import mmap
import os
import pickle
import re
import shutil
import socket
import uuid
import warnings
import weakref
from pathlib import Path

import numpy as np
import torch

from gpubuf._core.state import check_range
from gpubuf.replay.tiers import advise

LAYOUT = "env-major"  # of the leaf files: recorded in the configuration, checked on re-opening
RESERVED = ("gpubuf.json", "counters.bin", "state.pt", "lock")
_ACTIVE, _DIRTY, _SLOTS, _BOOT = 0, 1, (2, 6), 10  # word offsets in counters.bin
_WORDS = 12
_LEGACY_WORDS = 3  # counters.bin of a directory written before the journal
JOURNAL = {"file": "counters.bin", "int64 words": _WORDS}  # recorded in gpubuf.json
LEAF_FILE = re.compile(r"leaf[0-9]+\.bin")  # the only names a leaf file may have
# a buffer's files besides its leaves: any of them without gpubuf.json is a damaged directory
LEFTOVERS = ("counters.bin", "state.pt", "counters.tmp", "state.pt.tmp", "gpubuf.tmp")


def _boot_id() -> tuple[int, int]:
    """This boot's id as two int64 words ((0, 0) where the OS does not say)."""
    try:
        raw = uuid.UUID(Path("/proc/sys/kernel/random/boot_id").read_text().strip()).bytes
    except (OSError, ValueError):
        return 0, 0
    return tuple(int(v) for v in np.frombuffer(raw, dtype=np.int64))


def _fsync(path: Path) -> None:
    """Write a file's dirty pages (those dirtied through shared mappings too) to disk; an error
    raises ``OSError`` naming the file."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as err:
        raise OSError(err.errno, f"storage_dir: cannot write {path} back to disk "
                                 f"({err.strerror or err})") from err


def _write_file(path: Path, data) -> None:
    """Create (or empty) ``path`` and write ``data`` (bytes-like) into it, synced to disk: every
    error is the ``OSError`` of the write (``EFBIG`` at a file-size limit, ``ENOSPC``), not a
    library's."""
    view = memoryview(data).cast("B")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:])
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_file(path: Path, data, tmp: Path) -> None:
    """``path`` holds ``data`` (synced), whole or as before: written to ``tmp``, then renamed over
    it; on any error ``tmp`` is removed and the error propagates."""
    try:
        _write_file(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    with contextlib.suppress(OSError):  # the rename itself on disk (where directories sync)
        _fsync(path.parent)


# every DirLock held in this process, whose inherited descriptors a forked child closes
_HELD_LOCKS: "weakref.WeakSet[DirLock]" = weakref.WeakSet()


def _close_inherited_locks() -> None:
    """In a forked child: close the child's copies of the lock descriptors. The owner's ``flock``
    stays (it belongs to the open file the owner still holds); the child no longer keeps it
    alive after the owner closes, nor conflicts with its own later open of the directory."""
    for lock in list(_HELD_LOCKS):
        with contextlib.suppress(OSError, ValueError):
            lock.file.close()
    _HELD_LOCKS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_inherited_locks)


class DirLock:
    """An exclusive ``flock`` on ``<path>/lock`` held while this object lives (or until
    :meth:`release`) by the process that took it (a forked child's copy is closed at the fork).

    ``created``: whether the lock file was made here (a failed open removes only such a file).
    The holder's pid and host are written into it by :meth:`claim`, once the directory opened, so
    that a refused open leaves the file as it was."""

    def __init__(self, path: Path):
        self.created = not os.path.lexists(path / "lock")
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
        _HELD_LOCKS.add(self)

    def claim(self) -> None:
        """Write this process (pid, host) into the lock file, for the error of a second opener."""
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        self.file.flush()

    def release(self) -> None:
        """Close this process's descriptor: the owner's close drops the flock; a forked child's
        (already closed at the fork) leaves the owner's lock held."""
        _HELD_LOCKS.discard(self)
        if not self.file.closed:
            self.file.close()  # closing the descriptor drops the flock


class Journal:
    """The crash-safe counters of ``counters.bin``:
    ``(position, rows held, rows ever written, flushes)``.

    ``Journal(file)`` maps an existing journal (anything but ``_WORDS`` int64 words raises
    ``ValueError`` naming it); ``Journal(file, words)`` keeps ``words`` in memory until
    :meth:`write` puts them in ``file`` (a new journal, or one converted from the counters of a
    directory written before the journal)."""

    def __init__(self, file: Path, words: np.ndarray | None = None):
        self.file = file
        self.pending = words is not None
        if words is not None:
            self.words = words
            return
        if not file.is_file() or file.stat().st_size != _WORDS * 8:
            size = f"{file.stat().st_size} bytes" if file.is_file() else "missing"
            raise ValueError(f"storage_dir: {file} is missing or is not the row journal ({_WORDS} "
                             f"int64 words, {_WORDS * 8} bytes; it is {size}); the rows cannot be "
                             "placed without it")
        self.words = torch.from_file(str(file), shared=True, size=_WORDS, dtype=torch.int64).numpy()

    @staticmethod
    def fresh(counters=(0, 0, 0)) -> np.ndarray:
        """The words of a clean journal whose slot 0 holds ``(position, rows held, rows ever
        written)``, no flush counted, under this boot."""
        words = np.zeros(_WORDS, dtype=np.int64)
        words[_SLOTS[0]:_SLOTS[0] + 3] = counters
        words[_BOOT:_BOOT + 2] = _boot_id()
        return words

    def write(self) -> None:
        """Put the in-memory words in the file (atomically, synced), then map it."""
        if self.pending:
            _replace_file(self.file, self.words.tobytes(), self.file.with_suffix(".tmp"))
            self.pending = False
            self.words = torch.from_file(str(self.file), shared=True, size=_WORDS,
                                         dtype=torch.int64).numpy()

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
    any error releases it and leaves the directory as it was: for a new directory, what was created
    is removed (the lock file too, where it was made here); a damaged one (module docstring) raises
    ``ValueError`` naming the file, with nothing written. Once the buffer restored what it holds,
    :meth:`claim` names this process in the lock file (and converts a journal of the earlier
    format).

    ``pid``: the process that opened it, the only one that may write it (:meth:`check_writer`).
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
        leaves = {name: {"shape": list(shapes[name]), "dtype": str(dtypes[name]),
                         "file": f"leaf{i}.bin"}
                  for i, name in enumerate(shapes)}
        meta = {"config": {**config, "layout": LAYOUT}, "leaves": leaves, "journal": JOURNAL}
        meta_file = self.path / self.META
        self.reopened = os.path.lexists(meta_file)
        sizes = {name: max(int(np.prod(shape)),
                           1) * torch.empty((), dtype=dtypes[name]).element_size()
                 for name, shape in shapes.items()}  # a file is never empty
        if self.reopened:
            stored = self._check_meta(meta_file, meta)
            leaves = stored["leaves"]  # the stored file of each leaf, whatever the key order
        else:
            self._check_no_buffer_files()
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
        counters = self.path / self.COUNTERS
        if not self.reopened:
            created.append(counters)
            self.journal = Journal(counters, Journal.fresh())
            self.journal.write()
            # written last: a directory without it is not a buffer yet
            _replace_file(meta_file, json.dumps(meta, indent=1).encode(),
                          meta_file.with_suffix(".tmp"))
        elif counters.is_file() and counters.stat().st_size == _LEGACY_WORDS * 8:
            M = next(iter(shapes.values()))[1]  # (E, M, *shape)
            # converted by claim(), once the buffer opened
            self.journal = Journal(counters, Journal.fresh(self._legacy_counters(stored, M)))
        else:
            self.journal = Journal(counters)

    def _check_no_buffer_files(self) -> None:
        """Raise if the directory, which holds no ``gpubuf.json``, holds a buffer's files: it is
        never created over."""
        found = sorted(p.name for p in self.path.iterdir()
                       if LEAF_FILE.fullmatch(p.name) or p.name in LEFTOVERS)
        if found:
            shown = ", ".join(found[:6]) + (", ..." if len(found) > 6 else "")
            raise ValueError(f"storage_dir: {str(self.path)!r} holds a buffer's files ({shown}) "
                             f"but no {self.META}, which describes them (lost, or a creation cut "
                             "short): it cannot be re-opened, and a new buffer is not created "
                             f"over it (nothing in it was changed); restore its {self.META}, or "
                             "remove the directory to create a new buffer there")

    def _legacy_counters(self, stored: dict, M: int) -> tuple[int, int, int]:
        """The three counters ``(position, rows held, rows ever written)`` of a ``counters.bin`` of
        24 bytes, taken as the format written before the journal only where they are one
        (module docstring); else ``ValueError`` naming it."""
        file = self.path / self.COUNTERS
        pos, count, total = (int(v) for v in np.fromfile(file, dtype=np.int64))
        why = None
        if "journal" in stored:
            why = (f"{self.META} was written with the {_WORDS}-word journal, so this is not the "
                   "earlier format")
        elif not (0 <= pos < M and 0 <= count <= M and total >= count
                  and (count == M or pos == count == total)):
            why = (f"as that format (position {pos}, rows held {count}, rows ever written "
                   f"{total}) they are not a ring of {M} rows per env: one not yet full holds rows "
                   "0 .. position - 1, every row written")
        else:
            state = self.load_state()
            if isinstance(state, dict) and "flush" in state:
                why = (f"{self.STATE} was saved by flush {state['flush']!r} of the journal, so "
                       "this is not the earlier format")
        if why is not None:
            raise ValueError(f"storage_dir: {file} holds {_LEGACY_WORDS * 8} bytes, the three "
                             "counters of a directory written before the row journal, but "
                             f"{why}: it is a damaged (cut short?) row journal ({_WORDS} int64 "
                             "words); the rows cannot be placed without it")
        return pos, count, total

    def claim(self) -> None:
        """The buffer opened: convert a journal of the earlier format (its file is written here,
        not before) and name this process in the lock file."""
        self.journal.write()
        self.lock.claim()

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
        stored description, its leaves each in a file of its own (a plain name inside the
        directory, distinct from the bookkeeping files)."""
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
        if "journal" in stored and stored["journal"] != JOURNAL:
            raise ValueError(f"storage_dir: {meta_file} describes the row journal as "
                             f"{stored['journal']!r}, not {JOURNAL!r}")
        self._check_distinct([self.path / f for f in owners] + [self.path / self.COUNTERS])
        return stored

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
            if state is not None:  # a dict (load_state)
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
        state = self.load_state()
        try:
            restore(state)
        except (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError,
                OverflowError, EOFError, pickle.UnpicklingError) as err:
            raise ValueError(f"storage_dir: {self.path / self.STATE} cannot be restored "
                             f"({type(err).__name__}: {err})") from None

    def save_state(self, state: dict, counters: tuple[int, int, int]) -> None:
        """Write ``state`` (tensors and plain values) with the next flush number to ``state.pt``
        atomically, commit ``counters`` with that number, write every file back to disk, then mark
        the journal clean.

        ``state.pt`` is serialized in memory, then written with plain writes and renamed into
        place: one that cannot be written (a full disk, a file-size limit) raises ``OSError`` naming
        it and the cause, its temporary file removed, before anything else changed (the previous
        ``state.pt`` and the journal as they were, so a later flush may succeed)."""
        flush = self.journal.read()[3] + 1
        file = self.path / self.STATE
        data = io.BytesIO()
        torch.save({**state, "flush": flush}, data)
        try:
            _replace_file(file, data.getbuffer(), self.path / (self.STATE + ".tmp"))
        except OSError as err:
            raise OSError(err.errno, f"storage_dir: cannot write {file} "
                                     f"({err.strerror or err}); the flush changed nothing (the "
                                     f"previous {self.STATE} and the row journal are kept); once "
                                     "there is room (disk space, the file-size limit), flush() "
                                     "again") from err
        self.journal.commit(*counters, flush)
        for part in self.path.iterdir():
            if part.suffix in (".bin", ".pt"):
                _fsync(part)  # also writes back pages dirtied through the shared mappings
        self.journal.mark_clean()

    def load_state(self) -> dict | None:
        """What the last :meth:`save_state` wrote, or None (no file); a file that cannot be read
        (truncated, not one torch saved with plain values) or holds no dict raises ``ValueError``
        naming it."""
        file = self.path / self.STATE
        if not os.path.lexists(file):
            return None
        try:
            state = torch.load(file, weights_only=True)
        except MemoryError:
            raise
        except Exception as err:  # whatever torch raises on a damaged file
            first = str(err).strip().splitlines()[0] if str(err).strip() else "no message"
            raise ValueError(f"storage_dir: {file} cannot be restored: it cannot be read as a "
                             f"flush's state ({type(err).__name__}: {first})") from None
        if not isinstance(state, dict):
            raise ValueError(f"storage_dir: {file} cannot be restored (ValueError: expected the "
                             f"dict a flush saves, got {type(state).__name__})")
        return state

    # ------------------------------------------------------------------ the writing process

    def check_writer(self) -> None:
        """Raise ``RuntimeError`` in a process other than the one that opened the directory (a
        forked child): it would write rows and counters the owner holds and samples. Nothing is
        written; reading stays possible (module docstring)."""
        if os.getpid() != self.pid:
            raise RuntimeError(f"storage_dir: {str(self.path)!r} is owned by pid {self.pid} (which "
                               f"opened it); this process (pid {os.getpid()}) may not write it: "
                               "open the directory in this process after the owner closes it, or "
                               "send rows to the owner")

    def close(self) -> None:
        """Release the lock (the mappings stay readable while tensors use them). In a process other
        than the owner only that process's copy of the lock's descriptor is closed: the owner's
        lock is untouched and nothing is flushed."""
        self.lock.release()

    @property
    def closed(self) -> bool:
        """No longer writable from this process: closed, or open in another (the owner)."""
        return self.lock.file.closed or os.getpid() != self.pid
