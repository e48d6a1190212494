"""Devices and backends: where a buffer lives, which implementation its ops run, and how a call gets
there.

``GPUBUF_BACKEND=torch|triton`` forces one backend for the buffers built while it is set. Triton
compiles for GPUs only: a host (CPU) tensor goes to a Triton kernel only while Triton's interpreter
is on (``TRITON_INTERPRET=1``), never otherwise, whatever is forced.
"""

import os
from collections.abc import Mapping

import numpy as np
import torch

BACKENDS = ("torch", "triton")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` -> ``cuda`` when available, else ``cpu``; a bare ``cuda`` gets the current index.

    The index matters: tensors report ``cuda:0``, and
    ``torch.device("cuda") != torch.device("cuda:0")``.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device: expected a torch device or its name, got {device!r}") from err
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def allocate(shapes: Mapping[str, tuple], dtypes: Mapping[str, torch.dtype], device) -> dict:
    """Zero-filled tensors for every key, all or none: a failure names the bytes and the device."""
    total = sum(int(np.prod(s)) * torch.empty((), dtype=dtypes[k]).element_size()
                for k, s in shapes.items())
    try:
        return {k: torch.zeros(s, dtype=dtypes[k], device=device) for k, s in shapes.items()}
    except (RuntimeError, torch.OutOfMemoryError) as err:
        raise MemoryError(f"gpubuf: cannot allocate {total} bytes of storage on {device}: "
                          f"{err}") from None


def interpreting() -> bool:
    """Whether Triton's interpreter is on (``TRITON_INTERPRET`` set to 1/true/yes/on): kernels then
    run on host tensors."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


def triton_runs_on(device: torch.device) -> bool:
    """Whether Triton kernels can take tensors on ``device``: CUDA devices, and the host under the
    interpreter."""
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


def backend_for(device: torch.device) -> str:
    """The backend a buffer (or a storage tier) on ``device`` uses. ``GPUBUF_BACKEND`` overrides,
    except that a device Triton cannot run on (host memory without the interpreter) always gets the
    torch twins."""
    forced = os.environ.get("GPUBUF_BACKEND", "").strip()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"GPUBUF_BACKEND: expected one of {BACKENDS}, got {forced!r}")
        return forced if forced == "torch" or triton_runs_on(device) else "torch"
    return "triton" if device.type == "cuda" else "torch"


def route(backend: str, device: torch.device) -> str:
    """How an op call with ``backend`` on ``device`` runs.

    ``"dispatch"`` under ``torch.compile`` when ``backend`` is what the dispatcher registers for
    ``device`` (Triton for CUDA, else torch): the call goes through ``torch.ops.gpubuf`` and Dynamo
    traces the op. Eager calls go straight to an implementation
    (boxing tensor lists through the dispatcher costs more than the work of a small call; README,
    Benchmarks: Host overhead per call): ``"triton"`` (the kernel's launcher) when asked and Triton
    runs on ``device``, else ``"torch"`` (the twin, also for a ``"triton"`` request on a device
    Triton cannot run on).
    """
    if torch.compiler.is_compiling() and backend == ("triton" if device.type == "cuda"
                                                     else "torch"):
        return "dispatch"
    return "triton" if backend == "triton" and triton_runs_on(device) else "torch"


def writes_only(*args) -> None:
    """Fake (meta) implementation of every op: ops write into tensors they are given and return
    nothing."""
