"""The backend table: what each op call of one buffer (or storage tier) runs, decided once.

:func:`backend_table` picks a :class:`Backend` from the device, ``GPUBUF_BACKEND`` (:func:`~gpubuf.ops.device.
backend_for`), whether the compiled host loops are enabled (:mod:`gpubuf.ops.host_loops`) and the storage layout
(``env_major``: a ``storage_dir``'s files, whose window, stack and return gathers always run the torch twins), and
caches it per those inputs. Each callable of the table is bound at construction to the Triton launcher (Triton
runs on the device and was chosen), the numba loop (host memory, loops enabled) or the torch twin; where the
dispatcher registers that same implementation for the device (Triton on CUDA, the CPU implementation on the host),
a call made while ``torch.compile`` traces goes through ``torch.ops.gpubuf`` instead, decided inside the callable.
Callers never ask which: an eager call costs one check of :func:`torch.compiler.is_compiling`, or none.
"""

import functools
from collections.abc import Callable

import torch

from gpubuf._core.signals import signals_held
from gpubuf.ops import history, host_loops, prefix_tree, priorities, sequence, stacks
from gpubuf.ops.device import BACKENDS, LRU, backend_for, interpreting, triton_runs_on
from gpubuf.ops.registry import OPS, Op

_compiling = torch.compiler.is_compiling
_TABLES = LRU(16)  # (device, name, loops, env_major) -> Backend


def backend_table(device: torch.device, name: str | None = None, env_major: bool = False) -> "Backend":
    """The table of a buffer (or storage) on ``device``: backend ``name`` (``None``: :func:`backend_for` the device;
    ``"triton"`` where Triton cannot run gets the twins), ``env_major`` for a ``storage_dir``'s files; cached."""
    if name is None:
        name = backend_for(device)
    elif name not in BACKENDS:
        raise ValueError(f"name: expected one of {BACKENDS}, got {name!r}")
    elif not triton_runs_on(device):
        name = "torch"
    return _TABLES.get((device, name, host_loops.ENABLED, env_major), Backend, device, name, host_loops.ENABLED,
                       env_major)


def cached_tables() -> list["Backend"]:
    """Every table cached now (a benchmark swaps their callables)."""
    return _TABLES.values()


def _traced_else(traced: Callable, eager: Callable) -> Callable:
    """``traced(*args)`` while ``torch.compile`` traces, else ``eager(*args)``."""

    def call(*args):
        if _compiling():
            return traced(*args)
        return eager(*args)

    call.__name__ = call.__qualname__ = getattr(eager, "__name__", "call")
    return call


def _signals_held(fn: Callable) -> Callable:
    """``fn(*args)`` with asynchronous signals held until it returns (:class:`~gpubuf._core.signals.signals_held`)."""

    def call(*args):
        with signals_held():
            return fn(*args)

    call.__name__ = call.__qualname__ = getattr(fn, "__name__", "call")
    return call


