"""Streaming, atomic checkpoints of any gpubuf buffer: ``save(buffer, path)`` / ``load(buffer, path)``.

File layout: an 16-byte magic, then each tensor of the buffer's ``state_dict()`` as raw bytes (64-byte aligned), then a
JSON header (the state with every tensor replaced by ``{"__tensor__": i}``, and per tensor its dtype, shape, offset,
size and CRC-32), then a 40-byte footer (header offset, length and CRC-32, magic).

- Saving streams each tensor in chunks of at most ``CHUNK_BYTES`` (16 MiB): CPU storage is written from its own memory
  (the transposed views of env-major ``storage_dir`` files in row-major copies of whole leading rows), CUDA storage
  through one pinned host chunk. Extra memory is bounded by one chunk (or one leading row), never a clone of the
  storage. The file is written beside ``path`` under a temporary name, flushed to disk and renamed over ``path`` (atomic
  on POSIX): a crash mid-save leaves the previous checkpoint intact (and at worst a stale ``<name>.*.partial`` file).
  The new file gets the mode of the file it replaces, or ``0o666`` less the umask (as ``open`` would create it).
- Loading checks the whole file first (magic, header CRC, sizes, every tensor's CRC, reading chunk by chunk), then hands
  the buffer's ``load_state_dict`` a state of file-backed tensors, which validates configuration, keys, shapes, dtypes
  and counters before its first write and then streams the bytes into storage on any device.
"""

import json
import os
import struct
import tempfile
import zlib

import torch

from gpubuf._core.state import CHUNK_BYTES, chunks

MAGIC = b"GPUBUF-CKPT-v1\x00\n"
_FOOTER = struct.Struct("<QQI4x16s")  # header offset, header length, header CRC-32, magic
_ALIGN = 64


class Checkpointable:
    """``save(path)`` / ``load(path)`` for a buffer with ``state_dict()`` / ``load_state_dict()``."""

    def save(self, path) -> None:
        """Write a checkpoint to ``path`` atomically, streaming storage in bounded chunks
        (:func:`save`); other threads' calls wait until it is written (it holds ``self.lock``)."""
        with self.lock:
            save(self, path)

    def load(self, path) -> None:
        """Restore a checkpoint written by :meth:`save` (saved on any device); the file is verified
        and the state validated before the first write (:func:`load`)."""
        load(self, path)


class CheckpointError(ValueError):
    """A checkpoint file that is not one, is truncated, or fails its checksums."""


