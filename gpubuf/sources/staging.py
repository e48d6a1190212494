"""Env outputs -> stacked-info device tensors.

:class:`StepStager` turns one batch of env outputs (numpy, torch on any device, or ``__dlpack__`` arrays from a GPU
simulator) into the stacked-info layout on the device: the observation ``(R, 1, *obs)``, the executed ``action`` echo
``(R, 1, A)`` float32 with a fill (NaN unless chosen) on rows whose action the env ignored (reset frames, and with an
:class:`~gpubuf.EnvPoolSource` the step after a life loss of ``episodic_life=True``), ``reward`` ``(R, 1)`` float32,
``terminated``/``truncated`` ``(R, 1)`` bool. Host arrays go through pinned staging; device arrays are used in place (no
host round trip, no copy)."""

import functools
from dataclasses import dataclass

import numpy as np
import torch

from gpubuf import ops
from gpubuf._core.inputs import as_flags, as_index_array, as_tensor, check_cast, check_flags, lossless, positive_int
from gpubuf._core.staging import Staging
from gpubuf.sources.actions import echo_fill


@dataclass
class Step:
    """One received batch: ``info`` in the stacked layout (device), and host-side routing.

    ``info`` tensors are valid until the next step: device inputs are passed through without a copy and host inputs
    bound for CUDA sit in the stager's reusable pinned/device staging. The buffers copy what they store. ``env_ids``
    ``(R,)`` int64 and ``first`` ``(R,)`` bool (reset frames) live on the host, where the env already put them."""

    info: dict
    env_ids: np.ndarray
    first: np.ndarray


