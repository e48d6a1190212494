"""HistoryBuffer: per-env ring buffers of batched info dicts, read back as strided histories.

Storage per key is one preallocated slot-major ``(max_len * n_envs, D)`` device tensor (``D`` elements per entry);
env ``e``'s ring slot ``s`` is row ``s * n_envs + e``, so envs in lockstep write and read contiguous blocks. Write
heads and counts live on the host (the host already knows them), so ``append``/``get`` never read the device;
per-call row metadata is built there and uploaded with one non-blocking copy.

Every write is two-phase: each key is checked and staged on the device first (where any conversion fails), then
all keys are committed with copies that cannot fail on staged data, then the host mirror moves.

The buffer is the public API over its parts: :class:`~gpubuf.history.schema.Schema` (keys, storage, checks, output
shapes), :class:`~gpubuf.history.ring.Ring` (host mirror of heads and counts), :class:`~gpubuf.history.outputs.Outputs`
(fresh outputs) and, on the torch backend, :class:`~gpubuf.history.lockstep.Lockstep` (the steady-state fast path);
the checked paths call the ops of :mod:`gpubuf.ops.history` (torch twins or Triton kernels).

Glossary: ``R`` envs selected by a call (``env_ids``); ``D`` elements per entry of a key; slot: a ring position of an
env (``max_len`` per env); head: the next slot an env writes; count: entries an env holds; ``ab`` (``action_block``):
entries per action block; strided: every ``ab``-th entry."""

from collections.abc import Iterable, Mapping

import numpy as np
import torch

from gpubuf import ops
from gpubuf._core import checkpoint
from gpubuf._core.concurrency import CallGuard, locked
from gpubuf._core.copies import CopiedByState
from gpubuf._core.inputs import env_ids_or_all, positive_int
from gpubuf._core.signals import signals_held
from gpubuf._core.staging import Staging
from gpubuf._core.state import check_state, copy_into, host_tensor, unaliased
from gpubuf.history.lockstep import Lockstep
from gpubuf.history.outputs import Outputs
from gpubuf.history.ring import Ring
from gpubuf.history.schema import Schema, block_key_names


