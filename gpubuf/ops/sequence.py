"""TransitionBuffer's window gather op (Triton kernel in ``kernels/sequence.py``).

Storage of one leaf is a contiguous ``(M * E, D)`` tensor, time-major (row ``step * E + env``). A flat start
``s = step * E + env`` yields the rows ``((step + j + shift) % M) * E + env`` for ``j < n``. Beside the op: the fixed
pointer tables of the Triton gather.
"""

import torch

from gpubuf.kernels.words import as_words
from gpubuf.ops.indexing import window_rows
from gpubuf.ops.registry import Op, from_lists, kernel


def gather_twin(jobs: list, starts: torch.Tensor, n: int, E: int, M: int) -> None:
    """For each ``(storage (M*E, D), out (B, n, D), shift)`` in ``jobs``: out = storage rows
    ``((start//E + j + shift) % M) * E + start % E``, j < n, of flat starts (B,); rows once per shift
    (:func:`~gpubuf.ops.indexing.window_rows`)."""
    B = starts.shape[0]
    if B == 0:
        return
    rows = {}
    for storage, out, shift in jobs:
        if shift not in rows:
            rows[shift] = window_rows(starts, n, shift, E, M)
        src, dst = as_words(storage, out.view(B * n, storage.shape[1]))
        torch.index_select(src, 0, rows[shift], out=dst)


def gather_launch(jobs: list, starts: torch.Tensor, n: int, E: int, M: int) -> None:
    """The Triton launcher for the twin's call form, imported when it first runs."""
    from gpubuf.kernels.sequence import gather

    gather(jobs, starts, int(n), int(E), int(M))


def gather_traced(jobs: list, starts: torch.Tensor, n: int, E: int, M: int) -> None:
    """The twin's call form through the dispatcher (``torch.compile`` traces the op)."""
    GATHER.dispatch([j[0] for j in jobs], [j[1] for j in jobs], [int(j[2]) for j in jobs], starts, int(n),
                    int(E), int(M))


gather_cpu = from_lists(gather_twin)  # the CPU implementation: the twin
gather_cuda = from_lists(kernel("sequence", "gather"))  # the CUDA implementation: the launcher

# the buffers call it with a job list (the twin's form), which goes straight to the twin or launcher
GATHER = Op("sequence_gather", "(Tensor[] storages, Tensor(a!)[] outs, int[] shifts, Tensor starts, "
            "int n, int E, int M) -> ()", gather_cpu, gather_cuda,
            calls=(gather_twin, gather_twin, gather_launch, gather_traced))


def sequence_tables(jobs: list, B: int, n: int, device: torch.device) -> list:
    """The Triton gather's pointer tables for fixed ``(storage, out (B, n, D), shift)`` jobs, uploaded once
    (where Triton runs): :func:`sequence_gather_fixed` launches them, also inside a CUDA graph."""
    from gpubuf.kernels.sequence import tables

    return tables(jobs, B, n, device)


def sequence_gather_fixed(tables: list, starts: torch.Tensor, n: int, E: int, M: int) -> None:
    """The windows of :func:`gather_twin` into the outputs of :func:`sequence_tables` for flat starts (B,) int64."""
    from gpubuf.kernels.sequence import gather_from_tables

    gather_from_tables(tables, starts, n, E, M)