class StepStager:
    """Puts one batch of env outputs on the device in the stacked-info layout, without a host round trip.

    Args:
        n_envs: number of envs (the most rows one call may carry).
        obs_key: the info key of the observation.
        device: output device; ``None`` -> ``cuda`` when available, else ``cpu``.
        action_fill: the ``action`` echo of rows whose action the env ignored (``first`` rows, or the ``ignored`` rows
            given to :meth:`stage`); NaN by default; a real number within float32's range (NaN and inf too), else
            ``TypeError``/``ValueError`` naming it.

    Host arrays bound for CUDA go through preallocated pinned staging (one non-blocking copy per key); arrays already on
    the device are used as they are. Shapes are fixed by the first call."""

    def __init__(self, n_envs: int, obs_key: str = "observation", *, device=None, action_fill: float = float("nan")):
        self.action_fill = echo_fill(action_fill)
        if not isinstance(obs_key, str) or obs_key in ("action", "reward", "terminated", "truncated"):
            raise ValueError(f"obs_key: expected a str other than the step keys, got {obs_key!r}")
        self.n_envs = positive_int("n_envs", n_envs)
        self.obs_key = obs_key
        self.device = ops.resolve_device(device)
        self._staging = Staging(self.device)
        self.all_ids = np.arange(self.n_envs, dtype=np.int64)
        self._shapes: dict[str, tuple] = {}  # key -> (1, *per_env), fixed by the first call
        self._dtypes = {"action": torch.float32, "reward": torch.float32, "terminated": torch.bool,
                        "truncated": torch.bool}
        # the last accepted call's layout, per key: (key, numpy dtype, shape, (R, 1, *per_env) view); and (key,
        # value check or None, dtype to cast to or None) of the keys that need more than a view (all of them off the
        # CPU); see _fast
        self._plan = None
        self._plan_post = ()

    def __call__(self, obs, action, reward, terminated, truncated, env_ids=None, first=None, more=None) -> Step:
        """Stage ``R`` rows: ``obs (R, *obs)``, ``action (R,)`` or ``(R, A)``, ``reward``/``terminated``/``truncated``
        ``(R,)``; ``env_ids (R,)`` host ints (all envs if ``None``); ``first (R,)`` host bools marking reset frames,
        whose action echo becomes ``action_fill`` (NaN by default); ``more``: further keys ``{name: (R, ...)}`` staged
        as ``(R, 1, ...)`` in their own dtype (EnvPool info fields). ``action`` and ``reward`` are stored as float32 and
        must fit it (:func:`gpubuf._core.inputs.check_cast`); ``terminated``/``truncated``/``first`` are bool or 0/1
        integers. Every check runs before any write."""
        ids = self.all_ids if env_ids is None else as_index_array(env_ids, "env_ids", self.n_envs)
        R = len(ids)
        first = np.zeros(R, dtype=bool) if first is None else as_flags(first, "first", (R,))
        return self.stage(obs, action, reward, terminated, truncated, ids, first, more)

    def stage(self, obs, action, reward, terminated, truncated, ids: np.ndarray, first: np.ndarray, more,
              ignored: np.ndarray | None = None) -> Step:
        """:meth:`__call__` for a caller whose ``ids`` (host int64 ids in ``[0, n_envs)``) and ``first`` (host bool
        ``(R,)``) are already checked; the values are checked as there. ``ignored`` (host bool ``(R,)``, ``first`` when
        ``None``): the rows whose action echo becomes ``action_fill``. An unchanged layout (numpy arrays of the last
        call's dtypes and shapes) takes a cached path."""
        R = len(ids)
        raw = {self.obs_key: obs, "action": action, "reward": reward, "terminated": terminated, "truncated": truncated}
        if more:
            for key, value in more.items():
                if key in raw:
                    raise ValueError(f"more: key {key!r} collides with a step key")
                raw[key] = value
        info = self._fast(raw)
        if info is None:
            info = self._checked(raw, R)
        ignored = first if ignored is None else ignored
        if np.count_nonzero(ignored):  # (``.any()`` costs 4x more on a handful of flags)
            mask = self._staging.to_device(torch.from_numpy(ignored), "__first__")
            info["action"] = torch.where(mask.view(R, 1, 1), self.action_fill, info["action"])
        return Step(info, ids, first)

    def _fast(self, raw: dict) -> dict | None:
        """The steady state: every value a C-contiguous numpy array of the dtype and shape of the last accepted call
        (the keys in the same order). ``None`` when anything differs (the checked path then decides). Value checks that
        depend on the data (flags given as integers, narrowing casts) still run."""
        plan = self._plan
        if plan is None or len(raw) != len(plan):
            return None
        info = {}
        for (key, value), (want_key, dtype, shape, view) in zip(raw.items(), plan, strict=True):
            if (key != want_key or value.__class__ is not np.ndarray or value.dtype != dtype
                    or value.shape != shape or not value.flags.c_contiguous):
                return None
            info[key] = torch.from_numpy(value.reshape(view))  # numpy's view: cheaper than torch's
        for key, check, cast in self._plan_post:  # keys that need a value check, a copy or a cast
            t = info[key]
            if check is not None:
                check(t, key)
            t = self._staging.to_device(t, key)
            info[key] = t if cast is None else t.to(cast)
        return info

    def _checked(self, raw: dict, R: int) -> dict:
        """Every check, then the staged info; remembers the call's layout for :meth:`_fast`."""
        values, checks = {}, {}
        for key, value in raw.items():
            t = as_tensor(value, key)
            if t.dim() == 0 or t.shape[0] != R:
                raise ValueError(f"{key}: expected a leading env dim of {R} rows, got shape {tuple(t.shape)}")
            if key == "action" and t.dim() == 1:
                t = t[:, None]
            elif key in ("reward", "terminated", "truncated") and t.dim() != 1:
                raise ValueError(f"{key}: expected shape ({R},), got {tuple(t.shape)}")
            checks[key] = None
            if key in ("terminated", "truncated"):
                check_flags(t, key)
                if t.dtype != torch.bool:
                    checks[key] = check_flags
            elif key in self._dtypes:
                check_cast(t, self._dtypes[key], key)
                if not lossless(t.dtype, self._dtypes[key]):
                    checks[key] = functools.partial(_check_cast_as, self._dtypes[key])
            values[key] = t.reshape(R, 1, *t.shape[1:])
        if not self._shapes:
            self._shapes = {k: tuple(t.shape[1:]) for k, t in values.items()}
        if values.keys() != self._shapes.keys():
            raise ValueError(f"more: keys are fixed by the first call {sorted(self._shapes)}, got {sorted(values)}")
        for key, t in values.items():
            want = self._shapes[key]
            if tuple(t.shape[1:]) != want:
                raise ValueError(f"{key}: expected per-env shape {want[1:]}, got {tuple(t.shape[2:])}")
        info = {}
        for key, t in values.items():
            # ``t`` itself when already on the device: no copy
            dev = self._staging.to_device(t, key)
            want = self._dtypes.get(key, dev.dtype)
            info[key] = dev if dev.dtype == want else dev.to(want)
        plain = all(type(v) is np.ndarray and v.dtype.isnative and v.flags.c_contiguous for v in raw.values())
        self._plan = None if not plain else tuple(
            (key, value.dtype, value.shape, values[key].shape) for key, value in raw.items())
        casts = {key: None if info[key].dtype == t.dtype else info[key].dtype for key, t in values.items()}
        self._plan_post = tuple((key, checks[key], casts[key]) for key in raw
                                if checks[key] is not None or casts[key] is not None or self.device.type != "cpu")
        return info


def _check_cast_as(dtype: torch.dtype, t: torch.Tensor, name: str) -> None:
    check_cast(t, dtype, name)
