"""Argument validation and conversion shared by every public method.

Inputs may be torch tensors (any device), numpy arrays (any byte order), ``__dlpack__`` arrays or numeric scalars. Every
function here raises an exception that names the argument, before anything is written."""

import math
import numbers

import numpy as np
import torch

_PY_SCALARS = (bool, int, float, np.bool_, np.number)


def as_tensor(value, name: str) -> torch.Tensor:
    """A dense torch view of ``value`` (no copy where possible); numeric scalars become 0-d tensors.

    Non-native byte order (big-endian numpy data) is converted to native order here (a copy). Raises ``TypeError``
    naming ``name`` for strings, lists, other non-numeric objects, sparse and meta tensors."""
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.device.type == "meta" or value.is_nested:
            kind = "nested" if value.is_nested else value.layout
            raise TypeError(f"{name}: expected a dense tensor with data, got a {kind} tensor on {value.device}")
        return value
    if isinstance(value, np.ma.MaskedArray):
        raise TypeError(f"{name}: a masked array has no values where it is masked; pass .filled(...) or .data")
    if isinstance(value, np.ndarray):
        # long double: torch has none
        wide = value.dtype.itemsize > {"f": 8, "c": 16}.get(value.dtype.kind, 8)
        if value.dtype.kind not in "biufc" or wide:
            raise TypeError(f"{name}: expected a numeric array of a dtype torch has, got a numpy array of dtype "
                            f"{value.dtype}")
        if not value.dtype.isnative:
            value = value.astype(value.dtype.newbyteorder("="))
        return torch.from_numpy(value if value.flags.c_contiguous else np.ascontiguousarray(value))
    if isinstance(value, _PY_SCALARS) or (isinstance(value, numbers.Number) and not isinstance(value, complex)):
        if isinstance(value, np.generic):
            return as_tensor(np.asarray(value), name)
        return _python_scalar(value, name)
    if hasattr(value, "__dlpack__"):
        try:
            return torch.from_dlpack(value)
        except (RuntimeError, TypeError, BufferError) as err:
            raise TypeError(f"{name}: could not read the __dlpack__ array ({err})") from err
    raise TypeError(f"{name}: expected a torch tensor, numpy array, __dlpack__ array or numeric scalar, got "
                    f"{type(value).__name__}")


def _python_scalar(value, name: str) -> torch.Tensor:
    """A Python ``bool`` as bool, ``int`` as int64 and any other real number as float64 (0-d tensors).

    The widest types keep the value exactly, so a later narrowing into the stored dtype is checked on the value
    (``1e300`` into ``float32`` storage is rejected rather than stored as ``inf``)."""
    if isinstance(value, bool):
        return torch.tensor(value)
    if isinstance(value, numbers.Integral):
        if not -(2**63) <= int(value) < 2**63:
            raise TypeError(f"{name}: the integer {value} does not fit int64")
        return torch.tensor(int(value), dtype=torch.int64)
    return torch.tensor(float(value), dtype=torch.float64)


def as_flags(value, name: str, shape: tuple) -> np.ndarray:
    """Host bool flags of exactly ``shape`` from bools or integers 0/1; anything else (floats such as 0.5, other
    integers, strings) is a ``TypeError``/``ValueError`` naming ``name``."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    arr = np.asarray(value)
    if arr.shape != shape:
        raise ValueError(f"{name}: expected flags of shape {shape}, got shape {arr.shape}")
    if arr.dtype == np.bool_:
        return arr
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected bool flags (or integers 0/1), got {arr.dtype}")
    if arr.size and not ((arr == 0) | (arr == 1)).all():
        raise ValueError(f"{name}: expected flags 0 or 1, got {np.unique(arr[(arr != 0) & (arr != 1)])[:5].tolist()}")
    return arr.astype(bool)


def check_flags(t: torch.Tensor, name: str) -> None:
    """Raise unless tensor ``t`` holds flags: bool, or host integers that are all 0 or 1
    (a device integer tensor is not read back: pass bool)."""
    if t.dtype == torch.bool:
        return
    if t.dtype.is_floating_point or t.dtype.is_complex or t.device.type != "cpu":
        raise TypeError(f"{name}: expected bool flags (or host integers 0/1), got {t.dtype} on {t.device}")
    as_flags(t, name, tuple(t.shape))


def positive_int(name: str, value) -> int:
    """``value`` as an int >= 1, else ``ValueError`` naming ``name`` (bools and floats are rejected)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return int(value)


