"""Conversions of a :class:`~gpubuf.Transition`: to a device, field by field, to and from a ``TensorDict``.

:class:`~gpubuf.Transition`'s methods ``to``, ``__iter__``, ``to_tensordict`` and ``from_tensordict`` are these
functions. ``tensordict`` is an optional dependency (``pip install tensordict``), imported only when used.
"""

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from gpubuf.inputs import as_tensor
from gpubuf.replay import FIELDS, Transition

ALL_FIELDS = FIELDS + ("PER_weights", "is_first", "mask")  # the stored fields, then those only sampling sets


def _check(transition) -> Transition:
    if not isinstance(transition, Transition):
        raise TypeError(f"transition: expected a gpubuf.Transition, got {type(transition).__name__}")
    return transition


def _is_set(value) -> bool:
    """Whether a field holds data (``None`` and empty dicts are not stored)."""
    return value is not None and not (isinstance(value, Mapping) and not value)


def items(transition: Transition) -> Iterator[tuple[str, Any]]:
    """``(field, value)`` pairs of the fields that are set (not ``None``, not an empty dict), in field order:
    ``observation, action, reward, terminated, truncated, next_observation, info, PER_weights, is_first,
    mask``. So ``dict(transition)`` holds exactly the fields a buffer stores, plus those sampling sets."""
    _check(transition)
    for name in ALL_FIELDS:
        value = getattr(transition, name)
        if _is_set(value):
            yield name, value


def _map_leaves(value, fn, path: str, keep_none: bool):
    """``fn(leaf, path)`` over the leaves of a nested dict; a ``None`` inside a dict (not stored by the buffers)
    stays ``None`` when ``keep_none``, else its key is left out."""
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{path}: dict keys must be str, got {k!r}")
            if v is not None:
                out[k] = _map_leaves(v, fn, f"{path}[{k!r}]", keep_none)
            elif keep_none:
                out[k] = None
        return out
    return fn(value, path)


def to(transition: Transition, device, non_blocking: bool = False) -> Transition:
    """A new :class:`Transition` with every leaf (nested dicts included) a torch tensor on ``device``.

    Numpy arrays and ``__dlpack__`` arrays become tensors; ``None`` fields (and ``None`` values inside dicts)
    stay ``None``; a leaf already on
    ``device`` is the same tensor (no copy), as ``Tensor.to`` does. ``transition`` itself is unchanged.
    """
    _check(transition)
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device: expected a torch device or its name, got {device!r}") from err
    moved = {name: _map_leaves(value, lambda v, p: as_tensor(v, p).to(device, non_blocking=non_blocking), name,
                               keep_none=True) for name, value in items(transition)}
    return Transition(**{**dict.fromkeys(FIELDS[:5]), **moved})


def _tensordict():
    try:
        import tensordict
    except ImportError as err:
        raise ImportError("Transition <-> TensorDict needs the optional tensordict package: pip install "
                          f"tensordict ({err})") from err
    return tensordict


def to_tensordict(transition: Transition, batch_dims: int | None = None):
    """A ``TensorDict`` with one entry per set field (nested dicts become nested TensorDicts; ``None`` values
    inside dicts, which the buffers do not store either, are left out).

    ``batch_dims``: how many leading dims are the batch (``batch_size`` of the TensorDict); they must agree
    across leaves. ``None``: the longest leading shape all leaves share, e.g. ``(B, n_steps)`` for a sampled
    batch of windows. The leaves are the transition's tensors (no copy); numpy leaves become tensors.
    """
    tensordict = _tensordict()
    leaves: dict[str, torch.Tensor] = {}
    data = {name: _map_leaves(value, lambda v, p: leaves.setdefault(p, as_tensor(v, p)), name, keep_none=False)
            for name, value in items(transition)}
    if not leaves:
        raise ValueError("transition: expected at least one field that is set, got none")
    if batch_dims is None:
        shapes = [tuple(t.shape) for t in leaves.values()]
        batch = []
        for dims in zip(*shapes, strict=False):
            if len(set(dims)) != 1:
                break
            batch.append(dims[0])
        batch = batch[: min(len(s) for s in shapes)]
    else:
        if isinstance(batch_dims, bool) or not isinstance(batch_dims, (int, np.integer)) or batch_dims < 0:
            raise ValueError(f"batch_dims: expected an int >= 0 or None, got {batch_dims!r}")
        batch_dims = int(batch_dims)
        batch = None
        for path, t in leaves.items():
            if t.dim() < batch_dims or (batch is not None and list(t.shape[:batch_dims]) != batch):
                raise ValueError(f"batch_dims: leaf {path} has shape {tuple(t.shape)}, expected it to start with "
                                 f"{batch_dims} batch dims shared by all leaves"
                                 + ("" if batch is None else f" ({tuple(batch)})"))
            batch = list(t.shape[:batch_dims])
    return tensordict.TensorDict(data, batch_size=batch)


def from_tensordict(td) -> Transition:
    """The :class:`Transition` of a ``TensorDict`` whose keys are Transition fields (nested TensorDicts become
    dicts). Missing fields are ``None``; an unknown key raises ``ValueError`` naming it."""
    tensordict = _tensordict()
    if not isinstance(td, tensordict.TensorDictBase):
        raise TypeError(f"td: expected a TensorDict, got {type(td).__name__}")
    unknown = [k for k in td.keys() if k not in ALL_FIELDS]
    if unknown:
        raise ValueError(f"td: unknown keys {unknown}; expected Transition fields {list(ALL_FIELDS)}")
    fields = {}
    for name in td.keys():
        value = td.get(name)
        fields[name] = value.to_dict() if isinstance(value, tensordict.TensorDictBase) else value
    return Transition(**{**dict.fromkeys(FIELDS[:5]), **fields})
