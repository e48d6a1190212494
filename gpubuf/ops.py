"""The device operations, registered as ``torch.library`` ops ``torch.ops.gpubuf.*``.

Each op has a CUDA implementation (its Triton kernel, :mod:`gpubuf.kernels`), a CPU implementation (its
pure-torch twin, :mod:`gpubuf.reference`) and a fake implementation, so the dispatcher picks the kernel by
device and ``torch.compile`` traces the ops without graph breaks. Every op writes into tensors it is given
(declared mutable in its schema) and returns nothing. ``GPUBUF_BACKEND=torch|triton`` forces one backend
for the buffers built while it is set. Triton compiles for GPUs only: a host (CPU) tensor goes to a Triton
kernel only while Triton's interpreter is on (``TRITON_INTERPRET=1``), never otherwise, whatever is forced.
Triton is imported only when a kernel runs, so ``import gpubuf`` works without a GPU or driver.

The buffers call the functions below, which take the buffer's backend and Python containers; eager calls
run the implementation directly (see :func:`_run`), traced ones the op.
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


def interpreting() -> bool:
    """Whether Triton's interpreter is on (``TRITON_INTERPRET`` set to 1/true/yes/on): kernels then run on host
    tensors."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


def triton_runs_on(device: torch.device) -> bool:
    """Whether Triton kernels can take tensors on ``device``: CUDA devices, and the host under the interpreter."""
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


def backend_for(device: torch.device) -> str:
    """The backend a buffer (or a storage tier) on ``device`` uses. ``GPUBUF_BACKEND`` overrides, except that a
    device Triton cannot run on (host memory without the interpreter) always gets the torch twins."""
    forced = os.environ.get("GPUBUF_BACKEND", "").strip()
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"GPUBUF_BACKEND: expected one of {BACKENDS}, got {forced!r}")
        return forced if forced == "torch" or triton_runs_on(device) else "torch"
    return "triton" if device.type == "cuda" else "torch"


def _kernels(name: str):
    return importlib.import_module(f"gpubuf.kernels.{name}")


def _zip(*lists) -> list:
    return list(zip(*lists, strict=True))


# op name -> (schema, pure-torch twin, Triton kernel launcher), both taking the schema's arguments
OPS = {
    "history_append": (
        "(Tensor(a!)[] storages, Tensor[] rows, Tensor dst_rows) -> ()",
        lambda storages, rows, dst: reference.history_append(_zip(storages, rows), dst),
        lambda storages, rows, dst: _kernels("history").append(_zip(storages, rows), dst)),
    "history_gather_frames": (
        "(Tensor[] storages, Tensor(a!)[] outs, Tensor meta, int n, int ab, int max_len) -> ()",
        lambda storages, outs, *rest: reference.history_gather_frames(_zip(storages, outs), *rest),
        lambda storages, outs, *rest: _kernels("history").gather_frames(_zip(storages, outs), *rest)),
    "history_pack_blocks": (
        "(Tensor storage, Tensor(a!) out, Tensor meta, int n, int ab, int max_len) -> ()",
        lambda storage, out, *rest: reference.history_pack_blocks(storage, *rest, out),
        lambda storage, out, *rest: _kernels("history").pack_blocks(storage, *rest, out)),
    "tree_sample": (
        "(Tensor tree, int[] offsets, int fanout, Tensor u, Tensor(a!) out) -> ()",
        lambda *args: reference.tree_sample(*args),
        lambda *args: _kernels("prefix_tree").sample(*args)),
    "tree_update": (
        "(Tensor(a!) tree, int[] offsets, int fanout, Tensor idx, Tensor values) -> ()",
        lambda *args: reference.tree_update(*args),
        lambda *args: _kernels("prefix_tree").update(*args)),
    "tree_update_range": (
        "(Tensor(a!) tree, int[] offsets, int fanout, int lo, Tensor values) -> ()",
        lambda *args: reference.tree_update_range(*args),
        lambda *args: _kernels("prefix_tree").update_range(*args)),
    "sequence_gather": (
        "(Tensor[] storages, Tensor(a!)[] outs, int[] shifts, Tensor starts, int n, int E, int M) -> ()",
        lambda storages, outs, shifts, *rest: reference.sequence_gather(_zip(storages, outs, shifts), *rest),
        lambda storages, outs, shifts, *rest: _kernels("sequence").gather(_zip(storages, outs, shifts), *rest)),
}

