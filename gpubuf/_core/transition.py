"""Transition: one batch of transitions, the tree of its nested leaves, and its conversions.

A field may be a tensor (numpy array, ``__dlpack__`` array) or a nested dict of them. The buffers see a transition as
flat leaves ``{(field, key, ...): leaf}`` (:func:`flatten` / :func:`unflatten`, printed by :func:`leaf_name`). The
conversions (:func:`to`, :func:`items`, :func:`to_tensordict`, :func:`from_tensordict`) are also :class:`Transition`'s
methods; ``tensordict`` is an optional dependency, imported only when used."""

import dataclasses
import itertools
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from gpubuf._core.devices import parse_device
from gpubuf._core.inputs import as_tensor, is_int

_ARRAYS = (torch.Tensor, np.ndarray)
FIELDS = ("observation", "action", "reward", "terminated", "truncated", "next_observation", "info")


@dataclasses.dataclass
class Transition:
    """One batch of transitions; every field may be a tensor, a (nested) dict of tensors, or ``None``.

    ``None`` fields (and empty dicts) are not stored. ``PER_weights`` is only set on batches sampled from a
    :class:`~gpubuf.PrioritizedTransitionBuffer`; ``is_first``, ``mask`` and ``has_transition`` only on batches sampled
    with ``boundaries="mask"`` or ``"forbid"``; ``discount`` (the factor of the bootstrap value) only on batches sampled
    with ``n_step_return``. None of the five is ever stored.

    ``has_transition`` (shaped like ``mask``) is False exactly on the rows that hold no transition: an
    :class:`~gpubuf.EnvPoolSource`'s ``info["is_last"]`` rows, which hold an episode's last observation, the action fill
    and reward 0 (see :meth:`gpubuf.replay.config.ReplayConfig.with_flags`). A learner of transitions weighs its
    per-step losses by ``mask & has_transition``; a world model keeps those rows' observations (they stay inside
    ``mask``)."""

    observation: Any
    action: Any
    reward: Any
    terminated: Any
    truncated: Any
    next_observation: Any = None
    info: dict = dataclasses.field(default_factory=dict)
    PER_weights: Any = None
    is_first: Any = None
    mask: Any = None
    discount: Any = None
    has_transition: Any = None

    def to(self, device, non_blocking: bool = False) -> "Transition":
        """A new Transition with every leaf (nested dicts included) a tensor on ``device``; numpy leaves become tensors,
        ``None`` fields stay ``None``, a leaf already there is not copied. ``self`` is unchanged."""
        return to(self, device, non_blocking)

    def __iter__(self):
        """``(field, value)`` pairs of the fields that are set (not ``None``, not an empty dict), in
        field order, so ``dict(batch)`` holds what a buffer stores plus what sampling set
        (``PER_weights``, ``is_first``, ``mask``, ``has_transition``, ``discount``)."""
        return items(self)

    def to_tensordict(self, batch_dims: int | None = None):
        """A ``tensordict.TensorDict`` of the set fields (no copy; numpy leaves become tensors; nested dicts become
        nested TensorDicts, ``None`` values inside them left out). ``batch_dims``: leading dims that form its batch
        size, the same across leaves; ``None``: the longest leading shape all leaves share, e.g. ``(B, n_steps)``.
        Needs the optional ``tensordict`` package."""
        return to_tensordict(self, batch_dims)

    @classmethod
    def from_tensordict(cls, td) -> "Transition":
        """The Transition of a ``TensorDict`` whose keys are Transition fields; missing fields are ``None``, an unknown
        key raises ``ValueError`` naming it. Needs the optional ``tensordict`` package."""
        return from_tensordict(td)


Transition.__module__ = "gpubuf"  # pickled batches name gpubuf.Transition, the public name no move breaks


def leaf_name(path: tuple) -> str:
    """The printable name of a leaf path: ``info['lives']`` for ``("info", "lives")``."""
    return path[0] + "".join(f"[{p!r}]" for p in path[1:])


def flatten(transition, name: str = "transition") -> dict[tuple, Any]:
    """``{(field, key, ...): leaf}`` over the stored fields, in field order (``None`` fields and values left out);
    ``name`` is the argument named when ``transition`` is not a :class:`Transition`."""
    _check(transition, name)
    leaves: dict[tuple, Any] = {}

    def walk(path, value):
        if value is None:
            return
        if isinstance(value, Mapping):
            for k, v in value.items():
                if not isinstance(k, str):
                    raise TypeError(f"{leaf_name(path)}: dict keys must be str, got {k!r}")
                walk(path + (k,), v)
        else:
            leaves[path] = value

    for f in FIELDS:
        value = getattr(transition, f)
        if isinstance(value, _ARRAYS):  # the common case, without the walk
            leaves[(f,)] = value
        else:
            walk((f,), value)
    return leaves


