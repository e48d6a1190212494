"""The keys of a history buffer: per-key entry shapes and storage, fixed by the first append, and the
checks against them (appended values, ``keys=``, ``out=``, a loaded state) with the output shapes
and sizes of a read. Host-side checks only: nothing here reads the device."""

import math
from collections.abc import Iterable, Mapping

import numpy as np
import torch

from gpubuf import ops
from gpubuf._core.inputs import STORABLE, as_tensor, check_cast, check_storable
from gpubuf._core.staging import check_disjoint, memory_ranges
from gpubuf._core.state import check_tensor

# what action blocks may hold (NaN/inf are cleaned per dtype)
BLOCK_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16,
                torch.int32, torch.int64, torch.bool)


def block_key_names(block_keys) -> tuple[str, ...]:
    """``block_keys`` as a tuple of names; a bare string or a non-``str`` entry is a ``TypeError``."""
    if isinstance(block_keys, (str, bytes)) or not isinstance(block_keys, Iterable):
        raise TypeError(f"block_keys: expected an iterable of key names such as ('action',), got {block_keys!r}")
    names = tuple(block_keys)
    for key in names:
        if not isinstance(key, str):
            raise TypeError(f"block_keys: expected str key names, got {key!r}")
    return names


def _new_storage_dtype(value, t: torch.Tensor) -> torch.dtype:
    """The dtype a key's storage takes from its first value: torch's default float dtype for a
    Python float (as ``torch.tensor(1.5)``), else the value's own dtype."""
    if isinstance(value, float):  # np.float64 is a float too: it keeps float64
        return t.dtype if isinstance(value, np.floating) else torch.get_default_dtype()
    return t.dtype


