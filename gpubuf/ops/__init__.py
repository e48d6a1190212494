"""The device operations, registered as ``torch.library`` ops ``torch.ops.gpubuf.*``, the backend table that
decides what each call runs, and the device helpers.

One module per kernel family (``history``, ``prefix_tree``, ``priorities``, ``sequence``, ``stacks``, beside
``kernels/`` of the same names) holds, for each of its ops: the pure-torch twin (the tests' oracle, with its launcher's
signature), the compiled host loop where one exists (:mod:`~gpubuf.ops.host_loops`), and the
:class:`~gpubuf.ops.registry.Op` registering its schema with its CPU (the host loop or the twin), CUDA (Triton launcher)
and fake implementations, so ``torch.compile`` traces the ops without graph breaks. A buffer never picks among them: it
holds one :class:`~gpubuf.ops.backends.Backend` (:func:`~gpubuf.ops.backends.backend_table`, chosen once from the
device, ``GPUBUF_BACKEND``, the host loops and the storage layout) and calls its callables, each bound at construction
to the launcher, the loop or the twin, with traced calls going through the dispatcher (decided inside the callable).
Every op writes into tensors it is given (declared mutable in its schema) and returns nothing. Triton is imported only
when a kernel runs, so ``import gpubuf`` works without a GPU or driver. The rest of gpubuf reaches the kernels only
through this package (their word views, mark and check bits included).

A new op adds: its kernel and ``variants()`` in ``kernels/<family>.py``; its twin, CPU implementation and
:class:`~gpubuf.ops.registry.Op` in ``gpubuf/ops/<family>.py``; one field of :class:`~gpubuf.ops.backends.Backend`
bound in its ``__init__``; its samples in ``tests/ops/test_custom_ops.py``.
"""

from gpubuf.kernels import BAD_INDEX, MARK_BOUNDARY, MARK_STOP, MARK_TERM, NOT_FINITE, OVERFLOW
from gpubuf.kernels.words import as_words, gather_word
from gpubuf.ops.backends import Backend, backend_table
from gpubuf.ops.device import (
    BACKENDS,
    LRU,
    allocate,
    allocation_failed,
    backend_for,
    capacity,
    capture_graph,
    check_fits,
    interpreting,
    memory_error,
    resolve_device,
    triton_runs_on,
)
from gpubuf.ops.priorities import checks_twin as priority_checks
from gpubuf.ops.priorities import mass_limit, overflow_error, priority_error
from gpubuf.ops.sequence import sequence_gather_fixed, sequence_tables
from gpubuf.ops.stacks import frame_stack_fixed, stack_tables

__all__ = ["BACKENDS", "BAD_INDEX", "Backend", "LRU", "MARK_BOUNDARY", "MARK_STOP", "MARK_TERM", "NOT_FINITE",
           "OVERFLOW", "allocate", "allocation_failed", "as_words", "backend_for", "backend_table", "capacity",
           "capture_graph", "check_fits", "frame_stack_fixed", "gather_word", "interpreting", "mass_limit",
           "memory_error", "overflow_error", "priority_checks", "priority_error", "resolve_device",
           "sequence_gather_fixed", "sequence_tables", "stack_tables", "triton_runs_on"]
