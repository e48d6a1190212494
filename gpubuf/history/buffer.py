"""HistoryBuffer: per-env ring buffers of batched info dicts, read back as strided histories.

Storage per key is one preallocated slot-major ``(max_len * n_envs, D)`` device tensor
(``D`` elements per entry); env ``e``'s ring slot ``s`` is row ``s * n_envs + e``, so envs in
lockstep write and read contiguous blocks. Write heads and counts live on the host
(the host already knows them), so ``append``/``get`` never read the device; per-call row metadata is
built there and uploaded with one non-blocking copy.

Every write is two-phase: each key is checked and staged on the device first
(where any conversion fails), then all keys are committed with copies that cannot fail on staged
data, then the host mirror moves.

Glossary: ``R`` envs selected by a call (``env_ids``); ``D`` elements per entry of a key; slot: a
ring position of an env (``max_len`` per env); head: the next slot an env writes; count: entries an
env holds; ``ab`` (``action_block``): entries per action block; strided: every ``ab``-th entry.
"""

import ctypes
import math
import sys
from collections.abc import Iterable, Mapping

import numpy as np
import torch

from gpubuf import ops
from gpubuf._core import checkpoint
from gpubuf._core.concurrency import CallGuard, locked
from gpubuf._core.copies import CopiedByState
from gpubuf._core.inputs import (
    STORABLE,
    as_index_array,
    as_tensor,
    check_cast,
    check_storable,
    lossless,
    positive_int,
)
from gpubuf._core.signals import signals_held
from gpubuf._core.staging import Staging, check_disjoint, memory_ranges, overlaps
from gpubuf._core.state import check_state, check_tensor, copy_into, host_tensor, unaliased

BLOCK_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8,
                torch.int8, torch.int16,
                # what action blocks may hold (NaN/inf are cleaned per dtype)
                torch.int32, torch.int64, torch.bool)


# index_select runs on these in their own dtype; other dtypes (and rows of 64 bytes or more, which
# move at memcpy speed as int words) are gathered through word views
_NATIVE = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8,
                     torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
                     torch.complex64, torch.complex128))
_WORDS = ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2), (torch.uint8, 1))
_BIG = 2 << 20  # fresh host outputs of at least this many bytes: reused when free, else huge pages
_SPARES = 2  # large outputs' memory kept per key for reuse
# the lockstep get's plans (one per (n, head, frames used, keys); a steady loop cycles through
# max_len heads) hold at most this many index bytes and entries, whatever n callers ask for
_PLAN_BYTES = 32 << 20
_PLAN_ENTRIES = 4096


def _madvise():
    """libc's ``madvise`` on Linux, else ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


_MADVISE = _madvise()
# references to a storage (tensors, views, numpy arrays and DLPack capsules over it all hold one);
# without it (another torch), large outputs are never reused
_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)  # noqa: SLF001
_MADV_HUGEPAGE = 14


def _advise_huge(t: torch.Tensor) -> None:
    """Ask for transparent huge pages under a fresh (untouched) host tensor: its first write then
    faults once per 2 MiB instead of once per 4 KiB. Advice only: a kernel that declines changes
    nothing."""
    if _MADVISE is None:
        return
    ptr, huge = t.data_ptr(), 2 << 20
    lo, hi = -(-ptr // huge) * huge, (ptr + t.numel() * t.element_size()) // huge * huge
    if hi > lo:
        _MADVISE(lo, hi - lo, _MADV_HUGEPAGE)


def _word(dtype: torch.dtype, row_bytes: int) -> torch.dtype | None:
    """The int word to gather rows of ``row_bytes`` through, or ``None``: the dtype itself."""
    if dtype in _NATIVE and row_bytes < 64:
        return None
    return next(w for w, size in _WORDS if row_bytes % size == 0)


def _new_storage_dtype(value, t: torch.Tensor) -> torch.dtype:
    """The dtype a key's storage takes from its first value: torch's default float dtype for a
    Python float (as ``torch.tensor(1.5)``), else the value's own dtype."""
    if isinstance(value, float):  # np.float64 is a float too: it keeps float64
        return t.dtype if isinstance(value, np.floating) else torch.get_default_dtype()
    return t.dtype