class Schema:
    """Per key: the entry shape ``shapes[key]`` and the storage ``data[key]`` ``(max_len * n_envs, D)`` (``D`` elements
    per entry); ``owned``: the storage's byte ranges; ``table``: the device's backend table."""

    def __init__(self, n_envs: int, max_len: int, action_block: int, block_keys: tuple, table):
        self.n_envs, self.max_len, self.action_block = n_envs, max_len, action_block
        self.block_keys, self.device, self.table = block_keys, table.device, table
        self.shapes: dict[str, tuple] = {}
        self.data: dict[str, torch.Tensor] = {}
        self.owned = ()
        self._shape_cache: tuple = (None, {})  # ((rows, n), output shapes) of the last read
        self._sized_at: tuple = (None, None)  # (key, answer) of the last checked read's sizes

    def set_storage(self, data: dict, shapes: dict) -> None:
        """Take ``data`` (key -> storage) with entry ``shapes`` (``{}, {}``: no key fixed)."""
        self.data, self.shapes = data, shapes
        self._shape_cache = (None, {})
        self._sized_at = (None, None)
        self.owned = memory_ranges(data.values())

    def new_storage(self, values: dict, dtypes: dict) -> tuple[dict, dict]:
        """``(data, shapes)`` for the keys of a first append's checked ``values`` ``(R, *entry)``,
        for :meth:`set_storage`."""
        shapes = {k: tuple(t.shape[1:]) for k, t in values.items()}
        rows = self.n_envs * self.max_len
        storage_shapes = {k: (rows, int(np.prod(s))) for k, s in shapes.items()}
        return ops.allocate(storage_shapes, dtypes, self.device), shapes

    # ------------------------------------------------------------------ appended values

    def check_values(self, info_dict: Mapping, R: int) -> tuple[dict, dict | None]:
        """``(values, dtypes)``: ``info_dict``'s values as tensors ``(R, ...)`` or scalars, checked
        against the fixed keys (``dtypes`` ``None``) or, on a first append, against each other
        (``dtypes``: the storage dtype each new key takes)."""
        values = {key: self._check_value(key, value, R) for key, value in info_dict.items()}
        if self.shapes:
            missing = [k for k in self.shapes if k not in values]
            extra = [k for k in values if k not in self.shapes]
            if missing or extra:
                raise ValueError(f"info_dict: keys are fixed by the first append {list(self.shapes)}; "
                                 f"missing {missing}, unexpected {extra}")
            for key, t in values.items():
                self._check_against_spec(key, t)
            return values, None
        dtypes = {k: _new_storage_dtype(info_dict[k], t) for k, t in values.items()}
        for key, t in values.items():
            check_storable(dtypes[key], key)
            check_cast(t, dtypes[key], key)
        self.check_block_dtypes(dtypes, "info_dict")
        return values, dtypes

    def _check_value(self, key, value, R: int) -> torch.Tensor:
        if not isinstance(key, str):
            raise TypeError(f"info_dict: keys must be str, got {key!r}")
        t = as_tensor(value, key)
        if t.dim() > 0 and t.shape[0] != R:
            raise ValueError(f"{key}: expected a leading env dim of {R} rows, got shape {tuple(t.shape)}")
        return t

    def _check_against_spec(self, key: str, t: torch.Tensor) -> None:
        shape, dtype = self.shapes[key], self.data[key].dtype
        if t.dim() > 0 and tuple(t.shape[1:]) != shape:
            raise ValueError(f"{key}: expected per-env shape {shape}, got {tuple(t.shape[1:])}")
        if t.dim() == 0 and shape != ():
            raise ValueError(f"{key}: a scalar cannot fill per-env shape {shape}")
        check_cast(t, dtype, key)

    def check_block_dtypes(self, dtypes: dict, where: str, exc: type = TypeError) -> None:
        for key in self.block_keys:
            if key in dtypes and dtypes[key] not in BLOCK_DTYPES:
                raise exc(f"{where}[{key!r}]: a block key holds real floats (16 to 64 bits), uint8, signed ints or "
                          f"bool, got {dtypes[key]}")

    # ------------------------------------------------------------------ reads

    def wanted(self, keys) -> frozenset | None:
        """The key names ``keys`` asks for (``None``: all), checked against the stored keys: a bare
        string (one name or many? ambiguous), a non-iterable, or an entry that is not a ``str`` is a
        ``TypeError``, a name not stored a ``ValueError``, all naming ``keys``."""
        if keys is None:
            return None
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable):
            raise TypeError(f"keys: expected an iterable of key names such as ('pixels',), got {keys!r:.80}")
        try:
            names = list(keys)
        except Exception as err:  # noqa: BLE001 - an iterable that fails while iterated
            raise TypeError(f"keys: could not iterate {type(keys).__name__} ({err})") from None
        bad = [k for k in names if not isinstance(k, str)]
        if bad:
            raise TypeError(f"keys: expected str key names such as ('pixels',), got {bad[0]!r:.80} "
                            f"({type(bad[0]).__name__})")
        wanted = frozenset(names)
        unknown = sorted(k for k in wanted if k not in self.shapes)
        if unknown and self.data:
            raise ValueError(f"keys: {unknown} are not stored; the keys are {list(self.shapes)}")
        return wanted

    def output_shapes(self, rows: int, n: int) -> dict[str, tuple]:
        """Per key, the shape a read of ``n`` frames of ``rows`` rows returns (block keys: none when ``n == 1``)."""
        if self._shape_cache[0] == (rows, n):
            return self._shape_cache[1]
        shapes = {}
        for key, entry in self.shapes.items():
            if key in self.block_keys:
                if n > 1:
                    shapes[key] = (rows, n - 1, self.action_block * int(np.prod(entry)))
            elif entry == ():
                shapes[key] = (rows, n)
            else:
                shapes[key] = (rows, n * entry[0], *entry[1:])
        self._shape_cache = ((rows, n), shapes)
        return shapes

    def sized(self, rows: int, n: int, wanted, fresh: bool) -> tuple:
        """``(shapes, sizes, what, bytes)`` of a checked get of ``n`` entries of ``rows`` rows and
        the keys ``wanted`` (``None``: all): output shapes and bytes per key, and what the call
        needs (:meth:`_needs`), checked to fit the device (``MemoryError`` naming ``n``, before any
        allocation). The last call's answer is kept: a planner asks the same every step."""
        key = (rows, n, wanted, fresh)
        if self._sized_at[0] == key:
            return self._sized_at[1]
        shapes = self.output_shapes(rows, n)  # cached per (rows, n)
        if wanted is not None:
            shapes = {k: shape for k, shape in shapes.items() if k in wanted}
        sizes = {k: math.prod(shape) * self.data[k].element_size() for k, shape in shapes.items()}
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
        if not self.table.kernels:
            frames = any(key not in self.block_keys for key in shapes)
            blocks = any(key in self.block_keys for key in shapes)
            idx = 3 * 8 * rows * (n * frames + (n - 1) * self.action_block * blocks)
        device = self.device  # the kept answer must not hold the schema (a cycle through _sized_at)

        def what() -> str:
            said = f"get(n={n}) needs {out} bytes of output on {device}"
            return said + (f" (and {idx} bytes of row indices: {out + idx} in all)" if idx else "")

        return what, out + idx

    def check_out(self, out: dict, shapes: dict) -> None:
        """Raise ``ValueError`` naming the key unless ``out`` holds, per key of ``shapes``, a contiguous tensor of that
        shape and the storage's dtype on the device, none overlapping another or the storage."""
        for key, shape in shapes.items():
            t = out.get(key) if isinstance(out, Mapping) else None
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"out[{key!r}]: expected a tensor of shape {shape}, got {type(t).__name__}")
            dtype = self.data[key].dtype
            if tuple(t.shape) != shape or t.dtype != dtype or t.device != self.device or not t.is_contiguous():
                raise ValueError(f"out[{key!r}]: expected a contiguous {dtype} tensor of shape {shape} on "
                                 f"{self.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
        check_disjoint({f"out[{k!r}]": out[k] for k in shapes}, self.owned)

    # ------------------------------------------------------------------ state

    def check_state_layout(self, state) -> dict[str, tuple]:
        """The state's per-key entry shapes, checked against this buffer's
        (or, before its first append, against each other)."""
        shapes, data = state["shapes"], state["data"]
        if not isinstance(shapes, dict) or not isinstance(data, dict) or set(shapes) != set(data):
            raise ValueError("state_dict['shapes'], ['data']: expected dicts over the same keys")
        if not all(isinstance(k, str) for k in shapes):
            raise ValueError(f"state_dict['shapes']: expected str keys, got {list(shapes)!r:.120}")
        if not all(isinstance(s, (tuple, list)) for s in shapes.values()):
            raise ValueError(f"state_dict['shapes']: expected a shape tuple per key, got {shapes!r:.120}")
        shapes = {k: tuple(s) for k, s in shapes.items()}
        if self.shapes:
            if shapes != self.shapes:
                raise ValueError(f"state_dict['shapes']: expected {self.shapes}, got {shapes}")
            for key, t in self.data.items():
                check_tensor(f"state_dict['data'][{key!r}]", data[key], tuple(t.shape), t.dtype)
            return shapes
        rows = self.n_envs * self.max_len
        for key, shape in shapes.items():
            if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
                raise ValueError(f"state_dict['shapes'][{key!r}]: expected a shape, got {shape!r}")
            t = data[key]
            want = (rows, int(np.prod(shape)))
            dtype = getattr(t, "dtype", None)
            check_tensor(f"state_dict['data'][{key!r}]", t, want, dtype if isinstance(dtype, torch.dtype) else None)
        for key in shapes:
            if data[key].dtype not in STORABLE:
                raise ValueError(f"state_dict['data'][{key!r}]: buffers cannot store {data[key].dtype}")
        self.check_block_dtypes({k: data[k].dtype for k in shapes}, "state_dict['data']", ValueError)
        return shapes