_LIB = torch.library.Library("gpubuf", "DEF")
for _name, (_schema, _twin, _kernel) in OPS.items():
    _LIB.define(_name + _schema)
    _LIB.impl(_name, _twin, "CPU")
    _LIB.impl(_name, _kernel, "CUDA")
    torch.library.register_fake(f"gpubuf::{_name}", lambda *args: None, lib=_LIB)

_NATIVE = {"cuda": "triton"}  # the backend each device type's registered implementation uses (else torch)


def _run(backend: str, device: torch.device, name: str, *args) -> None:
    """Run op ``name`` with ``backend``'s implementation. Under ``torch.compile`` the call goes through
    ``torch.ops.gpubuf`` (the dispatcher picks the implementation by device and Dynamo traces the op);
    eager calls go straight to the implementation the dispatcher would pick, or to the forced one: boxing
    tensor lists through the dispatcher costs about 50 us per call on a small CPU, more than the work."""
    if torch.compiler.is_compiling() and backend == _NATIVE.get(device.type, "torch"):
        getattr(torch.ops.gpubuf, name).default(*args)
    elif backend == "triton" and triton_runs_on(device):
        OPS[name][2](*args)
    else:  # the torch twin, also for a "triton" request on a device Triton cannot run on
        OPS[name][1](*args)


def history_append(backend, pairs, dst_rows):
    """For each (storage (max_len*n_envs, E), rows (R, E)) in pairs: storage[dst_rows (R,)] = rows."""
    _run(backend, dst_rows.device, "history_append", [p[0] for p in pairs], [p[1] for p in pairs], dst_rows)


def history_gather_frames(backend, pairs, meta, n, ab, max_len):
    """For each (storage, out (rows, n, E)) in pairs: strided frames; meta (3, rows) int64 = (env, newest
    slot, k)."""
    _run(backend, meta.device, "history_gather_frames", [p[0] for p in pairs], [p[1] for p in pairs], meta, int(n),
         int(ab), int(max_len))


def history_pack_blocks(backend, storage, meta, n, ab, max_len, out):
    """out (rows, n-1, ab*D) = action blocks between strided frames, NaN zeroed, zero-padded."""
    _run(backend, meta.device, "history_pack_blocks", storage, out, meta, int(n), int(ab), int(max_len))


# ---- replay (kernels/sequence.py, kernels/prefix_tree.py)


def tree_sample(backend, tree, offsets, fanout, u, out):
    """out (B,) int64 = leaves of the wide prefix-sum tree picked by uniforms u (B,) float64."""
    _run(backend, tree.device, "tree_sample", tree, offsets, fanout, u, out)


def tree_update(backend, tree, offsets, fanout, idx, values):
    """tree leaves [idx (K,)] = values (K,) float64, then touched parents recomputed from their children."""
    _run(backend, tree.device, "tree_update", tree, offsets, fanout, idx, values)


def tree_update_range(backend, tree, offsets, fanout, lo, values):
    """tree leaves [lo, lo + K) = values (K,) float64, then their parents recomputed from their children."""
    _run(backend, tree.device, "tree_update_range", tree, offsets, fanout, int(lo), values)


def sequence_gather(backend, jobs, starts, n, E, M):
    """For each (storage (M*E, D), out (B, n, D), shift) in jobs: windows of n time-major rows from flat
    starts (B,), shifted."""
    _run(backend, starts.device, "sequence_gather", [j[0] for j in jobs], [j[1] for j in jobs],
         [int(j[2]) for j in jobs], starts, int(n), int(E), int(M))
