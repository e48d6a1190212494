"""The steady-state fast path of a history buffer on the torch backend (host storage, or any device with
``GPUBUF_BACKEND=torch``), in plain torch calls: every env appends and reads together, heads in lockstep. An append then
copies one contiguous slot block per key; a read runs one ``index_select`` per key with source rows planned once per
``(n, head, frames used, keys)`` (from :mod:`gpubuf.ops.indexing`, as the twins compute them). Any other call, or
anything unusual about one, returns ``False``/``None`` having written nothing, and the buffer's checked path takes it.
The Triton backend keeps its own launch paths and never gets here."""

import numpy as np
import torch

from gpubuf._core.inputs import lossless
from gpubuf._core.signals import signals_held
from gpubuf._core.staging import overlaps
from gpubuf.history.outputs import BIG
from gpubuf.ops import gather_word, indexing

# the plans (one per (n, head, frames used, keys); a steady loop cycles through max_len heads) hold
# at most this many index bytes and entries, whatever n callers ask for
PLAN_BYTES = 32 << 20
PLAN_ENTRIES = 4096


class Lockstep:
    """The fast path over a buffer's ``schema`` (keys, storage), ``ring`` (host mirror), ``staging``
    and ``outputs``; ``action_block`` entries per action block."""

    def __init__(self, schema, ring, staging, outputs, action_block: int):
        self._schema, self._ring, self._staging, self._outputs = schema, ring, staging, outputs
        self.n_envs, self.max_len, self.action_block = ring.n_envs, ring.max_len, action_block
        self.device = outputs.device
        self._keep_from = BIG if outputs.host else float("inf")  # outputs of these bytes are kept
        self.forget()

    def forget(self) -> None:
        """Drop the accepted signature and every plan (the keys changed)."""
        self._sig = None  # the last accepted all-env append's input signature, storage views
        self._slots: dict[int, list] = {}  # head -> the views' slot blocks
        self._plans: dict = {}
        self._plan_bytes = 0
        self._out_ok = None  # (addresses, n, keys) of the last out= found disjoint

    def cached_plans(self) -> tuple[int, int]:
        """``(plans, index bytes)`` held."""
        return len(self._plans), self._plan_bytes

    # ------------------------------------------------------------------ append

    def accept(self, info_dict, values: dict) -> None:
        """Remember what an all-env append just accepted, as :meth:`append` compares it: per key
        ``(key, type, dtype, shape[, device, requires_grad, layout])``, with the storage's slot-major view each key
        writes; nothing unless every value is a plain numpy array or dense tensor of rows ``(n_envs, *entry)`` whose
        cast into storage is lossless (others take the checked path every time)."""
        self._sig = None
        if type(info_dict) is not dict:
            return
        sig, views = [], []
        for key, v in info_dict.items():
            t, storage = values[key], self._schema.data[key]
            if type(v) is np.ndarray and v.dtype.isnative:
                sig.append((key, np.ndarray, v.dtype, v.shape))
            elif type(v) is torch.Tensor and not v.requires_grad and not v.is_nested and v.layout == torch.strided:
                sig.append((key, torch.Tensor, v.dtype, v.shape, v.device, False, v.layout))
            else:
                return
            entry = self._schema.shapes[key]
            if tuple(t.shape) != (self.n_envs, *entry) or not lossless(t.dtype, storage.dtype):
                return
            views.append(storage.view(self.max_len, self.n_envs, *entry))
        self._slots = {}
        self._sig = tuple(sig), views

    def append(self, info_dict) -> bool:
        """Every env, the accepted signature, heads in lockstep: write one contiguous slot block per
        key and return ``True``; else ``False``, having written nothing."""
        if self._sig is None:
            return False
        sig, views = self._sig
        if type(info_dict) is not dict or len(info_dict) != len(sig):
            return False
        ring = self._ring
        h, _ = ring.lockstep_at or ring.lockstep()
        if h < 0:
            return False
        srcs = []
        owned = self._schema.owned
        try:
            for (key, v), want in zip(info_dict.items(), sig, strict=True):
                cls = type(v)
                if cls is np.ndarray:
                    if (key, cls, v.dtype, v.shape) != want:
                        return False
                    t = torch.from_numpy(v)
                elif cls is torch.Tensor:
                    if (key, cls, v.dtype, v.shape, v.device, v.requires_grad, v.layout) != want:
                        return False
                    t = v
                else:
                    return False
                if overlaps(t, owned):  # reads the storage: the checked path copies it first
                    return False
                srcs.append(t)
        except Exception:  # noqa: BLE001 - anything unusual: the checked path raises or copes
            return False
        dsts = self._slots.get(h)
        if dsts is None:
            dsts = [view.select(0, h) for view in views]
            if self.max_len <= 4096:
                self._slots[h] = dsts
        staging = self._staging
        with signals_held():  # commit: copies that cannot fail on checked, lossless inputs
            for dst, t in zip(dsts, srcs, strict=True):
                dst.copy_(t if t.device == dst.device else staging.to_device(t, "__lockstep__"))
            ring.step()
        return True

    # ------------------------------------------------------------------ get

    def get(self, n: int, out, keys):
        """``get(n, out=out, keys=keys)`` of every env, heads and counts in lockstep; ``None`` for
        anything else (nothing written)."""
        ring = self._ring
        h, c = ring.lockstep_at or ring.lockstep()
        if h < 0 or c <= 0 or not 0 < n < 2**31 or n * self.n_envs * 8 > PLAN_BYTES:
            return None  # a plan past the cache's bound: the checked path sizes outputs first
        if keys is not None:
            if type(keys) is list:
                keys = tuple(keys)
            elif type(keys) is not tuple:
                return None
        k = indexing.strided(c, self.action_block)
        if k > n:
            k = n
        try:
            plan = self._plans.get((n, h, k, keys), False)
        except TypeError:  # unhashable key names: the checked path says so
            return None
        if plan is False:
            plan = self._plan(n, h, k, keys)
        if not plan:
            return None if plan is None else {}
        if out is not None:
            outs = self._outs(out, plan, n, keys)
            return None if outs is None else self._gather(plan, outs)
        spares = self._outputs.kept()  # the large outputs' memory before this call
        try:
            return self._gather(plan, (None,) * len(plan))
        except (RuntimeError, torch.OutOfMemoryError, MemoryError):
            self._outputs.restore(spares)  # keeps none of this call's memory
            return None  # the checked path names the bytes

    def _gather(self, plan, outs) -> dict:
        """Per key of ``plan``, its rows gathered into ``outs``' tensor or, for ``None``, a fresh
        one (a small one allocated by the gather, a large one from :class:`Outputs`)."""
        result = {}
        for (key, shape, dtype, nbytes, src, idx, rows, word, nan, zero), o in zip(plan, outs, strict=True):
            if o is None and nbytes < self._keep_from:
                got = torch.index_select(src, 0, idx)
                o = got.view(shape) if word is None else got.view(dtype).view(shape)
            else:
                if o is None:
                    o = self._outputs.fresh(key, shape, dtype, nbytes)
                dst = o.view(rows) if word is None else o.view(rows).view(word)
                torch.index_select(src, 0, idx, out=dst)
            if nan:
                torch.nan_to_num(o, nan=0.0, out=o)
            if zero:
                o.narrow(1, 0, zero).zero_()
            result[key] = o
        return result

    def _outs(self, out, plan, n: int, keys) -> list | None:
        """``out``'s tensors for ``plan`` (of ``get(n, keys=keys)``), or ``None`` where the checked
        path must look at them (it raises for a bad one). Disjointness is checked once per set of
        addresses and output shapes (which ``n`` and ``keys`` fix)."""
        if type(out) is not dict:
            return None
        outs, ptrs = [], []
        device = self.device
        for key, shape, dtype, _, _, _, _, word, _, _ in plan:
            t = out.get(key)
            if (type(t) is not torch.Tensor or t.shape != shape or t.dtype != dtype
                    or t.device != device or t.requires_grad or not t.is_contiguous()):
                return None
            if word is not None and t.storage_offset() * t.element_size() % word.itemsize:
                return None
            outs.append(t)
            ptrs.append(t.data_ptr())
        seen = (tuple(ptrs), n, keys)
        if self._out_ok != seen:
            # raises as the checked path would, before any write
            self._schema.check_out(out, {p[0]: p[1] for p in plan})
            self._out_ok = seen
        return outs

    def _plan(self, n: int, h: int, k: int, keys):
        """Per key: ``(key, out shape, dtype, out bytes, source rows view, row indices,
        (rows, D) view shape, word dtype or None, NaN zeroing, leading zero blocks)``, for
        every env with write head ``h`` and ``k`` strided frames; ``None`` when this state
        takes the checked path (zero-width entries, unknown keys)."""
        schema = self._schema
        wanted = schema.wanted(keys) if keys is not None else None  # raises for unknown keys
        if not schema.data:
            return None
        E, ab, ml, device = self.n_envs, self.action_block, self.max_len, self.device
        newest = indexing.newest_slot(h, ml)
        env = torch.arange(E, device=device).view(-1, 1)
        indices = {}
        plan = []
        for key, shape in schema.output_shapes(E, n).items():
            if wanted is not None and key not in wanted:
                continue
            storage = schema.data[key]
            D = storage.shape[1]
            if D == 0:
                return None
            block = key in schema.block_keys
            rows = E * (n - 1) * ab if block else E * n
            word = gather_word(storage.dtype, D * storage.element_size())
            src = storage if word is None else storage.view(word)
            if block not in indices:
                back = indexing.block_back(n, ab, device) if block else indexing.frame_back(n, k, ab, device)
                indices[block] = indexing.source_rows(env, newest, back, E, ml)
            nbytes = rows * D * storage.element_size()
            nan = block and storage.dtype.is_floating_point
            plan.append((key, torch.Size(shape), storage.dtype, nbytes, src, indices[block],
                         (rows, D), word, nan, indexing.zero_blocks(n, k) if block else 0))
        plan = tuple(plan)
        nbytes = sum(t.numel() * 8 for t in indices.values())
        if self._plan_bytes + nbytes > PLAN_BYTES or len(self._plans) >= PLAN_ENTRIES:
            self._plans, self._plan_bytes = {}, 0  # bounded: start over
        self._plan_bytes += nbytes
        self._plans[(n, h, k, keys)] = plan
        return plan