class Backend:
    """What each op call on ``device`` runs: ``name`` (``"triton"`` or ``"torch"``), ``host_loops`` (the numba
    loops run the host side), ``env_major`` (rows env-major: twins for the gathers), and one callable per op.

    Each callable takes its twin's arguments (``priority_write`` and the history ops: their schemas' order): tree ops
    ``tree_sample``, ``tree_sample_masses`` (-> ``(leaves, masses)``), ``tree_update``, ``tree_update_range``
    (:mod:`gpubuf.ops.prefix_tree`); ``priority_write``, ``masses``, ``importance_weights``
    (:mod:`gpubuf.ops.priorities`); gathers ``window_gather`` (:mod:`gpubuf.ops.sequence`; ``None`` for env-major
    rows, which their storage gathers), ``frame_stack`` and ``n_step_return`` (:mod:`gpubuf.ops.stacks`); the fixed
    pointer tables of the Triton gathers, ``window_tables`` / ``window_gather_fixed`` / ``stack_tables`` /
    ``frame_stack_fixed`` (``None`` where they do not run); ``history_append``, ``history_gather_frames``,
    ``history_pack_blocks`` (:mod:`gpubuf.ops.history`); ``insert_loops``: the compiled ``(ring_write,
    refresh_starts)`` of an insert's bookkeeping on the CPU (:mod:`gpubuf.replay.sampling.host_commit`), ``None``
    where the reference path (numpy and torch ops) runs.
    """

    def __init__(self, device: torch.device, name: str, loops: bool, env_major: bool):
        self.device, self.name, self.env_major = device, name, env_major
        self.host_loops = loops and device.type == "cpu" and name == "torch"
        self.interpreted = interpreting()
        self.ran = {}  # op name -> what an eager call runs, for the report
        bind = functools.partial(_bind, self)
        self.tree_sample, self.tree_update = bind(prefix_tree.SAMPLE), bind(prefix_tree.UPDATE)
        self.tree_update_range = bind(prefix_tree.UPDATE_RANGE)
        self.tree_sample_masses = self._host_or(prefix_tree.sample_masses_host, self._sample_masses)
        write = bind(priorities.WRITE)  # all or nothing: one compiled call, else a chain run with signals held
        if self.host_loops:
            self.priority_write = write
        elif device.type == "cpu" and name == "torch":  # host checks, then the writes (signals held inside)
            self.priority_write = _traced_else(priorities.WRITE.traced, priorities.write_host_checked)
            self.ran[priorities.WRITE.name] = "host-checked torch"
        else:
            self.priority_write = _traced_else(write, _signals_held(write))
        self.masses = self._host_or(priorities.masses_host, priorities.masses_twin)
        self.insert_loops = (host_loops.ring_write, host_loops.refresh_starts) if self.host_loops else None
        self.importance_weights = self._host_or(priorities.weights_host, priorities.weights_twin)
        self.history_append, self.history_gather_frames = bind(history.APPEND), bind(history.GATHER_FRAMES)
        self.history_pack_blocks = bind(history.PACK_BLOCKS)
        if env_major:  # the twins, which read env-major rows; windows: the storage gathers them itself
            self.window_gather = None
            self.frame_stack = functools.partial(stacks.stack_twin, env_major=True)
            self.n_step_return = functools.partial(stacks.return_twin, env_major=True)
            self.ran.update(sequence_gather="torch twin", frame_stack="torch twin", n_step_return="torch twin")
        else:
            self.window_gather, self.frame_stack = bind(sequence.GATHER), bind(stacks.STACK)
            self.n_step_return = bind(stacks.RETURN)
        tables = self.kernels and not env_major
        self.window_tables = sequence.sequence_tables if tables else None
        self.window_gather_fixed = sequence.sequence_gather_fixed if tables else None
        self.stack_tables = stacks.stack_tables if tables else None
        self.frame_stack_fixed = stacks.frame_stack_fixed if tables else None

    def priority_writer(self, priority, trees, valids, offsets, fanout, box, result) -> Callable:
        """``write(idx, td, eps, alpha, limit)``: :attr:`priority_write` into these persistent tensors (the numba
        loops get their arrays once: build it again when any of them changes)."""
        write = functools.partial(priorities.write_into, self.priority_write, priority, trees, valids, offsets,
                                  fanout, box, result)
        if not self.host_loops:
            return write
        return _traced_else(write, priorities.host_writer(priority, trees, valids, offsets, fanout, box, result))

    @property
    def kernels(self) -> bool:
        """Whether Triton kernels run this table's ops (else the torch twins or the numba loops)."""
        return self.name == "triton"

    @property
    def fixed_tables(self) -> bool:
        """Whether fixed outputs gather through pointer tables uploaded once (:attr:`window_tables`)."""
        return self.window_tables is not None

    @property
    def host_gather(self) -> bool:
        """Whether window gathers run the torch twin on host memory (a caller may gather the twin's rows itself)."""
        return self.device.type == "cpu" and not self.kernels and not self.env_major

    # ``tracing()``: whether ``torch.compile`` traces the call asking (a driver builds its views differently then);
    # torch's own check itself, no frame of ours (every locked call asks it)
    tracing = staticmethod(_compiling)

    def capturing(self) -> bool:
        """Whether a CUDA graph captures the work on this table's device now."""
        return self.device.type == "cuda" and not _compiling() and torch.cuda.is_current_stream_capturing()

    def __reduce__(self):
        """Copied or pickled (with what holds it) as the table of its deciding inputs where it lands."""
        return backend_table, (self.device, self.name, self.env_major)

    def _host_or(self, host: Callable, twin: Callable) -> Callable:
        """``host`` (a compiled loop) for eager calls where the loops run, else (and traced) ``twin``."""
        return _traced_else(twin, host) if self.host_loops else twin

    def _sample_masses(self, tree, offsets, fanout, u) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty(u.shape, dtype=torch.int64, device=tree.device)
        self.tree_sample(tree, offsets, fanout, u, out)
        return out, tree[out]

    def implementations(self) -> dict:
        """Each op -> what an eager call runs: ``"triton kernel"``, ``"numba loop"`` or ``"torch twin"``; and the
        PER steps outside the registered ops (the whole priority update, the importance weights): ``"numba loop"``
        where one compiled loop runs each, else ``"torch ops"``."""
        report = {name: self.ran[name] for name in sorted(OPS)}
        loops = "numba loop" if self.host_loops else "torch ops"
        return {**report, "priority_update": loops, "importance_weights": loops, "insert_bookkeeping": loops}


def _bind(table: Backend, op: Op) -> Callable:
    """The callable of ``op`` in ``table``, recording what runs it."""
    device = table.device
    if table.kernels:
        eager, what = op.launcher, "triton kernel"
    elif device.type == "cpu" and table.host_loops and op.host_loop:
        eager, what = op.host, "numba loop"
    else:
        eager, what = op.twin, "torch twin"
    table.ran[op.name] = what
    registered = "triton" if device.type == "cuda" else "torch"  # what the dispatcher runs for the device
    return _traced_else(op.traced, eager) if table.name == registered else eager