class HistoryBuffer(checkpoint.Checkpointable, CopiedByState):
    """Per-env ring buffer over batched info dicts with strided, warm-up padded reads.

    Args:
        n_envs: number of parallel envs (rows of every appended value).
        max_len: entries (env steps since the last reset) kept per env.
        action_block: stride between returned frames (frameskip of the planner).
        block_keys: keys returned as action blocks between frames (a bare string is a
            ``TypeError``); their values must be real floats (16 to 64 bits), ``uint8``, signed ints
            or bool.
        device: storage device; ``None`` -> ``cuda`` when available, else ``cpu``.

    ``append({'pixels': (n_envs, 1, H, W, C), 'action': (n_envs, 1, A)})`` stores one entry per env;
    ``get(n)`` returns ``pixels`` ``(n_envs, n, H, W, C)`` and ``action``
    ``(n_envs, n-1, action_block*A)``. Until an env has lived ``(n-1)*action_block+1`` steps its
    frames are left-padded with its oldest strided entry and its blocks with zero blocks
    (synthetic warm-up, as in stable-worldmodel).

    Threads: any number of threads may call any method at once; each call runs whole, between the
    others (:attr:`lock`; :mod:`gpubuf._core.concurrency`), so a planner thread's ``get`` never mixes two
    appends. ``copy.deepcopy``, ``pickle`` and ``torch.save`` give an independent, complete buffer
    (:mod:`gpubuf._core.copies`).
    """

    def __init__(self, n_envs: int, max_len: int, action_block: int = 1,
                 block_keys: Iterable[str] = (),
                 *, device=None):
        self.n_envs = positive_int("n_envs", n_envs)
        self.max_len = positive_int("max_len", max_len)
        self.action_block = positive_int("action_block", action_block)
        if isinstance(block_keys, (str, bytes)) or not isinstance(block_keys, Iterable):
            raise TypeError("block_keys: expected an iterable of key names such as ('action',), "
                            f"got {block_keys!r}")
        self.block_keys = tuple(block_keys)
        for key in self.block_keys:
            if not isinstance(key, str):
                raise TypeError(f"block_keys: expected str key names, got {key!r}")
        self.device = ops.resolve_device(device)
        self.backend = ops.backend_for(self.device)
        self._guard = CallGuard(self.device)
        self._counts = np.zeros(self.n_envs, dtype=np.int64)  # entries held per env (host mirror)
        self._heads = np.zeros(self.n_envs, dtype=np.int64)  # next ring slot per env (host mirror)
        self._all_ids = np.arange(self.n_envs, dtype=np.int64)
        # per-entry shape of each key, fixed by the first append
        self._shapes: dict[str, tuple] = {}
        self._data: dict[str, torch.Tensor] = {}  # key -> (max_len * n_envs, D)
        self._shape_cache: tuple = (None, {})  # ((rows, n), output shapes) of the last get
        self._sized_at: tuple = (None, None)  # (key, answer) of the last checked get's sizes
        # byte ranges of the storage: inputs reading them are copied before a write
        self._owned = ()
        self._staging = Staging(self.device)
        # steady state (torch backend): ``_lockstep_at`` = (common head or -1, common count or
        # -1), None when unknown; ``_sig`` the last accepted all-env append's input signature and
        # the storage views it writes; ``_plans`` lockstep get plans; ``_spare`` large outputs'
        # memory
        self._fast = self.backend == "torch"  # the Triton kernels keep their own launch paths
        self._lockstep_at = None
        self._sig = None
        self._slots: dict[int, list] = {}
        self._plans: dict = {}
        self._plan_bytes = 0
        self._out_ok = None
        self._spare: dict[str, list[torch.UntypedStorage]] = {}

    # ------------------------------------------------------------------ bookkeeping

    @locked
    def __len__(self) -> int:
        """The minimum entry count over all envs."""
        return int(self._counts.min())

    @property
    def lock(self):
        """The re-entrant lock every call holds: hold it to make several calls one step, as
        another thread sees them (``with history.lock: ...``)."""
        return self._guard.lock

    def copy_args(self) -> dict:
        """Constructor arguments of an empty buffer that this one's ``state_dict`` loads into."""
        return {"n_envs": self.n_envs, "max_len": self.max_len, "action_block": self.action_block,
                "block_keys": self.block_keys, "device": str(self.device)}

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(self._data)

    @property
    @locked
    def nbytes(self) -> int:
        """Device bytes held by the storage."""
        return sum(t.numel() * t.element_size() for t in self._data.values())

    @locked
    def num_strided(self, env_ids=None) -> list[int]:
        """Strided frames available per env: ``(L-1)//action_block + 1``, or 0 for an empty env."""
        ids = self._ids(env_ids)
        L = self._counts[ids]
        return np.where(L > 0, (L - 1) // self.action_block + 1, 0).tolist()

    # an opaque call under torch.compile: no guards on host state, no recompiles
    @torch.compiler.disable
    @locked
    def reset(self, env_ids=None) -> None:
        """Forget the listed envs' entries (all envs if ``None``; ``[]`` does nothing).

        Only the entry counts change: each env's ring position is kept, so its next entries
        overwrite its oldest slots first."""
        ids = self._ids(env_ids)
        self._counts[ids] = 0
        self._lockstep_at = None

    @locked
    def mark(self) -> tuple:
        """A token for :meth:`rollback`: the write heads, entry counts and (before the first append)
        the fact that no key is fixed yet. Host state only: taking it reads nothing from the
        device."""
        return self._heads.copy(), self._counts.copy(), bool(self._data)

    @locked
    def rollback(self, mark: tuple) -> None:
        """Undo the appends and resets made since :meth:`mark` returned ``mark``. A buffer that held
        no key then forgets the keys, shapes and dtypes its first append fixed
        (and frees their storage). Exact only if those appends overwrote no slot that is read again:
        keep a spare slot per env (``max_len`` one more than read, as :class:`gpubuf.Planner`
        does)."""
        heads, counts, had_keys = mark
        if not had_keys and self._data:
            self._set_storage({}, {})
        self._heads, self._counts = heads.copy(), counts.copy()
        self._lockstep_at = None

    def _ids(self, env_ids) -> np.ndarray:
        if env_ids is None:
            return self._all_ids
        return as_index_array(env_ids, "env_ids", self.n_envs)

    def _upload(self, arr: np.ndarray, key: str) -> torch.Tensor:
        return self._staging.to_device(torch.from_numpy(arr), key)

    # ------------------------------------------------------------------ append

    # an opaque call under torch.compile: no guards on host state, no recompiles
    @torch.compiler.disable
    @locked
    def append(self, info_dict: Mapping, env_ids=None) -> None:
        """Append one entry per selected env: values ``(R, T, ...)`` or ``(R,)``,
        ``R = len(env_ids)``.

        Row ``j`` goes to env ``env_ids[j]`` (all envs in order if ``None``); an env listed twice
        gets two entries, in row order. Numeric scalars are broadcast
        (a new key from a Python float takes torch's default float dtype, as ``torch.tensor(1.5)``
        does). Every check runs before any write.
        """
        if env_ids is None and self._sig is not None and self._append_lockstep(info_dict):
            return
        if not isinstance(info_dict, Mapping) or not info_dict:
            raise TypeError(f"info_dict: expected a non-empty dict of arrays, "
                            f"got {info_dict!r:.80}")
        ids = self._ids(env_ids)
        R = len(ids)
        values = {key: self._check_value(key, value, R) for key, value in info_dict.items()}
        if self._shapes:
            missing = [k for k in self._shapes if k not in values]
            extra = [k for k in values if k not in self._shapes]
            if missing or extra:
                raise ValueError(
                    f"info_dict: keys are fixed by the first append {list(self._shapes)}; "
                    f"missing {missing}, unexpected {extra}"
                )
            for key, t in values.items():
                self._check_against_spec(key, t)
        else:
            dtypes = {k: _new_storage_dtype(info_dict[k], t) for k, t in values.items()}
            for key, t in values.items():
                check_storable(dtypes[key], key)
                check_cast(t, dtypes[key], key)
            self._check_block_dtypes(dtypes, "info_dict")
        if R == 0:
            if not self._shapes:
                self._allocate(values, dtypes)
            return
        dst_rows, keep, heads, counts = self._plan_append(ids)
        # phase 1: stage every key (conversion errors happen here, before any write)
        keep_t = None if keep is None else torch.from_numpy(keep)
        staged = {}
        for key, t in values.items():
            rows = t.expand(R, *t.shape) if t.dim() == 0 else t
            if keep_t is not None:
                rows = rows[keep_t.to(rows.device)]
            dtype = self._data[key].dtype if self._data else dtypes[key]
            staged[key] = self._staging.stage(rows.reshape(len(dst_rows), -1), key, dtype,
                                              self._owned)
        dst = self._upload(dst_rows, "__dst_rows__")
        if not self._data:
            self._allocate(values, dtypes)
        with signals_held():  # phase 2: commit
            ops.history_append(self.backend,
                               [(self._data[key], rows) for key, rows in staged.items()], dst)
            self._heads, self._counts = heads, counts
            self._lockstep_at = None
        if env_ids is None and self.backend == "torch":
            self._sig = self._signature(info_dict, values)

    # ------------------------------------------------------------------ append: steady state

    def _signature(self, info_dict: Mapping, values: dict):
        """What an all-env append just accepted, as the lockstep path compares it: per key
        ``(key, type, dtype, shape[, device, requires_grad, layout])``, with the storage's
        slot-major view each key writes; ``None`` unless every value is a plain numpy array or
        dense tensor of rows ``(n_envs, *entry)`` whose cast into storage is lossless (others take
        the checked path every time)."""
        if type(info_dict) is not dict:
            return None
        sig, views = [], []
        for key, v in info_dict.items():
            t, storage = values[key], self._data[key]
            if type(v) is np.ndarray and v.dtype.isnative:
                sig.append((key, np.ndarray, v.dtype, v.shape))
            elif (type(v) is torch.Tensor and not v.requires_grad and not v.is_nested
                  and v.layout == torch.strided):
                sig.append((key, torch.Tensor, v.dtype, v.shape, v.device, False, v.layout))
            else:
                return None
            entry = self._shapes[key]
            if tuple(t.shape) != (self.n_envs, *entry) or not lossless(t.dtype, storage.dtype):
                return None
            views.append(storage.view(self.max_len, self.n_envs, *entry))
        self._slots = {}
        return tuple(sig), views

    def _append_lockstep(self, info_dict) -> bool:
        """The steady-state append: every env, the accepted signature, heads in lockstep. Writes
        one contiguous slot block per key and returns ``True``; returns ``False`` (having written
        nothing) for anything else, which then takes the checked path."""
        sig, views = self._sig
        if type(info_dict) is not dict or len(info_dict) != len(sig):
            return False
        h, c = self._lockstep_at or self._lockstep()
        if h < 0:
            return False
        srcs = []
        owned = self._owned
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
            h = (h + 1) % self.max_len
            self._heads.fill(h)
            counts = self._counts
            if c >= 0:
                if c < self.max_len:
                    c += 1
                    counts.fill(c)
            else:
                np.add(counts, 1, out=counts)
                np.minimum(counts, self.max_len, out=counts)
                first = counts[0]
                c = int(first) if (counts == first).all() else -1
            self._lockstep_at = (h, c)
        return True

    def _lockstep(self) -> tuple[int, int]:
        """``(head, count)`` shared by every env (-1 where they differ), cached in ``_lockstep_at``
        until anything but the lockstep paths moves the mirror."""
        heads, counts = self._heads, self._counts
        h, c = int(heads[0]), int(counts[0])
        self._lockstep_at = (h if (heads == h).all() else -1, c if (counts == c).all() else -1)
        return self._lockstep_at

    def _check_value(self, key, value, R: int) -> torch.Tensor:
        if not isinstance(key, str):
            raise TypeError(f"info_dict: keys must be str, got {key!r}")
        t = as_tensor(value, key)
        if t.dim() > 0 and t.shape[0] != R:
            raise ValueError(f"{key}: expected a leading env dim of {R} rows, got shape "
                             f"{tuple(t.shape)}")
        return t

    def _check_against_spec(self, key: str, t: torch.Tensor) -> None:
        shape, dtype = self._shapes[key], self._data[key].dtype
        if t.dim() > 0 and tuple(t.shape[1:]) != shape:
            raise ValueError(f"{key}: expected per-env shape {shape}, got {tuple(t.shape[1:])}")
        if t.dim() == 0 and shape != ():
            raise ValueError(f"{key}: a scalar cannot fill per-env shape {shape}")
        check_cast(t, dtype, key)

    def _check_block_dtypes(self, dtypes: dict, where: str, exc: type = TypeError) -> None:
        for key in self.block_keys:
            if key in dtypes and dtypes[key] not in BLOCK_DTYPES:
                raise exc(f"{where}[{key!r}]: a block key holds real floats (16 to 64 bits), "
                          "uint8, signed "
                                f"ints or bool, got {dtypes[key]}")

    def _allocate(self, values: dict, dtypes: dict) -> None:
        shapes = {k: tuple(t.shape[1:]) for k, t in values.items()}
        rows = self.n_envs * self.max_len
        storage_shapes = {k: (rows, int(np.prod(s))) for k, s in shapes.items()}
        self._set_storage(ops.allocate(storage_shapes, dtypes, self.device), shapes)

    def _set_storage(self, data: dict, shapes: dict) -> None:
        self._data, self._shapes = data, shapes
        self._shape_cache = (None, {})
        self._sized_at = (None, None)
        self._owned = memory_ranges(data.values())
        self._lockstep_at, self._sig, self._slots = None, None, {}
        self._plans, self._plan_bytes, self._out_ok, self._spare = {}, 0, None, {}

    def _plan_append(self, ids: np.ndarray):
        """Storage rows for each input row, which rows to keep (None = all), and the mirror's next
        heads and counts (committed by the caller once every key is written)."""
        mult = np.bincount(ids, minlength=self.n_envs)
        keep = None
        if mult.max() > 1:  # an env listed twice: entries go in row order
            order = np.argsort(ids, kind="stable")
            sorted_ids = ids[order]
            rank = np.empty_like(ids)
            rank[order] = np.arange(len(ids)) - np.searchsorted(sorted_ids, sorted_ids, "left")
            kept = rank >= mult[ids] - self.max_len  # older duplicates would be overwritten anyway
            if not kept.all():
                keep = np.flatnonzero(kept)
                ids, rank = ids[keep], rank[keep]
        else:
            rank = 0
        dst_rows = (self._heads[ids] + rank) % self.max_len * self.n_envs + ids
        heads = (self._heads + mult) % self.max_len
        counts = np.minimum(self._counts + mult, self.max_len)
        return dst_rows, keep, heads, counts

    # ------------------------------------------------------------------ get

    # an opaque call under torch.compile: no guards on host state, no recompiles
    @torch.compiler.disable
    @locked
    def get(self, n: int, env_ids=None, out: dict | None = None,
            keys=None) -> dict[str, torch.Tensor] | None:
        """The last ``n`` strided entries per selected env, oldest first; ``None`` if one is empty.

        Regular keys: ``(rows, n)`` for per-env shape ``()``, else ``(rows, n*T, ...)``. Block keys:
        ``(rows, n-1, action_block*D)``, omitted when ``n == 1``. ``keys``: an iterable of ``str``
        key names to fetch (``None``: every key; a key not stored raises ``ValueError`` naming
        ``keys``; a bare string, a non-iterable or a non-``str`` entry is a ``TypeError`` naming
        ``keys``): only those are gathered, so one key costs one key.
        ``out`` may hold tensors of exactly the returned shapes and dtypes on the buffer's device;
        they are written and returned.

        Memory: a get whose outputs (and, on the torch backend, row indices) exceed what the device
        has in all raises ``MemoryError`` naming ``n`` and the bytes before allocating anything; an
        allocation that fails raises the same, and the buffer keeps none of that call's memory.
        """
        if env_ids is None and type(n) is int and self._fast:
            got = self._get_lockstep(n, out, keys)
            if got is not None:
                return got
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise TypeError(f"n: expected an int, got {n!r}")
        ids = self._ids(env_ids)
        if n >= 2**31:
            raise ValueError(f"n: expected fewer than 2**31 frames per row, got {n}")
        wanted = self._wanted(keys)
        if n <= 0 or not self._data or (self._counts[ids] == 0).any():
            return None
        n, ab = int(n), self.action_block
        L = self._counts[ids]
        k = np.minimum(n, (L - 1) // ab + 1)
        newest = (self._heads[ids] - 1) % self.max_len
        shapes, sizes, what, nbytes = self._sized(len(ids), n, wanted, out is None)
        spares = self._spares_before(nbytes)
        try:
            if out is None:
                out = {key: self._fresh(key, shape, self._data[key].dtype, sizes[key])
                       for key, shape in shapes.items()}
            else:
                self._check_out(out, shapes)
            meta_np = np.empty((3, len(ids)), dtype=np.int64)
            meta_np[0], meta_np[1], meta_np[2] = ids, newest, k
            meta = self._upload(meta_np, "__meta__")
            frames = []
            for key in shapes:
                storage, dst = self._data[key], out[key]
                if key in self.block_keys:
                    ops.history_pack_blocks(self.backend, storage, meta, n, ab, self.max_len, dst)
                else:
                    frames.append((storage, dst))
            ops.history_gather_frames(self.backend, frames, meta, n, ab, self.max_len)
        except BaseException as err:
            if spares is not None:  # the memory of this call's outputs is not kept
                self._spare = spares
            if ops.allocation_failed(err):
                raise ops.memory_error("n", what, err) from None
            raise
        return {key: out[key] for key in shapes}

    def _sized(self, rows: int, n: int, wanted, fresh: bool) -> tuple:
        """``(shapes, sizes, what, bytes)`` of a checked get of ``n`` entries of ``rows`` rows and
        the keys ``wanted`` (``None``: all): output shapes and bytes per key, and what the call
        needs (:meth:`_needs`), checked to fit the device (``MemoryError`` naming ``n``, before any
        allocation). The last call's answer is kept: a planner asks the same every step."""
        key = (rows, n, wanted, fresh)
        if self._sized_at[0] == key:
            return self._sized_at[1]
        shapes = self._output_shapes(rows, n)  # cached per (rows, n)
        if wanted is not None:
            shapes = {k: shape for k, shape in shapes.items() if k in wanted}
        sizes = {k: math.prod(shape) * self._data[k].element_size() for k, shape in shapes.items()}
        what, nbytes = self._needs(shapes, sizes, n, rows, fresh)
        ops.check_fits("n", what, nbytes, self.device)
        self._sized_at = (key, (shapes, sizes, what, nbytes))
        return self._sized_at[1]

    def _needs(self, shapes: dict, sizes: dict, n: int, rows: int, fresh: bool) -> tuple:
        """``(what, bytes)`` a checked get of ``shapes`` (outputs of ``sizes`` bytes) needs on the
        device: its fresh outputs, plus, for the torch twins, their int64 row indices (a few arrays
        of one index per output row live at once); ``what()`` says so, for a ``MemoryError``."""
        out = sum(sizes.values()) if fresh else 0
        idx = 0
        if self.backend == "torch":
            frames = any(key not in self.block_keys for key in shapes)
            blocks = any(key in self.block_keys for key in shapes)
            idx = 3 * 8 * rows * (n * frames + (n - 1) * self.action_block * blocks)

        def what() -> str:
            said = f"get(n={n}) needs {out} bytes of output on {self.device}"
            return said + (f" (and {idx} bytes of row indices: {out + idx} in all)" if idx else "")

        return what, out + idx

    def _spares_before(self, nbytes: int) -> dict | None:
        """A copy of the large outputs' memory kept for reuse, taken before a call that may add to
        it (``None`` when the call's outputs are too small to be kept): restored when the call
        fails, so a failed get keeps none of its memory."""
        if nbytes < _BIG or self.device.type != "cpu":
            return None
        return {key: list(spares) for key, spares in self._spare.items()}

    # ------------------------------------------------------------------ get: steady state

    def _get_lockstep(self, n: int, out, keys):
        """The steady-state get: every env, heads and counts in lockstep, a plan (source rows per
        key) cached per ``(n, head, frames used, keys)``. ``None`` for anything else (nothing
        written), which then takes the checked path."""
        h, c = self._lockstep_at or self._lockstep()
        if h < 0 or c <= 0 or not 0 < n < 2**31 or n * self.n_envs * 8 > _PLAN_BYTES:
            return None  # a plan past the cache's bound: the checked path sizes outputs first
        if keys is not None:
            if type(keys) is list:
                keys = tuple(keys)
            elif type(keys) is not tuple:
                return None
        k = (c - 1) // self.action_block + 1
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
        result = {}
        if out is not None:
            outs = self._lockstep_out(out, plan, n, keys)
            if outs is None:
                return None
            for (key, _, _, _, src, idx, rows, word, nan, zero), o in zip(plan, outs, strict=True):
                dst = o.view(rows) if word is None else o.view(rows).view(word)
                torch.index_select(src, 0, idx, out=dst)
                if nan:
                    torch.nan_to_num(o, nan=0.0, out=o)
                if zero:
                    o.narrow(1, 0, zero).zero_()
                result[key] = o
            return result
        # the large outputs' memory before this call (empty unless outputs were large)
        spares = {key: list(kept) for key, kept in self._spare.items()} if self._spare else {}
        host = self.device.type == "cpu"
        try:
            for key, shape, dtype, nbytes, src, idx, rows, word, nan, zero in plan:
                if nbytes < _BIG or not host:  # a small output: the gather allocates it
                    got = torch.index_select(src, 0, idx)
                    o = got.view(shape) if word is None else got.view(dtype).view(shape)
                else:  # a large one reuses kept memory
                    o = self._fresh(key, shape, dtype, nbytes)
                    dst = o.view(rows) if word is None else o.view(rows).view(word)
                    torch.index_select(src, 0, idx, out=dst)
                if nan:
                    torch.nan_to_num(o, nan=0.0, out=o)
                if zero:
                    o.narrow(1, 0, zero).zero_()
                result[key] = o
        except (RuntimeError, torch.OutOfMemoryError, MemoryError):
            self._spare = spares  # keeps none of this call's memory
            return None  # the checked path names the bytes
        return result

    def _lockstep_out(self, out, plan, n: int, keys) -> list | None:
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
            self._check_out(out, {p[0]: p[1] for p in plan})
            self._out_ok = seen
        return outs

    def _plan(self, n: int, h: int, k: int, keys):
        """Per key: ``(key, out shape, dtype, out bytes, source rows view, row indices,
        (rows, D) view shape, word dtype or None, NaN zeroing, leading zero blocks)``, for
        every env with newest slot ``h - 1`` and ``k`` strided frames; ``None`` when this state
        takes the checked path (zero-width entries, unknown keys)."""
        wanted = self._wanted(keys) if keys is not None else None  # raises for unknown keys
        if not self._data:
            return None
        E, ab, ml = self.n_envs, self.action_block, self.max_len
        newest = (h - 1) % ml
        envs = np.arange(E, dtype=np.int64).reshape(E, 1)
        back = np.minimum(np.arange(n - 1, -1, -1), k - 1) * ab
        frame_idx = ((newest - back) % ml * E + envs).reshape(-1)
        blocks = (np.arange(n - 2, -1, -1).reshape(-1, 1) * ab
                  + np.arange(ab - 1, -1, -1)).reshape(-1)
        block_idx = ((newest - blocks) % ml * E + envs).reshape(-1)
        indices = {}
        plan = []
        for key, shape in self._output_shapes(E, n).items():
            if wanted is not None and key not in wanted:
                continue
            storage = self._data[key]
            D = storage.shape[1]
            if D == 0:
                return None
            block = key in self.block_keys
            rows = E * (n - 1) * ab if block else E * n
            word = _word(storage.dtype, D * storage.element_size())
            src = storage if word is None else storage.view(word)
            if block not in indices:
                idx = block_idx if block else frame_idx
                indices[block] = torch.from_numpy(idx).to(self.device)
            nbytes = rows * D * storage.element_size()
            nan = block and storage.dtype.is_floating_point
            plan.append((key, torch.Size(shape), storage.dtype, nbytes, src, indices[block],
                         (rows, D), word, nan, (n - k) if block else 0))
        plan = tuple(plan)
        nbytes = sum(t.numel() * 8 for t in indices.values())
        if self._plan_bytes + nbytes > _PLAN_BYTES or len(self._plans) >= _PLAN_ENTRIES:
            self._plans, self._plan_bytes = {}, 0  # bounded: start over
        self._plan_bytes += nbytes
        self._plans[(n, h, k, keys)] = plan
        return plan

    def _fresh(self, key: str, shape, dtype: torch.dtype, nbytes: int) -> torch.Tensor:
        """A new output tensor. A large host one reuses the memory of one of this key's last two
        large outputs once nothing else holds it (no tensor, view, numpy array or DLPack capsule:
        its storage's only reference is this buffer's, and it is not shared with another
        process); else it is fresh memory advised into huge pages, so that its first write does
        not fault per 4 KiB page."""
        if nbytes < _BIG or self.device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=self.device)
        spares = self._spare.setdefault(key, [])
        for spare in spares:
            if (_USE_COUNT is not None and spare.nbytes() == nbytes and not spare.is_shared()
                    and _USE_COUNT(spare._cdata) == 1):  # noqa: SLF001
                return torch.empty(0, dtype=dtype).set_(spare, 0, shape)
        t = torch.empty(shape, dtype=dtype)
        _advise_huge(t)
        spares.insert(0, t.untyped_storage())
        del spares[_SPARES:]  # a caller holding its last output still finds one free
        return t

    def _wanted(self, keys) -> frozenset | None:
        """The key names ``keys`` asks for (``None``: all), checked against the stored keys: a bare
        string (one name or many? ambiguous), a non-iterable, or an entry that is not a ``str`` is a
        ``TypeError``, a name not stored a ``ValueError``, all naming ``keys``."""
        if keys is None:
            return None
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable):
            raise TypeError("keys: expected an iterable of key names such as ('pixels',), got "
                            f"{keys!r:.80}")
        try:
            names = list(keys)
        except Exception as err:  # noqa: BLE001 - an iterable that fails while iterated
            raise TypeError(f"keys: could not iterate {type(keys).__name__} ({err})") from None
        bad = [k for k in names if not isinstance(k, str)]
        if bad:
            raise TypeError(f"keys: expected str key names such as ('pixels',), got {bad[0]!r:.80} "
                            f"({type(bad[0]).__name__})")
        wanted = frozenset(names)
        unknown = sorted(k for k in wanted if k not in self._shapes)
        if unknown and self._data:
            raise ValueError(f"keys: {unknown} are not stored; the keys are {list(self._shapes)}")
        return wanted

    def _output_shapes(self, rows: int, n: int) -> dict[str, tuple]:
        if self._shape_cache[0] == (rows, n):
            return self._shape_cache[1]
        shapes = {}
        for key, entry in self._shapes.items():
            if key in self.block_keys:
                if n > 1:
                    shapes[key] = (rows, n - 1, self.action_block * int(np.prod(entry)))
            elif entry == ():
                shapes[key] = (rows, n)
            else:
                shapes[key] = (rows, n * entry[0], *entry[1:])
        self._shape_cache = ((rows, n), shapes)
        return shapes

    def _check_out(self, out: dict, shapes: dict) -> None:
        for key, shape in shapes.items():
            t = out.get(key) if isinstance(out, Mapping) else None
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"out[{key!r}]: expected a tensor of shape {shape}, got "
                                 f"{type(t).__name__}")
            dtype = self._data[key].dtype
            if (tuple(t.shape) != shape or t.dtype != dtype or t.device != self.device
                    or not t.is_contiguous()):
                raise ValueError(
                    f"out[{key!r}]: expected a contiguous {dtype} tensor of shape {shape} on "
                    f"{self.device}, "
                    f"got {t.dtype} {tuple(t.shape)} on {t.device}"
                )
        check_disjoint({f"out[{k!r}]": out[k] for k in shapes}, self._owned)

    # ------------------------------------------------------------------ state

    _CONFIG = ("n_envs", "max_len", "action_block", "block_keys")

    @locked
    def state_dict(self) -> dict:
        """Configuration, data and counters: tensors and plain Python values only
        (``torch.load`` reads it with its defaults). Data tensors are the storage itself, not copies
        (as ``nn.Module.state_dict``): save or clone them before the buffer changes."""
        return {
            "buffer": type(self).__name__,
            "version": 1,
            "n_envs": self.n_envs,
            "max_len": self.max_len,
            "action_block": self.action_block,
            "block_keys": self.block_keys,
            "shapes": {k: s for k, s in self._shapes.items()},
            "data": dict(self._data),
            "counts": torch.from_numpy(self._counts.copy()),
            "heads": torch.from_numpy(self._heads.copy()),
        }

    @locked
    def load_state_dict(self, state) -> None:
        """Restore a :meth:`state_dict` (saved on any device). The whole state is validated first
        (buffer type, configuration, keys, shapes, dtypes, counters in range): a mismatch raises
        naming the key and leaves the buffer as it was. A buffer that has not stored anything yet
        takes the state's keys. The copy runs with Ctrl-C and timer signals held; should reading the
        data itself fail after validation (an I/O error on a checkpoint file), the buffer is emptied
        rather than left half-loaded."""
        template = self.state_dict()
        check_state(state, template, self._CONFIG + ("version",), skip=("shapes", "data"))
        shapes = self._check_state_layout(state)
        counts = host_tensor(state["counts"]).numpy().copy()
        heads = host_tensor(state["heads"]).numpy().copy()
        if counts.size and (counts.min() < 0 or counts.max() > self.max_len):
            raise ValueError(f"state_dict['counts']: expected entry counts in [0, {self.max_len}], "
                             "got "
                             f"[{counts.min()}, {counts.max()}]")
        if heads.size and (heads.min() < 0 or heads.max() >= self.max_len):
            raise ValueError(f"state_dict['heads']: expected ring heads in [0, {self.max_len}), "
                             "got "
                             f"[{heads.min()}, {heads.max()}]")
        if not shapes and counts.any():
            raise ValueError("state_dict['counts']: a state without keys holds no entries, got "
                             "nonzero counts")
        data = state["data"]
        if not self._data and shapes:
            storage = ops.allocate({k: tuple(data[k].shape) for k in shapes},
                                   {k: data[k].dtype for k in shapes},
                                   self.device)
        else:
            storage = self._data
        data = unaliased({k: data[k] for k in storage}, storage, self._owned)
        with signals_held():
            try:
                for key, t in storage.items():
                    copy_into(t, data[key])
            except BaseException:
                self._counts[:], self._heads[:] = 0, 0  # the data is half-read: forget every entry
                self._lockstep_at = None
                raise
            self._set_storage(storage, shapes)
            self._counts, self._heads = counts, heads

    def _check_state_layout(self, state) -> dict[str, tuple]:
        """The state's per-key entry shapes, checked against this buffer's
        (or, before its first append, against each other)."""
        shapes, data = state["shapes"], state["data"]
        if not isinstance(shapes, dict) or not isinstance(data, dict) or set(shapes) != set(data):
            raise ValueError("state_dict['shapes'], ['data']: expected dicts over the same keys")
        if not all(isinstance(k, str) for k in shapes):
            raise ValueError(f"state_dict['shapes']: expected str keys, got {list(shapes)!r:.120}")
        if not all(isinstance(s, (tuple, list)) for s in shapes.values()):
            raise ValueError("state_dict['shapes']: expected a shape tuple per key, got "
                             f"{shapes!r:.120}")
        shapes = {k: tuple(s) for k, s in shapes.items()}
        if self._shapes:
            if shapes != self._shapes:
                raise ValueError(f"state_dict['shapes']: expected {self._shapes}, got {shapes}")
            for key, t in self._data.items():
                check_tensor(f"state_dict['data'][{key!r}]", data[key], tuple(t.shape), t.dtype)
            return shapes
        rows = self.n_envs * self.max_len
        for key, shape in shapes.items():
            if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
                raise ValueError(f"state_dict['shapes'][{key!r}]: expected a shape, got {shape!r}")
            t = data[key]
            want = (rows, int(np.prod(shape)))
            dtype = getattr(t, "dtype", None)
            check_tensor(f"state_dict['data'][{key!r}]", t, want,
                         dtype if isinstance(dtype, torch.dtype) else None)
        for key in shapes:
            if data[key].dtype not in STORABLE:
                raise ValueError(f"state_dict['data'][{key!r}]: buffers cannot store "
                                 f"{data[key].dtype}")
        self._check_block_dtypes({k: data[k].dtype for k in shapes}, "state_dict['data']",
                                 ValueError)
        return shapes
