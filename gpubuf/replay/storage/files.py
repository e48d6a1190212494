"""Whole-file writes of a ``storage_dir`` that reach the disk: sync a file, write one, replace one atomically.
Every error is the ``OSError`` of the write itself (``EFBIG`` at a file-size limit, ``ENOSPC``), naming the file
where the message is this module's."""

import contextlib
import os
from pathlib import Path


def fsync(path: Path) -> None:
    """Write a file's dirty pages (shared mappings' too) to disk; an error raises ``OSError`` naming the file."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as err:
        raise OSError(err.errno, f"storage_dir: cannot write {path} back to disk ({err.strerror or err})") from err


def write_file(path: Path, data) -> None:
    """Create (or empty) ``path`` and write ``data`` (bytes-like) into it, synced to disk: every error is the
    ``OSError`` of the write (``EFBIG`` at a file-size limit, ``ENOSPC``), not a library's."""
    view = memoryview(data).cast("B")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:])
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path: Path, data, tmp: Path) -> None:
    """``path`` holds ``data`` (synced), whole or as before: written to ``tmp``, then renamed over it; on any
    error ``tmp`` is removed and the error propagates."""
    try:
        write_file(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    with contextlib.suppress(OSError):  # the rename itself on disk (where directories sync)
        fsync(path.parent)