def finite_float(name: str, value, low: float = -math.inf, low_open: bool = False) -> float:
    """``value`` as a finite float ``>= low`` (``> low`` when ``low_open``), else ``ValueError`` naming ``name``."""
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    if ok:
        value = float(value)
        ok = math.isfinite(value) and (value > low if low_open else value >= low)
    if not ok:
        bound = "" if low == -math.inf else f" {'>' if low_open else '>='} {low:g}"
        raise ValueError(f"{name}: expected a finite number{bound}, got {value!r}")
    return value


def as_index_array(ids, name: str, size: int) -> np.ndarray:
    """Host int64 ids in ``[0, size)``; negatives index from the end as in Python.

    Raises ``TypeError`` for non-integer ids and ``IndexError`` for out-of-range ones."""
    if isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"{name}: expected a 1-D sequence of ints, got a {ids.dtype} tensor")
        ids = ids.detach().cpu().numpy()  # reads the device: pass host ids on the hot path
    arr = np.asarray(ids)
    if arr.size == 0 and arr.ndim == 1:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu" or arr.ndim != 1:
        raise TypeError(f"{name}: expected a 1-D sequence of ints, got {arr.dtype} array of shape {arr.shape}")
    bad = (arr >= size) if arr.dtype.kind == "u" else (arr < -size) | (arr >= size)
    if bad.any():
        raise IndexError(f"{name}: ids must lie in [-{size}, {size}), got {arr[bad][:5].tolist()}")
    arr = arr.astype(np.int64, copy=False)
    return np.where(arr < 0, arr + size, arr)


def env_ids_or_all(env_ids, all_ids: np.ndarray) -> np.ndarray:
    """``all_ids`` (every env, ``arange(n_envs)`` int64, returned as is) for ``env_ids=None``, else
    ``env_ids`` checked by :func:`as_index_array` as ``env_ids`` of ``len(all_ids)`` envs."""
    if env_ids is None:
        return all_ids
    return as_index_array(env_ids, "env_ids", len(all_ids))


# ---------------------------------------------------------------- value-preserving casts

STORABLE = (torch.bool, torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.int8, torch.int16, torch.int32,
            torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn,
            torch.float8_e5m2, torch.complex32, torch.complex64, torch.complex128)


def check_storable(dtype: torch.dtype, name: str) -> None:
    """Raise ``TypeError`` naming ``name`` unless buffers can store ``dtype`` (the sub-byte, exponent-only and ``fnuz``
    float types cannot: they have no sign, no zero or no infinity to keep values by)."""
    if dtype not in STORABLE:
        raise TypeError(f"{name}: buffers store bool, (u)int8 to 64, float16, bfloat16, float32, float64, "
                        f"float8_e4m3fn, float8_e5m2 and complex values, got {dtype}")


def dtype_kind(dtype: torch.dtype) -> str:
    """``"bool"``, ``"integer"``, ``"float"`` or ``"complex"``: what values a dtype holds."""
    if dtype == torch.bool:
        return "bool"
    return "complex" if dtype.is_complex else "float" if dtype.is_floating_point else "integer"


