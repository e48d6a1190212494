"""The one-writer lock of a ``storage_dir``: an exclusive ``flock`` on ``<dir>/lock``, which names its holder.

At a fork the child's copy of each lock descriptor is closed (``os.register_at_fork``): the owner's ``flock`` is
unaffected (it belongs to the owner's open file), and a child neither keeps the directory locked after the owner
closes it nor blocks itself from opening it then."""

import contextlib
import fcntl
import os
import socket
import weakref
from pathlib import Path

# every DirLock held in this process, whose inherited descriptors a forked child closes
_HELD_LOCKS: "weakref.WeakSet[DirLock]" = weakref.WeakSet()


def _close_inherited_locks() -> None:
    """In a forked child: close the child's copies of the lock descriptors (module docstring)."""
    for lock in list(_HELD_LOCKS):
        with contextlib.suppress(OSError, ValueError):
            lock.file.close()
    _HELD_LOCKS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_inherited_locks)


class DirLock:
    """An exclusive ``flock`` on ``<path>/lock`` held while this object lives (or until :meth:`release`) by the
    process that took it (a forked child's copy is closed at the fork).

    ``created``: whether the lock file was made here (a failed open removes only such a file). The holder's pid
    and host are written into it by :meth:`claim`, once the directory opened, so that a refused open leaves the
    file as it was."""

    def __init__(self, path: Path):
        self.created = not os.path.lexists(path / "lock")
        self.file = open(path / "lock", "a+")  # noqa: SIM115 - held for the buffer's life
        try:
            fcntl.flock(self.file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.file.seek(0)
            holder = self.file.read().strip() or "another process"
            self.file.close()
            raise ValueError(f"storage_dir: {str(path)!r} is open for writing by {holder}; one buffer at a time "
                             "may hold a directory (close() it, or let its process end)") from None
        _HELD_LOCKS.add(self)

    @property
    def closed(self) -> bool:
        """Released, or closed at a fork."""
        return self.file.closed

    def claim(self) -> None:
        """Write this process (pid, host) into the lock file, for the error of a second opener."""
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        self.file.flush()

    def release(self) -> None:
        """Close this process's descriptor: the owner's close drops the flock (a forked child's closed at the fork)."""
        _HELD_LOCKS.discard(self)
        if not self.file.closed:
            self.file.close()  # closing the descriptor drops the flock
