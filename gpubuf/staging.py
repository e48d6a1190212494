"""Inputs -> device tensors: torch tensors, numpy arrays, ``__dlpack__`` arrays and numeric scalars.

Host data bound for a CUDA buffer goes through :class:`Staging`: a small ring of preallocated pinned
host buffers per key, each followed by one non-blocking copy into a preallocated device buffer. A
pinned slot is reused only after the copy that read it has finished (a CUDA event), so callers may
overwrite their arrays as soon as the call returns and nothing waits on the device in steady state.
"""

import numbers

import numpy as np
import torch

_PY_SCALARS = (bool, int, float, np.bool_, np.number)


def as_tensor(value, name: str) -> torch.Tensor:
    """A torch view of ``value`` (no copy where possible); numeric scalars become 0-d tensors.

    Raises ``TypeError`` naming ``name`` for strings, lists and other non-numeric objects.
    """
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biufc":
            raise TypeError(f"{name}: expected a numeric array, got a numpy array of dtype {value.dtype}")
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, _PY_SCALARS) or (isinstance(value, numbers.Number) and not isinstance(value, complex)):
        if isinstance(value, np.generic):
            return torch.from_numpy(np.asarray(value))
        return torch.tensor(value)
    if hasattr(value, "__dlpack__"):
        try:
            return torch.from_dlpack(value)
        except (RuntimeError, TypeError, BufferError) as err:
            raise TypeError(f"{name}: could not read the __dlpack__ array ({err})") from err
    raise TypeError(
        f"{name}: expected a torch tensor, numpy array, __dlpack__ array or numeric scalar, "
        f"got {type(value).__name__}"
    )


def positive_int(name: str, value) -> int:
    """``value`` as an int >= 1, else ``ValueError`` naming ``name`` (bools and floats are rejected)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return int(value)


def as_index_array(ids, name: str, size: int) -> np.ndarray:
    """Host int64 ids in ``[0, size)``; negatives index from the end as in Python.

    Raises ``TypeError`` for non-integer ids and ``IndexError`` for out-of-range ones.
    """
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()  # reads the device: pass host ids on the hot path
    arr = np.asarray(ids)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu" or arr.ndim != 1:
        raise TypeError(f"{name}: expected a 1-D sequence of ints, got {arr.dtype} array of shape {arr.shape}")
    arr = arr.astype(np.int64, copy=False)
    bad = (arr < -size) | (arr >= size)
    if bad.any():
        raise IndexError(f"{name}: ids must lie in [-{size}, {size}), got {arr[bad][:5].tolist()}")
    return np.where(arr < 0, arr + size, arr)


class Staging:
    """Moves host tensors onto ``device`` through reusable pinned and device buffers, one copy per key.

    Each key has a ring of ``slots`` buffers: the host waits on a slot's previous copy only when it runs
    that many calls ahead of the device, and a returned device tensor stays valid for ``slots - 1`` more
    calls with the same key.
    """

    def __init__(self, device: torch.device, slots: int = 4):
        self.device = device
        self.slots = slots
        self._ring: dict[str, list] = {}  # key -> [next slot, [(pinned, device_buf, event) per slot]]

    def to_device(self, t: torch.Tensor, key: str) -> torch.Tensor:
        """``t`` on ``self.device``: the tensor itself if already there (callers copy it into storage)."""
        if t.device == self.device:
            return t
        if self.device.type != "cuda" or t.device.type != "cpu":
            return t.to(self.device)
        return self._through_pinned(t, key)

    def _through_pinned(self, t: torch.Tensor, key: str) -> torch.Tensor:
        nbytes = t.numel() * t.element_size()
        entry = self._ring.setdefault(key, [0, [None] * self.slots])
        i = entry[0]
        entry[0] = (i + 1) % self.slots
        slot = entry[1][i]
        if slot is None or slot[0].numel() < nbytes:
            pinned = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)
            dev = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
            slot = entry[1][i] = (pinned, dev, torch.cuda.Event())
        pinned, dev, event = slot
        event.synchronize()  # the copy that last read this pinned slot is done
        host = pinned[:nbytes].view(t.dtype).view(t.shape)
        host.copy_(t)
        out = dev[:nbytes].view(t.dtype).view(t.shape)
        out.copy_(host, non_blocking=True)
        event.record()
        return out