def _leaf_dtypes(arg: str, mapping, leaves: dict, given: str):
    """``(name, where, dtype)`` of each entry of a constructor's ``{leaf name: torch.dtype}`` argument ``arg``, checked:
    a dict, known leaf names (``leaves``: ``{name: dtype}`` of ``given``, for messages), storable torch dtypes."""
    if not isinstance(mapping, dict):
        raise TypeError(f"{arg}: expected a dict {{leaf name: torch.dtype}}, got {type(mapping).__name__}")
    for name, dtype in mapping.items():
        where = f"{arg}[{name!r}]"
        if name not in leaves:
            raise ValueError(f"{arg}: {name!r} is not a leaf of {given}; its leaves are {list(leaves)}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"{where}: expected a torch.dtype, got {type(dtype).__name__} {dtype!r}")
        check_storable(dtype, where)
        yield name, where, dtype


def check_storage_dtypes(storage_dtypes, leaves: dict, given: str = "data_sample") -> dict:
    """``{leaf name: storage dtype}`` of a constructor's ``storage_dtypes`` (``None``: ``{}``), checked against
    ``leaves`` ``{name: dtype}`` of ``given`` (what fixed them, for messages): a known leaf, a storable dtype of the
    leaf's kind (a float leaf may be stored as any float dtype, an integer leaf as any integer dtype; a bool leaf only
    as bool)."""
    chosen = {}
    for name, where, dtype in _leaf_dtypes("storage_dtypes", storage_dtypes or {}, leaves, given):
        kind, have = dtype_kind(dtype), dtype_kind(leaves[name])
        if kind != have:
            raise ValueError(f"{where}: a {kind} dtype ({dtype}) cannot store the {have} leaf {name} "
                             f"({leaves[name]}); its storage dtype must be {have} too")
        chosen[name] = dtype
    return chosen


def check_sample_dtypes(sample_dtypes, stored: dict) -> dict:
    """``{leaf name: dtype}`` of a constructor's ``sample_dtypes`` (``None``: ``{}``): for leaves of storage dtypes
    ``stored`` ``{name: dtype}``, a dtype that holds every stored value (``bfloat16`` -> ``float32``, not
    ``float16``)."""
    wanted = {}
    for name, where, dtype in _leaf_dtypes("sample_dtypes", sample_dtypes or {}, stored, "the stored leaves"):
        if not lossless(stored[name], dtype) or dtype_kind(dtype) != dtype_kind(stored[name]):
            raise ValueError(f"{where}: {dtype} cannot hold every value of the leaf's storage dtype "
                             f"{stored[name]}; ask for a wider dtype of its kind")
        wanted[name] = dtype
    return wanted


def _int_range(dtype: torch.dtype) -> tuple[int, int]:
    return (0, 1) if dtype == torch.bool else (torch.iinfo(dtype).min, torch.iinfo(dtype).max)


def _exact_ints(dtype: torch.dtype) -> int:
    """The largest n such that every integer in [-n, n] is exact in float ``dtype``."""
    return 2 ** round(1 - math.log2(torch.finfo(dtype).eps))


def _float_lossless(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether float ``dst`` has at least the precision, range and smallest normal of float ``src``."""
    a, b = torch.finfo(src), torch.finfo(dst)
    return b.eps <= a.eps and b.max >= a.max and b.smallest_normal <= a.smallest_normal


def _real(dtype: torch.dtype) -> torch.dtype:
    """The component dtype of a complex ``dtype`` (``dtype`` itself when real)."""
    return {torch.complex32: torch.float16, torch.complex64: torch.float32,
            torch.complex128: torch.float64}.get(dtype, dtype)


def lossless(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether every value of ``src`` is exactly representable in ``dst`` (no value check needed)."""
    if src == dst or src == torch.bool:
        return True
    if src.is_complex:
        return dst.is_complex and _float_lossless(_real(src), _real(dst))
    if dst.is_complex:
        return lossless(src, _real(dst))
    if src.is_floating_point:
        return dst.is_floating_point and _float_lossless(src, dst)
    lo, hi = _int_range(src)
    if dst.is_floating_point:
        return max(-lo, hi) <= _exact_ints(dst)
    dlo, dhi = _int_range(dst)
    return dlo <= lo and hi <= dhi


def _int_extremes(t: torch.Tensor) -> tuple[int, int]:
    """Exact ``(min, max)`` of a non-empty host integer tensor of any width or signedness."""
    a = t.numpy()
    return int(a.min()), int(a.max())


def _float_overflow(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """() bool: whether a finite value (or component) of float/complex ``t`` exceeds the largest finite ``dtype``."""
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    if t.dtype not in (torch.float32, torch.float64):
        t = t.to(torch.float32)
    big = torch.finfo(_real(dtype)).max
    return (torch.isfinite(t) & (t.abs() > big)).any()


def cast_refusal(src: torch.dtype, dtype: torch.dtype) -> str | None:
    """Why storing ``src`` values as ``dtype`` is refused whatever the values (``None``: it depends on them, or
    never)."""
    if (src.is_floating_point or src.is_complex) and not (dtype.is_floating_point or dtype.is_complex):
        return f"{'complex' if src.is_complex else 'float'} into an integer dtype"
    if src.is_complex and not dtype.is_complex:
        return "complex into a real dtype"
    return None


def cast_keeps_values(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """() bool on ``t``'s device, read by nothing: whether storing ``t`` (a cast :func:`check_cast` checks on the
    values, neither lossless nor refused) as ``dtype`` keeps its values, by :func:`check_cast`'s rules, so a
    capturable write can check it on the device."""
    if t.is_floating_point() or t.is_complex():  # float -> narrower float
        ok = ~_float_overflow(t, dtype)
        if dtype == torch.float8_e4m3fn:
            ok = ok & ~torch.isinf(t.to(torch.float32)).any()
        return ok
    ok = None
    if t.dtype in (torch.uint16, torch.uint32, torch.uint64):  # compared as int64 (torch compares few unsigned types)
        if t.dtype == torch.uint64:  # values from 2**63 on read negative: beyond every narrower type's exact range
            t = t.view(torch.int64)
            ok = (t >= 0).all()
        else:
            t = t.to(torch.int64)
    src_lo, src_hi = _int_range(t.dtype)
    if dtype.is_floating_point or dtype.is_complex:  # integer -> float
        lo, hi = -_exact_ints(_real(dtype)), _exact_ints(_real(dtype))
    else:  # integer -> narrower integer
        lo, hi = _int_range(dtype)
    fits = ((t >= max(lo, src_lo)) & (t <= min(hi, src_hi))).all()
    return fits if ok is None else ok & fits


def check_cast(t: torch.Tensor, dtype: torch.dtype, name: str, read_device: bool = False) -> None:
    """Raise ``TypeError`` naming ``name`` unless storing ``t`` as ``dtype`` keeps its values.

    Casts that keep every value of the source type (``lossless``) pass without looking at the data.
    Other casts are checked on the values when ``t`` is on the host (one pass over the input):

    - integer -> narrower integer or bool: every value within the stored type's range;
    - integer -> float or complex: every ``|value|`` small enough to be exact (``<= 2**24`` for ``float32``);
    - float -> narrower float (complex -> narrower complex): no finite value (component) larger than the stored type's
      largest finite value. Rounding to the nearest representable value is accepted, as every float pipeline does
      (``float64`` rewards stored as ``float32``), and so is a tiny value that rounds to zero; ``nan`` and ``inf`` stay
      what they are (``inf`` into ``float8_e4m3fn``, which has no infinity, is rejected).

    Always rejected: float or complex -> integer or bool, complex -> real, and, unless ``read_device`` (a leaf whose
    storage dtype was chosen narrower on purpose: the check reads the device once), any cast that is not lossless
    for a tensor on a GPU (checking it would read the device; cast it yourself with ``.to``)."""
    src = t.dtype
    if lossless(src, dtype):
        return
    why = cast_refusal(src, dtype)
    if why is None and t.device.type != "cpu" and not read_device:
        why = (f"a narrowing cast of a {t.device.type} tensor is not checked (it would read the device); "
               f"cast it with .to({dtype}) first")
    elif why is None and t.numel():
        if src.is_floating_point or src.is_complex:  # float -> narrower float
            big = torch.finfo(_real(dtype)).max
            why = f"a finite value exceeds the largest {dtype} ({big:g})" if bool(_float_overflow(t, dtype)) else None
            if why is None and dtype == torch.float8_e4m3fn and bool(torch.isinf(t.to(torch.float32)).any()):
                why = f"{dtype} has no infinity (it would store {big:g})"
        else:
            vmin, vmax = _int_extremes(t)
            if dtype.is_floating_point or dtype.is_complex:  # integer -> float
                lo, hi = -_exact_ints(_real(dtype)), _exact_ints(_real(dtype))
            else:  # integer -> narrower integer
                lo, hi = _int_range(dtype)
            why = None if lo <= vmin and vmax <= hi else f"values [{vmin}, {vmax}] do not fit [{lo}, {hi}] exactly"
    if why:
        raise TypeError(f"{name}: cannot store {src} in the stored dtype {dtype} without changing values ({why})")


def check_bool(name: str, value) -> bool:
    """A flag as a Python bool: ``True``/``False`` (or numpy's); anything else (``"no"``, ``0``, ``1.0``, ``None``)
    raises ``TypeError`` naming ``name``, where its truthiness would silently pick a branch."""
    if type(value) is bool:
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    raise TypeError(f"{name}: expected a bool, got {value!r} ({type(value).__name__})")


def is_int(value) -> bool:
    """A Python or numpy int, not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def int_seed(name: str, value) -> int:
    """An int seed as ``torch.Generator.manual_seed`` takes it, in ``[-2**63, 2**64)``; else ``TypeError`` or
    ``ValueError`` naming ``name``."""
    if not is_int(value):
        raise TypeError(f"{name}: expected an int seed or None, got {type(value).__name__}")
    if not -(2**63) <= int(value) < 2**64:
        raise ValueError(f"{name}: an int seed must lie in [-2**63, 2**64), got {value}")
    return int(value)


def generator_for(key, default: torch.Generator) -> torch.Generator:
    """The generator a sampling ``key`` names: ``None`` -> ``default``, a ``torch.Generator`` as is, an int -> a fresh
    host generator seeded with it (the same int, the same draws); else ``TypeError`` naming ``key``."""
    if key is None:
        return default
    if isinstance(key, torch.Generator):
        return key
    if is_int(key):
        g = torch.Generator()
        g.manual_seed(int_seed("key", key))
        return g
    raise TypeError(f"key: expected a torch.Generator, an int seed or None, got {type(key).__name__}")


def index_array(indices) -> torch.Tensor:
    """1-D integer ``indices`` as a tensor where they live (an empty list reads as int64); else
    ``TypeError`` naming ``indices``."""
    idx = as_tensor(np.asarray(indices) if isinstance(indices, (list, tuple)) else indices, "indices")
    if idx.dim() == 1 and idx.numel() == 0:
        idx = idx.to(torch.int64)  # an empty list reads as float64
    if idx.dim() != 1 or idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
        raise TypeError(f"indices: expected a 1-D integer array, got {idx.dtype} of shape {tuple(idx.shape)}")
    return idx


def priority_updates(indices, td_errors) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices (K,), td_errors (K,))`` as tensors where they live: 1-D integers (:func:`index_array`) and as many
    real TD errors; else ``TypeError``/``ValueError`` naming the argument."""
    idx = index_array(indices)
    td = as_tensor(np.asarray(td_errors) if isinstance(td_errors, (list, tuple)) else td_errors, "td_errors")
    if td.dim() != 1 or td.shape[0] != idx.shape[0] or td.dtype.is_complex or td.dtype == torch.bool:
        raise ValueError(f"td_errors: expected a real 1-D array of {idx.shape[0]} values (one per "
                         f"index), got {td.dtype} of shape {tuple(td.shape)}")
    return idx, td


def check_device_flags(name: str, flags, shape: tuple, device: torch.device) -> None:
    """``ValueError`` naming ``name`` unless ``flags`` is a dense bool tensor of ``shape`` on ``device``'s type: a mask
    a capturable call takes (it reads no value of it on the host)."""
    if not isinstance(flags, torch.Tensor) or flags.dtype != torch.bool or tuple(flags.shape) != shape \
            or flags.device.type != device.type or flags.layout != torch.strided:
        got = f"{flags.dtype} {tuple(flags.shape)} on {flags.device}" if isinstance(flags, torch.Tensor) \
            else type(flags).__name__
        raise ValueError(f"{name}: expected a bool tensor shaped {shape} on {device}, got {got}")


def check_device_updates(indices, td_errors, device: torch.device) -> None:
    """``ValueError`` naming the argument unless ``indices`` and ``td_errors`` are non-empty tensors on ``device``'s
    type of one shape, integer and real: what a sync-free priority update checks on the host."""
    for name, t, integer in (("indices", indices, True), ("td_errors", td_errors, False)):
        if not isinstance(t, torch.Tensor) or t.device.type != device.type or t.numel() == 0 \
                or t.is_floating_point() == integer or t.is_complex() or t.dtype == torch.bool:
            what = "integer" if integer else "real"
            got = f"{t.dtype} of shape {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) \
                else type(t).__name__
            raise ValueError(f"{name}: expected a non-empty {what} tensor on {device}, got {got}")
    if indices.shape != td_errors.shape:
        raise ValueError(f"td_errors: expected the shape of indices {tuple(indices.shape)}, got "
                         f"{tuple(td_errors.shape)}")


def host_indices(indices) -> tuple[np.ndarray, torch.device]:
    """``(int64 host copy, device)`` of integer ``indices`` of any shape (a device tensor is read
    back once); else ``TypeError`` naming ``indices``."""
    t = as_tensor(np.asarray(indices) if isinstance(indices, (list, tuple, int)) else indices, "indices")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"indices: expected integer flat starts, got {t.dtype}")
    return t.detach().cpu().numpy().astype(np.int64), t.device