def unflatten(leaves: dict[tuple, torch.Tensor]) -> Transition:
    """The :class:`Transition` of :func:`flatten`'s ``{path: leaf}`` (missing fields ``None``)."""
    fields: dict[str, Any] = {f: None for f in FIELDS}
    fields["info"] = {}
    for path, t in leaves.items():
        if len(path) == 1:
            fields[path[0]] = t
            continue
        node = fields[path[0]] if fields[path[0]] is not None else {}
        fields[path[0]] = node
        for p in path[1:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = t
    return Transition(**fields)



# the stored fields, then those only sampling sets
ALL_FIELDS = FIELDS + ("PER_weights", "is_first", "mask", "has_transition", "discount")


def _check(transition, name: str = "transition") -> None:
    if not isinstance(transition, Transition):
        raise TypeError(f"{name}: expected a gpubuf.Transition, got {type(transition).__name__}")


def _is_set(value) -> bool:
    """Whether a field holds data (``None`` and empty dicts are not stored)."""
    return value is not None and not (isinstance(value, Mapping) and not value)


def items(transition: Transition) -> Iterator[tuple[str, Any]]:
    """``(field, value)`` pairs of the set fields, in the order of ``ALL_FIELDS`` (:meth:`Transition.__iter__`)."""
    _check(transition)
    for name in ALL_FIELDS:
        value = getattr(transition, name)
        if _is_set(value):
            yield name, value


def _map_leaves(value, fn, path: str, keep_none: bool):
    """``fn(leaf, path)`` over the leaves of a nested dict; a ``None`` inside a dict (not stored by
    the buffers) stays ``None`` when ``keep_none``, else its key is left out."""
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
    """:meth:`Transition.to`; ``__dlpack__`` leaves become tensors too; ``None`` values inside dicts stay ``None``."""
    _check(transition)
    device = parse_device(device)
    return map_leaves(transition, lambda v, p: as_tensor(v, p).to(device, non_blocking=non_blocking))


def map_leaves(transition: Transition, fn) -> Transition:
    """A new :class:`Transition` of ``fn(leaf, path)`` over every set leaf (nested dicts included); ``None``
    fields and ``None`` values inside dicts stay ``None``."""
    mapped = {name: _map_leaves(value, fn, name, keep_none=True) for name, value in items(transition)}
    return Transition(**{**dict.fromkeys(FIELDS[:5]), **mapped})


def _tensordict():
    try:
        import tensordict
    except ImportError as err:
        raise ImportError("Transition <-> TensorDict needs the optional tensordict package: pip "
                          f"install tensordict ({err})") from err
    return tensordict


def to_tensordict(transition: Transition, batch_dims: int | None = None):
    """:meth:`Transition.to_tensordict` (``ValueError`` for a transition without a set field, or leaves that do not
    share ``batch_dims`` leading dims)."""
    tensordict = _tensordict()
    leaves: dict[str, torch.Tensor] = {}
    data = {name: _map_leaves(value, lambda v, p: leaves.setdefault(p, as_tensor(v, p)), name, keep_none=False)
            for name, value in items(transition)}
    if not leaves:
        raise ValueError("transition: expected at least one field that is set, got none")
    if batch_dims is None:
        shapes = zip(*(t.shape for t in leaves.values()), strict=False)  # stops at the shortest shape
        batch = [dims[0] for dims in itertools.takewhile(lambda dims: len(set(dims)) == 1, shapes)]
    else:
        if not is_int(batch_dims) or batch_dims < 0:
            raise ValueError(f"batch_dims: expected an int >= 0 or None, got {batch_dims!r}")
        batch_dims = int(batch_dims)
        batch = None
        for path, t in leaves.items():
            if t.dim() < batch_dims or (batch is not None and list(t.shape[:batch_dims]) != batch):
                raise ValueError(f"batch_dims: leaf {path} has shape {tuple(t.shape)}, expected it "
                                 f"to start with {batch_dims} batch dims shared by all leaves"
                                 + ("" if batch is None else f" ({tuple(batch)})"))
            batch = list(t.shape[:batch_dims])
    return tensordict.TensorDict(data, batch_size=batch)


def from_tensordict(td) -> Transition:
    """:meth:`Transition.from_tensordict` (nested TensorDicts become dicts)."""
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
