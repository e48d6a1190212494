"""Devices and backends: where a buffer lives and which backend its ops run (per call: :mod:`gpubuf.ops.backends`).

``GPUBUF_BACKEND=torch|triton`` forces one backend for the buffers built while it is set. Triton compiles for GPUs only:
a host (CPU) tensor goes to a Triton kernel only while Triton's interpreter is on (``TRITON_INTERPRET=1``), whatever is
forced.
"""

import functools
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping

import numpy as np
import torch

from gpubuf._core.devices import parse_device

BACKENDS = ("torch", "triton")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device ``device`` names, checked usable here, else ``ValueError`` naming ``device``.

    ``None`` -> ``cuda`` when available, else ``cpu``; a bare ``cuda`` gets the current index (the index matters:
    tensors report ``cuda:0``, and ``torch.device("cuda") != torch.device("cuda:0")``); ``cpu:0`` is ``cpu``
    (tensors report ``cpu``, and ``torch.device("cpu:0") != torch.device("cpu")``). Refused: CUDA on a machine
    without it, a CUDA index past the devices present, ``meta`` (its tensors hold no data), another CPU index, and
    any other device no tensor can be created on.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    resolved = parse_device(device)
    kind, index = resolved.type, resolved.index
    if kind == "cpu":
        if index not in (None, 0):
            raise ValueError(f"device: the host is one device, 'cpu' (or 'cpu:0'), got {device!r}")
        return _CPU
    if kind == "meta":
        raise ValueError(f"device: meta tensors hold no data; expected a device that stores them "
                         f"(cpu, cuda), got {device!r}")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: CUDA is not available on this machine, got {device!r}")
        count = torch.cuda.device_count()
        index = torch.cuda.current_device() if index is None else index
        if not 0 <= index < count:
            raise ValueError(f"device: {device!r} does not exist; this machine has {count} CUDA "
                             f"device(s), cuda:0 to cuda:{count - 1}")
        return torch.device("cuda", index)
    try:  # another backend (mps, xpu...): usable where a tensor can be created
        torch.empty(0, device=resolved)
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as err:
        why = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"device: cannot create tensors on {device!r} ({why})") from None
    return resolved


_CPU = torch.device("cpu")


# ---- memory: what a call may ask for, and how its failure reads


@functools.lru_cache(maxsize=16)  # one entry per device used (resolve_device checks them)
def capacity(device: torch.device) -> int | None:
    """The bytes ``device`` has in all: a GPU's total memory; the host's physical memory plus swap
    (what Linux's default overcommit lets one allocation reach); ``None`` where unknown."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    if device.type != "cpu":
        return None
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None
    try:
        with open("/proc/meminfo") as f:
            swap = next((int(line.split()[1]) * 1024 for line in f if line.startswith("SwapTotal:")), 0)
    except (OSError, ValueError, IndexError):
        swap = 0
    return int(total) + swap


def check_fits(name: str, what, nbytes: int, device: torch.device) -> None:
    """Raise ``MemoryError`` naming ``name`` when a call needs ``nbytes`` bytes on ``device``, more than it has in all
    (:func:`capacity`): such a request is refused before anything runs. ``what()`` says what the call needs (``"get(n=9)
    needs 123 bytes of output on cpu"``; a callable, so that a call that fits formats nothing)."""
    total = capacity(device)
    if total is not None and nbytes > total:
        raise MemoryError(f"{name}: {what()}, more than the {total} bytes {device} has in all")


def allocation_failed(err: BaseException) -> bool:
    """Whether ``err`` is an allocator's failure (torch's on the host or a GPU, pinned memory, numpy's)."""
    if isinstance(err, (MemoryError, torch.OutOfMemoryError)):
        return True
    if not isinstance(err, RuntimeError):
        return False
    text = str(err).lower()
    return any(s in text for s in ("out of memory", "can't allocate memory", "not enough memory",
                                   "cannot allocate memory", "failed to allocate"))


def memory_error(name: str, what, err: BaseException) -> MemoryError:
    """The ``MemoryError`` naming ``name`` for a call (``what()`` it needs, as for
    :func:`check_fits`) whose allocation failed with ``err``."""
    why = str(err).splitlines()[0] if str(err) else type(err).__name__
    return MemoryError(f"{name}: {what()}, which cannot be allocated ({why})")


class LRU:
    """At most ``size`` cached values, the least recently used dropped first (every cache keyed by values a caller picks
    is one, so none grows with them). ``get(key, make, *args)`` returns ``key``'s value, else caches and returns
    ``make(*args)`` (a ``make`` that raises caches nothing). Thread-safe."""

    def __init__(self, size: int):
        self.size = size
        self._entries: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key, make, *args):
        entries = self._entries
        with self._lock:
            value = entries.get(key, _MISSING)
            if value is not _MISSING:
                entries.move_to_end(key)
                return value
        value = make(*args)  # outside the lock: another thread may build the same value meanwhile
        with self._lock:
            entries[key] = value
            while len(entries) > self.size:
                entries.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._entries)

    def values(self) -> list:
        with self._lock:
            return list(self._entries.values())

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


_MISSING = object()


def allocate(shapes: Mapping[str, tuple], dtypes: Mapping[str, torch.dtype], device) -> dict:
    """Zero-filled tensors for every key, all or none: a failure names the bytes and the device."""
    total = sum(int(np.prod(s)) * torch.empty((), dtype=dtypes[k]).element_size() for k, s in shapes.items())
    try:
        return {k: torch.zeros(s, dtype=dtypes[k], device=device) for k, s in shapes.items()}
    except (RuntimeError, torch.OutOfMemoryError) as err:
        raise MemoryError(f"gpubuf: cannot allocate {total} bytes of storage on {device}: {err}") from None


def interpreting() -> bool:
    """Whether Triton's interpreter is on (``TRITON_INTERPRET`` 1/true/yes/on): kernels then run on host tensors."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


def triton_runs_on(device: torch.device) -> bool:
    """Whether Triton kernels can take tensors on ``device``: CUDA devices, and the host under the interpreter."""
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


def backend_for(device: torch.device) -> str:
    """The backend a buffer (or a storage tier) on ``device`` uses. ``GPUBUF_BACKEND`` overrides, except that a device
    Triton cannot run on (host memory without the interpreter) always gets the torch twins."""
    forced = os.environ.get("GPUBUF_BACKEND", "").strip()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"GPUBUF_BACKEND: expected one of {BACKENDS}, got {forced!r}")
        return forced if forced == "torch" or triton_runs_on(device) else "torch"
    return "triton" if device.type == "cuda" else "torch"


def writes_only(*args) -> None:
    """Fake (meta) implementation of every op: ops write into tensors they are given and return nothing."""


def capture_graph(fn, warmup: int = 3) -> tuple:
    """``(graph, result)``: ``fn()`` captured in a ``torch.cuda.CUDAGraph`` after ``warmup`` calls on a side stream
    (where Triton compiles and allocators settle); ``graph.replay()`` reruns it into ``result``'s tensors."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result
