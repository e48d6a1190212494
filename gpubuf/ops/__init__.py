"""The device operations, registered as ``torch.library`` ops ``torch.ops.gpubuf.*``, and the device
helpers.

One module per kernel family (``history``, ``prefix_tree``, ``sequence``, ``stacks``, beside
``kernels/`` of the same names) holds, for each of its ops: the pure-torch twin, the schema with its
CPU (twin), CUDA (Triton launcher) and fake registrations, so the dispatcher picks the kernel by
device and ``torch.compile`` traces the ops without graph breaks, and the function the buffers call.
That function takes the buffer's backend and Python containers; eager calls run the twin or the
launcher directly, traced ones the op (:func:`~gpubuf.ops.device.route`). Every op writes into
tensors it is given (declared mutable in its schema) and returns nothing. Triton is imported only
when a kernel runs, so ``import gpubuf`` works without a GPU or driver. The rest of gpubuf reaches the
kernels only through this package (their word views and mark bits included).
"""

from gpubuf.kernels import MARK_BOUNDARY, MARK_STOP, MARK_TERM
from gpubuf.kernels.words import as_words, gather_word
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
    route,
    triton_runs_on,
)
from gpubuf.ops.history import history_append, history_gather_frames, history_pack_blocks
from gpubuf.ops.prefix_tree import tree_sample, tree_update, tree_update_range
from gpubuf.ops.sequence import sequence_gather, sequence_gather_fixed, sequence_tables
from gpubuf.ops.stacks import frame_stack, frame_stack_fixed, n_step_return, stack_tables

__all__ = ["BACKENDS", "LRU", "MARK_BOUNDARY", "MARK_STOP", "MARK_TERM", "allocate", "allocation_failed", "as_words",
           "backend_for", "capacity", "capture_graph", "check_fits", "frame_stack", "frame_stack_fixed", "gather_word",
           "history_append", "history_gather_frames", "history_pack_blocks", "interpreting", "memory_error",
           "n_step_return", "resolve_device", "route", "sequence_gather", "sequence_gather_fixed", "sequence_tables",
           "stack_tables", "tree_sample", "tree_update", "tree_update_range", "triton_runs_on"]