class FileTensor:
    """A tensor stored in an open checkpoint file: ``shape``, ``dtype``, and streaming reads."""

    def __init__(self, fd: int, offset: int, shape: tuple, dtype: torch.dtype):
        self.fd, self.offset, self.shape, self.dtype = fd, offset, torch.Size(shape), dtype
        self.nbytes = self.shape.numel() * torch.empty((), dtype=dtype).element_size()

    def read_into(self, dst: torch.Tensor, chunk: int = CHUNK_BYTES) -> None:
        """``dst`` (this shape and dtype, any device; strided only on the host) = the stored bytes,
        one chunk at a time."""
        # a strided host view (an env-major file seen time-major): whole leading rows
        if not dst.is_contiguous():
            row = self.nbytes // self.shape[0]
            rows = max(1, chunk // max(row, 1))
            host = torch.empty((min(rows, self.shape[0]), *self.shape[1:]), dtype=self.dtype)
            for a in range(0, self.shape[0], rows):
                part = host[:min(rows, self.shape[0] - a)]
                self._read(part.view(-1).view(torch.uint8).numpy(), a * row)
                dst[a:a + part.shape[0]].copy_(part)
            return
        flat = dst.view(-1).view(torch.uint8) if dst.numel() else dst.new_empty(0, dtype=torch.uint8)
        if dst.device.type == "cpu":
            view = flat.numpy()
            for a in range(0, self.nbytes, chunk):
                self._read(view[a:a + chunk], a)
            return
        host = torch.empty(min(chunk, self.nbytes), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        for a in range(0, self.nbytes, chunk):
            n = min(chunk, self.nbytes - a)
            self._read(host[:n].numpy(), a)
            flat[a:a + n].copy_(host[:n])

    def chunks(self, chunk: int = CHUNK_BYTES):
        """Flat CPU tensors of whole elements, at most ``chunk`` bytes each, in order. They are views of one reused host
        buffer: each piece is overwritten by the next (copy it to keep it)."""
        size = torch.empty((), dtype=self.dtype).element_size()
        step = max(size, chunk // size * size)
        host = torch.empty(min(step, self.nbytes), dtype=torch.uint8)
        for a in range(0, self.nbytes, step):
            piece = host[:min(step, self.nbytes - a)]
            self._read(piece.numpy(), a)
            yield piece.view(self.dtype)

    def _read(self, view, at: int) -> None:
        got = 0
        while got < len(view):
            n = os.preadv(self.fd, [view[got:]], self.offset + at + got)
            if n <= 0:
                raise CheckpointError(f"checkpoint: file ended while reading a tensor at byte {self.offset + at}")
            got += n


def save(buffer, path, chunk: int = CHUNK_BYTES) -> None:
    """Write ``buffer.state_dict()`` to ``path`` atomically, streaming storage in chunks of ``chunk`` bytes."""
    path = os.fspath(path)
    tensors: list[torch.Tensor] = []
    skeleton = _strip(buffer.state_dict(), tensors)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".partial", dir=folder)
    try:
        os.fchmod(fd, _mode_for(path))
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC)
            metas = []
            for t in tensors:
                f.write(b"\0" * (-f.tell() % _ALIGN))
                offset = f.tell()
                crc = _write_tensor(f, t, chunk)
                metas.append({"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                              "offset": offset, "nbytes": f.tell() - offset, "crc32": crc})
            header = json.dumps({"state": skeleton, "tensors": metas}).encode()
            at = f.tell()
            f.write(header)
            f.write(_FOOTER.pack(at, len(header), zlib.crc32(header), MAGIC))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(err, OSError) and err.filename is None:  # a write error names no file
            raise OSError(err.errno, f"checkpoint: cannot write {path!r} ({err.strerror})", path) from err
        raise
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself reaches the disk
    finally:
        os.close(dir_fd)


def load(buffer, path, chunk: int = CHUNK_BYTES) -> None:
    """Restore ``buffer`` from a :func:`save` file, onto the buffer's device; nothing is written unless the whole file
    checks out and its state fits the buffer (``load_state_dict`` validates it)."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        fd = f.fileno()
        state = _read_checked(fd, os.fstat(fd).st_size, path, chunk)
        buffer.load_state_dict(state)


def _mode_for(path: str) -> int:
    """The permission bits of the file at ``path``, or ``0o666`` less the process umask for a new file."""
    try:
        return os.stat(path).st_mode & 0o777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _strip(value, tensors: list):
    """The state as JSON: every tensor becomes ``{"__tensor__": i}`` (appended to ``tensors``) and every dict
    ``{"__dict__": [[key, value], ...]}``, so no key of the state (a user's key may be ``"__tensor__"``) can be mistaken
    for a placeholder, and keys keep their type."""
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach())
        return {"__tensor__": len(tensors) - 1}
    if isinstance(value, dict):
        return {"__dict__": [[k, _strip(v, tensors)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return [_strip(v, tensors) for v in value]
    return value


def _write_tensor(f, t: torch.Tensor, chunk: int) -> int:
    """Write ``t``'s bytes (row-major) to ``f`` in chunks; returns their CRC-32."""
    crc = 0
    # views of contiguous memory; bounded copies of a strided view (env-major files)
    if t.device.type == "cpu":
        for piece in chunks(t, chunk):
            view = piece.view(torch.uint8).numpy()
            f.write(view)
            crc = zlib.crc32(view, crc)
        return crc
    flat = t.contiguous().reshape(-1)
    flat = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
    host = torch.empty(min(chunk, flat.numel()), dtype=torch.uint8, pin_memory=True)
    for a in range(0, flat.numel(), chunk):
        n = min(chunk, flat.numel() - a)
        host[:n].copy_(flat[a:a + n])
        piece = host[:n].numpy()
        f.write(piece)
        crc = zlib.crc32(piece, crc)
    return crc


def _read_checked(fd: int, size: int, path: str, chunk: int) -> dict:
    """The file's state with file-backed tensors, after checking magic, header, bounds and every CRC."""
    def fail(why):
        raise CheckpointError(f"{path}: not a complete gpubuf checkpoint ({why})")

    if size < len(MAGIC) + _FOOTER.size or os.pread(fd, len(MAGIC), 0) != MAGIC:
        fail("no gpubuf magic at the start")
    at, length, header_crc, magic = _FOOTER.unpack(os.pread(fd, _FOOTER.size, size - _FOOTER.size))
    if magic != MAGIC or at + length != size - _FOOTER.size:
        fail("no footer: the file was cut short or not written by gpubuf")
    raw = os.pread(fd, length, at)
    if zlib.crc32(raw) != header_crc:
        fail("the header fails its CRC-32")
    try:
        header = json.loads(raw)
        metas, skeleton = header["tensors"], header["state"]
        files = []
        for i, m in enumerate(metas):
            dtype = getattr(torch, m["dtype"])
            if not isinstance(dtype, torch.dtype):
                fail(f"tensor {i} has dtype {m['dtype']!r}")
            t = FileTensor(fd, int(m["offset"]), tuple(m["shape"]), dtype)
            if t.nbytes != m["nbytes"] or t.offset < len(MAGIC) or t.offset + t.nbytes > at:
                fail(f"tensor {i} lies outside the data section")
            files.append((t, int(m["crc32"])))
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        if isinstance(err, CheckpointError):
            raise
        fail(f"unreadable header: {err}")
    for i, (t, crc) in enumerate(files):
        got = 0
        for piece in t.chunks(chunk):
            got = zlib.crc32(piece.view(torch.uint8).numpy(), got)
        if got != crc:
            fail(f"tensor {i} fails its CRC-32")
    try:
        return _fill(skeleton, [t for t, _ in files])
    except (IndexError, TypeError, ValueError) as err:
        fail(f"the header refers to a tensor it does not list ({err})")


def _fill(value, tensors: list):
    if isinstance(value, dict):
        if set(value) == {"__tensor__"}:
            i = value["__tensor__"]
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(tensors):
                raise IndexError(f"tensor {i!r} of {len(tensors)}")
            return tensors[i]
        if set(value) == {"__dict__"}:
            return {k: _fill(v, tensors) for k, v in value["__dict__"]}
        raise TypeError(f"an object that is neither a tensor nor a dict: {sorted(value)!r:.80}")
    if isinstance(value, list):
        return [_fill(v, tensors) for v in value]
    return value