class HistoryBuffer(checkpoint.Checkpointable, CopiedByState):
    """Per-env ring buffer over batched info dicts with strided, warm-up padded reads.

    Args:
        n_envs: number of parallel envs (rows of every appended value).
        max_len: entries (env steps since the last reset) kept per env.
        action_block: stride between returned frames (frameskip of the planner).
        block_keys: keys returned as action blocks between frames (a bare string is a ``TypeError``); their values
            must be real floats (16 to 64 bits), ``uint8``, signed ints or bool.
        device: storage device; ``None`` -> ``cuda`` when available, else ``cpu``.

    ``append({'pixels': (n_envs, 1, H, W, C), 'action': (n_envs, 1, A)})`` stores one entry per env; ``get(n)``
    returns ``pixels`` ``(n_envs, n, H, W, C)`` and ``action`` ``(n_envs, n-1, action_block*A)``. Until an env has
    lived ``(n-1)*action_block+1`` steps its frames are left-padded with its oldest strided entry and its blocks with
    zero blocks (synthetic warm-up, as in stable-worldmodel).

    Threads: any number of threads may call any method at once; each call runs whole, between the others (:attr:`lock`;
    :mod:`gpubuf._core.concurrency`), so a planner thread's ``get`` never mixes two appends. ``copy.deepcopy``,
    ``pickle`` and ``torch.save`` give an independent, complete buffer (:mod:`gpubuf._core.copies`). ``reset``,
    ``append`` and ``get`` are opaque calls under ``torch.compile``: no guards on host state, no recompiles."""

    def __init__(self, n_envs: int, max_len: int, action_block: int = 1, block_keys: Iterable[str] = (), *,
                 device=None):
        self.n_envs = positive_int("n_envs", n_envs)
        self.max_len = positive_int("max_len", max_len)
        self.action_block = positive_int("action_block", action_block)
        self.block_keys = block_key_names(block_keys)
        self.device = ops.resolve_device(device)
        self.table = ops.backend_table(self.device)  # what each op call runs, decided once
        self.backend = self.table.name
        self._guard = CallGuard(self.device, self.table.tracing)
        self._ring = Ring(self.n_envs, self.max_len)
        self._schema = Schema(self.n_envs, self.max_len, self.action_block, self.block_keys, self.table)
        self._staging = Staging(self.device)
        self._outputs = Outputs(self.device)
        # the Triton kernels keep their own launch paths: no fast path where they run
        self._lockstep = (None if self.table.kernels else
                          Lockstep(self._schema, self._ring, self._staging, self._outputs, self.action_block))

    # ------------------------------------------------------------------ bookkeeping

    @locked
    def __len__(self) -> int:
        """The minimum entry count over all envs."""
        return int(self._ring.counts.min())

    @property
    def lock(self):
        """The re-entrant lock every call holds: hold it to make several calls one step, as another thread sees them
        (``with history.lock: ...``)."""
        return self._guard.lock

    def copy_args(self) -> dict:
        """Constructor arguments of an empty buffer that this one's ``state_dict`` loads into."""
        return {**{name: getattr(self, name) for name in self._CONFIG}, "device": str(self.device)}

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(self._schema.data)

    @property
    @locked
    def nbytes(self) -> int:
        """Device bytes held by the storage."""
        return sum(t.numel() * t.element_size() for t in self._schema.data.values())

    @locked
    def num_strided(self, env_ids=None) -> list[int]:
        """Strided frames available per env: ``(L-1)//action_block + 1``, or 0 for an empty env."""
        return self._ring.num_strided(env_ids_or_all(env_ids, self._ring.all_ids), self.action_block).tolist()

    @torch.compiler.disable
    @locked
    def reset(self, env_ids=None) -> None:
        """Forget the listed envs' entries (all envs if ``None``; ``[]`` does nothing).

        Only the entry counts change: each env's ring position is kept, so its next entries overwrite its oldest
        slots first."""
        self._ring.reset(env_ids_or_all(env_ids, self._ring.all_ids))

    @locked
    def mark(self) -> tuple:
        """A token for :meth:`rollback`: the write heads, entry counts and (before the first append) the fact that no
        key is fixed yet. Host state only: taking it reads nothing from the device."""
        return self._ring.heads.copy(), self._ring.counts.copy(), bool(self._schema.data)

    @locked
    def rollback(self, mark: tuple) -> None:
        """Undo the appends and resets made since :meth:`mark` returned ``mark``. A buffer that held no key then
        forgets the keys, shapes and dtypes its first append fixed (and frees their storage). Exact only if those
        appends overwrote no slot that is read again: keep a spare slot per env (``max_len`` one more than read, as
        :class:`gpubuf.Planner` does)."""
        heads, counts, had_keys = mark
        if not had_keys and self._schema.data:
            self._set_storage({}, {})
        self._ring.restore(heads.copy(), counts.copy())

    def _set_storage(self, data: dict, shapes: dict) -> None:
        self._schema.set_storage(data, shapes)
        self._outputs.forget()
        if self._lockstep is not None:
            self._lockstep.forget()

    def _upload(self, arr: np.ndarray, key: str) -> torch.Tensor:
        return self._staging.to_device(torch.from_numpy(arr), key)

    # ------------------------------------------------------------------ append

    @torch.compiler.disable
    @locked
    def append(self, info_dict: Mapping, env_ids=None) -> None:
        """Append one entry per selected env: values ``(R, T, ...)`` or ``(R,)``, ``R = len(env_ids)``.

        Row ``j`` goes to env ``env_ids[j]`` (all envs in order if ``None``); an env listed twice gets two entries, in
        row order. Numeric scalars are broadcast (a new key from a Python float takes torch's default float dtype, as
        ``torch.tensor(1.5)`` does). Every check runs before any write."""
        fast = self._lockstep
        if env_ids is None and fast is not None and fast.append(info_dict):
            return
        if not isinstance(info_dict, Mapping) or not info_dict:
            raise TypeError(f"info_dict: expected a non-empty dict of arrays, got {info_dict!r:.80}")
        ids = env_ids_or_all(env_ids, self._ring.all_ids)
        R = len(ids)
        schema = self._schema
        values, dtypes = schema.check_values(info_dict, R)
        if R == 0:
            if dtypes is not None:
                self._set_storage(*schema.new_storage(values, dtypes))
            return
        dst_rows, keep, heads, counts = self._ring.plan_append(ids)
        # phase 1: stage every key (conversion errors happen here, before any write)
        keep_t = None if keep is None else torch.from_numpy(keep)
        staged = {}
        for key, t in values.items():
            rows = t.expand(R, *t.shape) if t.dim() == 0 else t
            if keep_t is not None:
                rows = rows[keep_t.to(rows.device)]
            dtype = schema.data[key].dtype if dtypes is None else dtypes[key]
            staged[key] = self._staging.stage(rows.reshape(len(dst_rows), -1), key, dtype, schema.owned)
        dst = self._upload(dst_rows, "__dst_rows__")
        if dtypes is not None:
            self._set_storage(*schema.new_storage(values, dtypes))
        with signals_held():  # phase 2: commit
            self.table.history_append([schema.data[key] for key in staged], list(staged.values()), dst)
            self._ring.restore(heads, counts)
        if env_ids is None and fast is not None:
            fast.accept(info_dict, values)

    @locked
    def graph_writer(self):
        """A :class:`~gpubuf.history.graph_append.HistoryGraphWriter`: appends of one entry per env with device ops
        only, for a step traced by ``torch.compile(fullgraph=True)`` or captured in a CUDA graph; the keys, shapes
        and dtypes are those of the first (eager) append. From then on eager calls first read the device's heads and
        counts (one read)."""
        from gpubuf.history.graph_append import HistoryGraphWriter

        if not self._schema.data:
            raise ValueError("history: append once first (its keys, shapes and dtypes fix what a graph writer appends)")
        return HistoryGraphWriter(self, self._schema, self._ring, self._guard)

    # ------------------------------------------------------------------ get

    @torch.compiler.disable
    @locked
    def get(self, n: int, env_ids=None, out: dict | None = None, keys=None) -> dict[str, torch.Tensor] | None:
        """The last ``n`` strided entries per selected env, oldest first; ``None`` if ``n <= 0`` or one is empty.

        Regular keys: ``(rows, n)`` for per-env shape ``()``, else ``(rows, n*T, ...)``. Block keys: ``(rows, n-1,
        action_block*D)``, omitted when ``n == 1``. ``keys``: an iterable of ``str`` key names to fetch (``None``:
        every key; a key not stored raises ``ValueError`` naming ``keys``; a bare string, a non-iterable or a
        non-``str`` entry is a ``TypeError`` naming ``keys``): only those are gathered, so one key costs one key.
        ``out`` may hold tensors of exactly the returned shapes and dtypes on the buffer's device; they are written
        and returned.

        Memory: a get whose outputs (and, on the torch backend, row indices) exceed what the device has in all raises
        ``MemoryError`` naming ``n`` and the bytes before allocating anything; an allocation that fails raises the same,
        and the buffer keeps none of that call's memory."""
        if env_ids is None and type(n) is int and self._lockstep is not None:
            got = self._lockstep.get(n, out, keys)
            if got is not None:
                return got
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise TypeError(f"n: expected an int, got {n!r}")
        ids = env_ids_or_all(env_ids, self._ring.all_ids)
        if n >= 2**31:
            raise ValueError(f"n: expected fewer than 2**31 frames per row, got {n}")
        schema = self._schema
        wanted = schema.wanted(keys)
        if n <= 0 or not schema.data or (self._ring.counts[ids] == 0).any():
            return None
        n = int(n)
        shapes, sizes, what, nbytes = schema.sized(len(ids), n, wanted, out is None)
        spares = self._outputs.kept() if self._outputs.may_keep(nbytes) else None
        try:
            if out is None:
                out = {key: self._outputs.fresh(key, shape, schema.data[key].dtype, sizes[key])
                       for key, shape in shapes.items()}
            else:
                schema.check_out(out, shapes)
            self._gather(ids, n, shapes, out)
        except BaseException as err:
            if spares is not None:  # the memory of this call's outputs is not kept
                self._outputs.restore(spares)
            if ops.allocation_failed(err):
                raise ops.memory_error("n", what, err) from None
            raise
        return {key: out[key] for key in shapes}

    def _gather(self, ids: np.ndarray, n: int, shapes: dict, out: dict) -> None:
        """Write the last ``n`` strided entries of envs ``ids`` (R,) into ``out``: one output per key of ``shapes``,
        of the shapes :meth:`get` returns."""
        schema, ab = self._schema, self.action_block
        meta = self._upload(self._ring.meta(ids, n, ab), "__meta__")
        storages, outs = [], []
        for key in shapes:
            storage, dst = schema.data[key], out[key]
            if key in self.block_keys:
                self.table.history_pack_blocks(storage, dst, meta, n, ab, self.max_len)
            else:
                storages.append(storage)
                outs.append(dst)
        self.table.history_gather_frames(storages, outs, meta, n, ab, self.max_len)

    # ------------------------------------------------------------------ state

    _CONFIG = ("n_envs", "max_len", "action_block", "block_keys")

    @locked
    def state_dict(self) -> dict:
        """Configuration, data and counters: tensors and plain Python values only (``torch.load`` reads it with its
        defaults). Data tensors are the storage itself, not copies (as ``nn.Module.state_dict``): save or clone them
        before the buffer changes."""
        return {"buffer": type(self).__name__, "version": 1, **{name: getattr(self, name) for name in self._CONFIG},
                "shapes": dict(self._schema.shapes), "data": dict(self._schema.data),
                "counts": torch.from_numpy(self._ring.counts.copy()),
                "heads": torch.from_numpy(self._ring.heads.copy())}

    @locked
    def load_state_dict(self, state) -> None:
        """Restore a :meth:`state_dict` (saved on any device). The whole state is validated first (buffer type,
        configuration, keys, shapes, dtypes, counters in range): a mismatch raises naming the key and leaves the
        buffer as it was. A buffer that has not stored anything yet takes the state's keys. The copy runs with Ctrl-C
        and timer signals held; should reading the data itself fail after validation (an I/O error on a checkpoint
        file), the buffer is emptied rather than left half-loaded."""
        template = self.state_dict()
        check_state(state, template, self._CONFIG + ("version",), skip=("shapes", "data"))
        shapes = self._schema.check_state_layout(state)
        counts = host_tensor(state["counts"]).numpy().copy()
        heads = host_tensor(state["heads"]).numpy().copy()
        if counts.size and (counts.min() < 0 or counts.max() > self.max_len):
            raise ValueError(f"state_dict['counts']: expected entry counts in [0, {self.max_len}], "
                             f"got [{counts.min()}, {counts.max()}]")
        if heads.size and (heads.min() < 0 or heads.max() >= self.max_len):
            raise ValueError(f"state_dict['heads']: expected ring heads in [0, {self.max_len}), "
                             f"got [{heads.min()}, {heads.max()}]")
        if not shapes and counts.any():
            raise ValueError("state_dict['counts']: a state without keys holds no entries, got nonzero counts")
        data = state["data"]
        storage = self._schema.data
        if not storage and shapes:
            storage = ops.allocate({k: tuple(data[k].shape) for k in shapes}, {k: data[k].dtype for k in shapes},
                                   self.device)
        data = unaliased({k: data[k] for k in storage}, storage, self._schema.owned)
        with signals_held():
            try:
                for key, t in storage.items():
                    copy_into(t, data[key])
            except BaseException:
                self._ring.clear()  # the data is half-read: forget every entry
                raise
            self._set_storage(storage, shapes)
            self._ring.restore(heads, counts)
