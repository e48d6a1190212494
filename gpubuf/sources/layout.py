"""The leaves of a source's rows: the ``Transition`` a transitions buffer is built from, and a buffer checked against
it."""

from collections.abc import Mapping

import numpy as np
import torch

from gpubuf._core.inputs import as_tensor, check_cast, dtype_kind
from gpubuf._core.transition import Transition, flatten, leaf_name

# names a source's own fields take: never an info key nor an extra leaf
RESERVED = ("action", "reward", "terminated", "truncated", "env_id", "players", "is_last")


def transition_sample(obs_space, action_zeros, info_spec: dict, lead: tuple, extra=None,
                      is_last: bool = True) -> Transition:
    """Zero leaves ``(*lead, ...)``: ``lead`` ``(1, n_envs)`` for a vectorized buffer (with ``info["is_last"]`` unless
    ``is_last`` is False, next observations inferred), ``(1,)`` for single transitions (with ``next_observation`` and
    ``info["env_id"]``, int64, the env each transition came from).

    ``obs_space`` has the observation's ``shape`` and numpy ``dtype``; ``action_zeros(lead)`` gives the actions;
    ``info_spec`` ``{key: (shape, numpy dtype)}`` the stored info fields; ``extra`` ``{name: example}`` one env's value
    of each extra leaf."""
    vectorized = len(lead) == 2
    obs = torch.from_numpy(np.zeros((*lead, *obs_space.shape), dtype=obs_space.dtype))
    info = {"is_last": torch.zeros(lead, dtype=torch.bool)} if vectorized and is_last else {}
    if not vectorized:  # single transitions interleave the envs: each row says whose it is (locate() reads it)
        info["env_id"] = torch.zeros(lead, dtype=torch.int64)
    info.update({k: torch.from_numpy(np.zeros((*lead, *s), d)) for k, (s, d) in info_spec.items()})
    if extra is not None:
        if not isinstance(extra, Mapping):
            raise TypeError(f"extra: expected a dict of example values, got {type(extra).__name__}")
        for name, value in extra.items():
            if not isinstance(name, str) or name in info or name in RESERVED:
                raise ValueError(f"extra: expected names other than {sorted(set(info) | set(RESERVED))}, got {name!r}")
            t = as_tensor(np.asarray(value) if not isinstance(value, torch.Tensor) else value, f"extra[{name!r}]")
            info[name] = torch.zeros((*lead, *t.shape), dtype=t.dtype)
    return Transition(
        observation=obs, action=torch.from_numpy(action_zeros(lead)), reward=torch.zeros(lead, dtype=torch.float32),
        terminated=torch.zeros(lead, dtype=torch.bool), truncated=torch.zeros(lead, dtype=torch.bool),
        next_observation=None if vectorized else obs.clone(), info=info)


def buffer_leaves(tb) -> dict:
    """``{path: (per-row shape without the env axis, dtype)}`` of a transitions buffer's stored leaves."""
    leaves = getattr(getattr(tb, "config", None), "leaves", None)
    if leaves is None or not hasattr(tb, "vectorized_env") or not hasattr(tb, "insert"):
        raise TypeError(f"transitions: expected a TransitionBuffer built from transition_sample(), got "
                        f"{type(tb).__name__}")
    return {tuple(leaf.path): (tuple(leaf.shape), leaf.dtype) for leaf in leaves}


def chosen_leaves(tb) -> set:
    """Paths of the leaves a buffer stores in a dtype chosen by its ``storage_dtypes``."""
    return {tuple(leaf.path) for leaf in tb.config.leaves if getattr(leaf, "chosen", False)}


def narrowed_obs(tb) -> torch.dtype | None:
    """The storage dtype of ``tb``'s observation leaf where its ``storage_dtypes`` chose one (``None``: none, or no
    buffer): a step's observation must fit it before anything of the step is kept."""
    leaf = None if tb is None else tb.config.by_path.get(("observation",))
    return leaf.dtype if leaf is not None and getattr(leaf, "chosen", False) else None


