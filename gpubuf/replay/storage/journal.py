"""The row journal of a ``storage_dir`` (``counters.bin``): twelve int64, ``[active slot, dirty, slot 0 (position, rows
held, rows ever written, flushes), slot 1 (likewise), boot id (2 words)]``. A commit writes the inactive slot, then
flips ``active`` with one aligned 8-byte store, so a process killed at any instant leaves one whole slot; ``dirty`` and
the boot id tell an operating-system crash with unflushed writes (:mod:`gpubuf.replay.storage.directory`)."""

import uuid
from pathlib import Path

import numpy as np
import torch

from gpubuf.replay.storage.files import fsync, replace_file

_ACTIVE, _DIRTY, _SLOTS, _BOOT = 0, 1, (2, 6), 10  # word offsets in counters.bin
WORDS = 12
LEGACY_WORDS = 3  # counters.bin of a directory written before the journal
JOURNAL = {"file": "counters.bin", "int64 words": WORDS}  # recorded in gpubuf.json


def boot_id() -> tuple[int, int]:
    """This boot's id as two int64 words ((0, 0) where the OS does not say)."""
    try:
        raw = uuid.UUID(Path("/proc/sys/kernel/random/boot_id").read_text().strip()).bytes
    except (OSError, ValueError):
        return 0, 0
    return tuple(int(v) for v in np.frombuffer(raw, dtype=np.int64))


class Journal:
    """The crash-safe counters of ``counters.bin``: ``(position, rows held, rows ever written, flushes)``.

    ``Journal(file)`` maps an existing journal (anything but ``WORDS`` int64 words raises ``ValueError`` naming
    it); ``Journal(file, words)`` keeps ``words`` in memory until :meth:`write` puts them in ``file`` (a new
    journal, or one converted from the counters of a directory written before the journal)."""

    def __init__(self, file: Path, words: np.ndarray | None = None):
        self.file = file
        self.pending = words is not None
        if words is not None:
            self.words = words
            return
        if not file.is_file() or file.stat().st_size != WORDS * 8:
            size = f"{file.stat().st_size} bytes" if file.is_file() else "missing"
            raise ValueError(f"storage_dir: {file} is missing or is not the row journal ({WORDS} int64 words, "
                             f"{WORDS * 8} bytes; it is {size}); the rows cannot be placed without it")
        self.words = torch.from_file(str(file), shared=True, size=WORDS, dtype=torch.int64).numpy()

    @staticmethod
    def fresh(counters=(0, 0, 0)) -> np.ndarray:
        """The words of a clean journal under this boot: slot 0 holds ``(position, rows held, rows ever written)``."""
        words = np.zeros(WORDS, dtype=np.int64)
        words[_SLOTS[0]:_SLOTS[0] + 3] = counters
        words[_BOOT:_BOOT + 2] = boot_id()
        return words

    def write(self) -> None:
        """Put the in-memory words in the file (atomically, synced), then map it."""
        if self.pending:
            replace_file(self.file, self.words.tobytes(), self.file.with_suffix(".tmp"))
            self.pending = False
            self.words = torch.from_file(str(self.file), shared=True, size=WORDS, dtype=torch.int64).numpy()

    def read(self) -> tuple[int, int, int, int]:
        """The active slot: ``(position, rows held, rows ever written, flushes)``."""
        a = _SLOTS[int(self.words[_ACTIVE])]
        return tuple(int(v) for v in self.words[a:a + 4])

    def commit(self, pos: int, count: int, total: int, flushes: int | None = None) -> None:
        """Write the inactive slot (``flushes``: default, unchanged), then make it active (one aligned 8-byte store)."""
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
        """Before the first write since the last flush: say so on disk (synced) with this boot's id."""
        if not self.words[_DIRTY]:
            self.words[_BOOT:_BOOT + 2] = boot_id()
            self.words[_DIRTY] = 1
            fsync(self.file)

    def mark_clean(self) -> None:
        """After every file was synced: nothing unflushed."""
        self.words[_DIRTY] = 0
        fsync(self.file)

    def check(self, M: int) -> None:
        """Raise unless the words describe a ring of ``M`` rows per env."""
        active, dirty = int(self.words[_ACTIVE]), int(self.words[_DIRTY])
        if active not in (0, 1) or dirty not in (0, 1):
            raise ValueError(f"storage_dir: counters in {self.file} (active slot {active}, dirty {dirty}) are not "
                             "a row journal's")
        pos, count, total, flushes = self.read()
        if not (0 <= count <= M and 0 <= pos < M and total >= count and flushes >= 0):
            raise ValueError(f"storage_dir: counters in {self.file} (position {pos}, rows {count}, total {total}, "
                             f"flushes {flushes}) do not fit a buffer of {M} rows per env")

    def crashed_since_flush(self) -> bool:
        """Dirty, and written under another boot: the OS went down with unflushed writes."""
        here = boot_id()
        return self.dirty and here != (0, 0) and tuple(int(v) for v in self.words[_BOOT:_BOOT + 2]) != here
