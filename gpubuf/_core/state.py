"""Validation of a buffer's state dict before anything is written, and the helpers that read its tensors.

A state dict holds only tensors and plain Python values (``torch.load(path)`` reads it with its defaults). A state read
from a checkpoint file may hold file-backed tensors instead (:class:`gpubuf._core.checkpoint.FileTensor`: ``shape``,
``dtype``, ``read_into(dst)``, ``chunks(nbytes)``), so that loading streams from disk; the helpers here accept both."""

from collections.abc import Iterator, Mapping

import torch

from gpubuf._core.staging import overlaps

CHUNK_BYTES = 16 * 2**20  # bounded extra memory per copy or check (host staging of one chunk)


def is_tensor(x) -> bool:
    return isinstance(x, torch.Tensor) or (hasattr(x, "read_into") and hasattr(x, "chunks"))


def copy_into(dst: torch.Tensor, src) -> None:
    """``dst`` = ``src`` (a tensor on any device, or a file-backed tensor of the same shape)."""
    if isinstance(src, torch.Tensor):
        dst.copy_(src.detach())
    else:
        src.read_into(dst)


def unaliased(sources: dict, dests: dict, owned: tuple) -> dict:
    """``sources`` with every in-memory tensor that overlaps a buffer's storage (byte ranges ``owned``, e.g. another
    key's storage from ``state_dict()``) replaced by a copy, so that copying the sources into ``dests`` in turn cannot
    read bytes already overwritten. A source that is its own destination (a buffer loading its own ``state_dict()``) and
    tensors that are not views of the storage stay as they are: no extra memory for a state from a file, another buffer
    or the buffer itself."""
    out = {}
    for key, src in sources.items():
        dst = dests[key]
        same = (isinstance(src, torch.Tensor) and src.data_ptr() == dst.data_ptr() and src.shape == dst.shape
                and src.stride() == dst.stride() and src.dtype == dst.dtype)
        if isinstance(src, torch.Tensor) and not same and overlaps(src, owned):
            src = src.detach().clone()
        out[key] = src
    return out


def host_tensor(x) -> torch.Tensor:
    """A CPU copy of a (small) tensor or file-backed tensor: for counters and other bookkeeping."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    out = torch.empty(tuple(x.shape), dtype=x.dtype)
    x.read_into(out)
    return out


def chunks(x, nbytes: int = CHUNK_BYTES) -> Iterator[torch.Tensor]:
    """Flat pieces of ``x`` in row-major order, of at most ``nbytes`` each (views of contiguous in-memory tensors;
    copies of whole leading rows of strided ones, at least one row; reads for files)."""
    # e.g. a transposed view of an env-major file
    if isinstance(x, torch.Tensor) and not x.is_contiguous():
        x = x.detach()
        rows = max(1, nbytes // max(x[0].numel() * x.element_size(), 1))
        for a in range(0, x.shape[0], rows):
            yield x[a:a + rows].contiguous().view(-1)
    elif isinstance(x, torch.Tensor):
        flat = x.detach().reshape(-1)
        step = max(1, nbytes // max(flat.element_size(), 1))
        for a in range(0, flat.numel(), step):
            yield flat[a:a + step]
    else:
        yield from x.chunks(nbytes)


def _plain(v):
    """Lists -> tuples, recursively (a JSON header reads tuples back as lists)."""
    if isinstance(v, (list, tuple)):
        return tuple(_plain(x) for x in v)
    if isinstance(v, Mapping):
        return {k: _plain(x) for k, x in v.items()}
    return v


def check_state(state, template: Mapping, config: tuple[str, ...], skip: tuple[str, ...] = ()) -> None:
    """Raise unless ``state`` has exactly ``template``'s structure (``template`` is the receiving buffer's own state
    dict): the same buffer type, equal ``config`` values, the same keys at every level, and tensors of the same shape
    and dtype (any device). The contents of entries in ``skip`` are left to the caller. Errors name the key."""
    if not isinstance(state, Mapping):
        raise TypeError(f"state_dict: expected a dict from state_dict() or a checkpoint, got {type(state).__name__}")
    if state.get("buffer") != template["buffer"]:
        raise ValueError(f"state_dict['buffer']: this is a {template['buffer']}, the state is of a "
                         f"{state.get('buffer', 'unknown buffer')!s}")
    for name in config:
        if name in state and _plain(state[name]) != _plain(template[name]):
            raise ValueError(f"state_dict: {name} is {state[name]!r}, this buffer has {template[name]!r}")
    _check_tree("state_dict", state, template, skip)


def _check_tree(where: str, state, template: Mapping, skip=()) -> None:
    if not isinstance(state, Mapping):
        raise ValueError(f"{where}: expected a dict, got {type(state).__name__}")
    missing = [k for k in template if k not in state]
    extra = [k for k in state if k not in template]
    if missing or extra:
        raise ValueError(f"{where}: missing keys {missing}, unexpected keys {extra}")
    for key, want in template.items():
        if key in skip:
            continue
        got, here = state[key], f"{where}[{key!r}]"
        if isinstance(want, Mapping):
            _check_tree(here, got, want)
        elif is_tensor(want):
            check_tensor(here, got, tuple(want.shape), want.dtype)
        elif not _same_kind(got, want):
            raise ValueError(f"{here}: expected a {type(want).__name__}, got {got!r:.80}")


def _same_kind(got, want) -> bool:
    """Plain values: bools are not ints; an int may stand for a float; a list may stand for a tuple."""
    if isinstance(want, bool) or isinstance(got, bool):
        return isinstance(want, bool) and isinstance(got, bool)
    if isinstance(want, float):
        return isinstance(got, (int, float))
    if isinstance(want, (tuple, list)):
        return isinstance(got, (tuple, list))
    return isinstance(got, type(want))


def check_tensor(where: str, got, shape: tuple, dtype: torch.dtype) -> None:
    """Raise unless ``got`` is a dense tensor with data (or a file-backed tensor) of exactly
    ``shape`` and ``dtype`` (any dtype when ``dtype`` is ``None``)."""
    if not is_tensor(got):
        raise ValueError(f"{where}: expected a {dtype} tensor of shape {shape}, got {type(got).__name__}")
    if isinstance(got, torch.Tensor) and (got.layout != torch.strided or got.device.type == "meta"):
        raise ValueError(f"{where}: expected a dense tensor with data, got a {got.layout} tensor on {got.device}")
    if tuple(got.shape) != shape or (dtype is not None and got.dtype != dtype):
        raise ValueError(f"{where}: expected a {dtype} tensor of shape {shape}, got {got.dtype} of shape "
                         f"{tuple(got.shape)}")


def check_range(where: str, value: int, low: int, high: int) -> int:
    """``value`` (an int) within ``[low, high]``, else ``ValueError`` naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{where}: expected an int in [{low}, {high}], got {value!r}")
    return value


def check_rng(where: str, value) -> torch.Tensor:
    """A torch generator state (host uint8 tensor) from ``value``, else ``ValueError`` naming ``where``."""
    try:
        rng = host_tensor(value)  # a tensor, or a tensor of a checkpoint file
    except (AttributeError, TypeError):
        raise ValueError(f"{where}: expected a uint8 generator state, got {type(value).__name__}") from None
    if rng.dtype != torch.uint8 or rng.dim() != 1:
        raise ValueError(f"{where}: expected a uint8 generator state, got {rng.dtype} of shape {tuple(rng.shape)}")
    try:
        torch.Generator().set_state(rng)
    except RuntimeError as err:
        raise ValueError(f"{where}: not a generator state ({err})") from None
    return rng
