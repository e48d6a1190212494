"""The caller's extra per-step data (a log-probability, a value estimate): checked when sent, held per env on the device
until the env's row is written as ``info[name]`` of a transitions buffer."""

from collections.abc import Mapping

import numpy as np
import torch

from gpubuf._core.inputs import as_tensor, check_cast
from gpubuf._core.staging import Staging
from gpubuf.sources.actions import action_fill


def np_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype of a torch dtype (float for the float types numpy lacks)."""
    try:
        return np.dtype(torch.empty(0, dtype=dtype).numpy().dtype)
    except TypeError:
        return np.dtype(np.float32) if dtype.is_floating_point else np.dtype(np.int64)


class ExtraData:
    """The extra data last sent to each of ``n_envs`` envs: ``{name: (n_envs, *shape)}`` device tensors.

    ``spec``: ``{name: (per-env shape, torch dtype)}`` of the attached transitions buffer's extra ``info`` leaves (empty
    without one). Envs sent nothing since :meth:`attach` hold :func:`~gpubuf.sources.actions.action_fill`."""

    def __init__(self, n_envs: int, device: torch.device):
        self.n_envs, self.device = n_envs, device
        self.spec: dict = {}
        self._attached = False
        self._held: dict = {}
        self._staging = Staging(device)

    def attach(self, spec: dict | None) -> None:
        """Hold the leaves ``spec`` of a newly attached buffer (``None``: no buffer), each env's value the fill."""
        self._attached = spec is not None
        self.spec = spec or {}
        self._held = self.filled(self.n_envs)

    def filled(self, n: int) -> dict:
        """``{name: (n, *shape)}`` device tensors of the fill."""
        return {name: torch.full((n, *s), action_fill(np_dtype(d)), dtype=d, device=self.device)
                for name, (s, d) in self.spec.items()}

    def check(self, extra, R: int) -> dict:
        """``extra`` ``{name: (R, *shape)}`` checked against :attr:`spec`: ``{name: device tensor}`` in the leaf's
        dtype."""
        spec, extra = self.spec, {} if extra is None else extra
        if not isinstance(extra, Mapping):
            raise TypeError(f"extra: expected a dict of per-env arrays, got {type(extra).__name__}")
        if extra.keys() != spec.keys():
            where = ("the transitions buffer's own info leaves" if self._attached
                     else "a transitions buffer built from transition_sample(extra=...)")
            raise ValueError(f"extra: expected the keys of {where} {sorted(spec)}, got {sorted(extra)}")
        out = {}
        for name, value in extra.items():
            shape, dtype = spec[name]
            t = as_tensor(value, f"extra[{name!r}]")
            if tuple(t.shape) != (R, *shape):
                raise ValueError(f"extra[{name!r}]: expected shape {(R, *shape)}, got {tuple(t.shape)}")
            check_cast(t, dtype, f"extra[{name!r}]")
            out[name] = t
        return {name: t.to(self.device, spec[name][1]) for name, t in out.items()}

    def store(self, staged: dict, ids: np.ndarray | None = None) -> None:
        """Hold ``staged`` (from :meth:`check`) as the data of envs ``ids`` (host ints; ``None``: every env)."""
        if not staged:
            return
        if ids is None:
            for name, t in staged.items():
                self._held[name].copy_(t)
            return
        dev_ids = self._staging.to_device(torch.from_numpy(ids.astype(np.int64)), "__extra_ids__")
        for name, t in staged.items():
            self._held[name].index_copy_(0, dev_ids, t)

    def rows(self, env_ids: np.ndarray) -> dict:
        """The data last sent to ``env_ids`` (host ints): ``{name: (len, *shape)}`` device tensors."""
        if not self.spec:
            return {}
        dev = self._staging.to_device(torch.from_numpy(env_ids.astype(np.int64)), "__extra_rows__")
        return {name: self._held[name].index_select(0, dev) for name in self.spec}
