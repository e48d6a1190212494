"""One function per device operation, dispatching to the Triton kernel or its pure-torch twin.

The backend is chosen once per buffer: ``GPUBUF_BACKEND=torch|triton`` forces one, else CUDA tensors
use Triton and everything else uses :mod:`gpubuf.reference`. Triton is imported only when used, so
``import gpubuf`` works without a GPU or driver (set ``TRITON_INTERPRET=1`` to run kernels on CPU).
"""

import importlib
import os
from collections.abc import Mapping

import numpy as np
import torch

from gpubuf import reference

BACKENDS = ("torch", "triton")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` -> ``cuda`` when available, else ``cpu``; a bare ``cuda`` gets the current index.

    The index matters: tensors report ``cuda:0``, and ``torch.device("cuda") != torch.device("cuda:0")``.
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
    total = sum(int(np.prod(s)) * torch.empty((), dtype=dtypes[k]).element_size() for k, s in shapes.items())
    try:
        return {k: torch.zeros(s, dtype=dtypes[k], device=device) for k, s in shapes.items()}
    except (RuntimeError, torch.OutOfMemoryError) as err:
        raise MemoryError(f"gpubuf: cannot allocate {total} bytes of storage on {device}: {err}") from None


def backend_for(device: torch.device) -> str:
    """The backend a buffer on ``device`` uses (``GPUBUF_BACKEND`` overrides)."""
    forced = os.environ.get("GPUBUF_BACKEND", "").strip()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"GPUBUF_BACKEND: expected one of {BACKENDS}, got {forced!r}")
        return forced
    return "triton" if device.type == "cuda" else "torch"


def _kernels(name: str):
    return importlib.import_module(f"gpubuf.kernels.{name}")


def history_append(backend, pairs, dst_rows):
    """For each (storage (max_len*n_envs, E), rows (R, E)) in pairs: storage[dst_rows (R,)] = rows."""
    if backend == "triton":
        return _kernels("history").append(pairs, dst_rows)
    return reference.history_append(pairs, dst_rows)


def history_gather_frames(backend, pairs, meta, n, ab, max_len):
    """For each (storage, out (rows, n, E)) in pairs: strided frames; meta (3, rows) int64 = (env, newest
    slot, k)."""
    if backend == "triton":
        return _kernels("history").gather_frames(pairs, meta, n, ab, max_len)
    return reference.history_gather_frames(pairs, meta, n, ab, max_len)


def history_pack_blocks(backend, storage, meta, n, ab, max_len, out):
    """out (rows, n-1, ab*D) = action blocks between strided frames, NaN zeroed, zero-padded."""
    if backend == "triton":
        return _kernels("history").pack_blocks(storage, meta, n, ab, max_len, out)
    return reference.history_pack_blocks(storage, meta, n, ab, max_len, out)


# ---- replay (kernels/sequence.py, kernels/prefix_tree.py)


def tree_sample(backend, tree, offsets, fanout, u, out):
    """out (B,) int64 = leaves of the wide prefix-sum tree picked by uniforms u (B,) float64."""
    if backend == "triton":
        return _kernels("prefix_tree").sample(tree, offsets, fanout, u, out)
    return reference.tree_sample(tree, offsets, fanout, u, out)


def tree_update(backend, tree, offsets, fanout, idx, values):
    """tree leaves [idx (K,)] = values (K,) float64, then touched parents recomputed from their children."""
    if backend == "triton":
        return _kernels("prefix_tree").update(tree, offsets, fanout, idx, values)
    return reference.tree_update(tree, offsets, fanout, idx, values)


def sequence_gather(backend, jobs, starts, n, E, M):
    """For each (storage (M*E, D), out (B, n, D), shift) in jobs: windows of n time-major rows from flat
    starts (B,), shifted."""
    if backend == "triton":
        return _kernels("sequence").gather(jobs, starts, n, E, M)
    return reference.sequence_gather(jobs, starts, n, E, M)


def tree_update_range(backend, tree, offsets, fanout, lo, values):
    """tree leaves [lo, lo + K) = values (K,) float64, then their parents recomputed from their children."""
    if backend == "triton":
        idx = torch.arange(lo, lo + values.shape[0], device=tree.device)
        return _kernels("prefix_tree").update(tree, offsets, fanout, idx, values)
    return reference.tree_update_range(tree, offsets, fanout, lo, values)