def check_leaves(leaves: dict, sample: Transition, vectorized: bool, chosen: set = frozenset()) -> None:
    """``ValueError`` naming the first of a buffer's ``leaves`` (:func:`buffer_leaves`) that differs from the rows of
    ``sample`` (:func:`transition_sample`); further ``info`` leaves are extra data. A leaf of ``chosen`` (stored in a
    dtype the buffer's ``storage_dtypes`` chose) may hold another dtype of the same kind: inserts cast into it."""
    lead = 2 if vectorized else 1
    want = {p: (tuple(t.shape[lead:]), t.dtype) for p, t in flatten(sample).items()}
    arg = "" if vectorized else "vectorized=False"
    how = f"build it from this source's transition_sample({arg})"
    for path, (shape, dtype) in want.items():
        if path not in leaves:
            raise ValueError(f"transitions: the buffer has no leaf {leaf_name(path)}, which this source's rows "
                             f"hold ({how})")
        stored = leaves[path]
        narrowed = path in chosen and stored[0] == shape and dtype_kind(stored[1]) == dtype_kind(dtype)
        if stored != (shape, dtype) and not narrowed:
            raise ValueError(f"transitions: leaf {leaf_name(path)} is {leaves[path][1]} {leaves[path][0]} per row, "
                             f"this source's rows hold {dtype} {shape} ({how})")
    for path in leaves:
        if path not in want and (path[0] != "info" or len(path) != 2 or path[1] in RESERVED):
            raise ValueError(f"transitions: the buffer has a leaf {leaf_name(path)}, which this source's rows do "
                             f"not hold (extra data are info leaves; {how})")


def extra_leaves(leaves: dict, own) -> dict:
    """``{name: (shape, dtype)}`` of the ``info`` leaves in ``leaves`` other than the source's ``own`` keys: the
    caller's extra data."""
    return {p[1]: spec for p, spec in leaves.items() if p[0] == "info" and len(p) == 2 and p[1] not in own}


def exact_info(values: np.ndarray, dtype: np.dtype, name: str) -> np.ndarray:
    """Host ``values`` of an info field as its stored numpy ``dtype``, cast only where no value changes (the rule of
    every buffer, :func:`~gpubuf._core.inputs.check_cast`: 1.7 or NaN into an integer field, 300 into ``uint8``, 2 into
    ``bool`` are refused; ``float64`` rounds into ``float32``), else ``TypeError`` naming ``name``."""
    if values.dtype == dtype:
        return values
    readable = values if values.flags.writeable else values.copy()  # torch reads no read-only array (JAX's)
    check_cast(as_tensor(readable, name), torch.from_numpy(np.zeros(0, dtype)).dtype, name)
    return values.astype(dtype)


def example_info_spec(info_keys, obs_key: str) -> dict:
    """``{key: (per-env shape, numpy dtype)}`` from ``info_keys`` ``{name: example}`` (one env's value of each
    field)."""
    if not isinstance(info_keys, dict):
        raise TypeError("info_keys: expected a dict {field name: one env's example value} such as "
                        f"{{'x_position': np.float64(0)}}, got {type(info_keys).__name__}")
    out = {}
    for key, example in info_keys.items():
        if not isinstance(key, str) or key in RESERVED or key == obs_key or key.startswith("_") or key in (
                "final_obs", "final_info"):
            raise ValueError(f"info_keys: expected field names other than {RESERVED + (obs_key,)}, 'final_obs', "
                             f"'final_info' and '_'-prefixed masks, got {key!r}")
        a = np.asarray(example)
        if a.dtype == object or a.dtype.kind not in "biuf":
            raise TypeError(f"info_keys[{key!r}]: expected a bool or numeric example, got {a.dtype}")
        out[key] = (a.shape, a.dtype)
    return out
