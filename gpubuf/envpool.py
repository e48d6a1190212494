"""Env outputs -> stacked-info device tensors, and an EnvPool driver that feeds the buffers.

:class:`StepStager` turns one batch of env outputs (numpy, torch on any device, or ``__dlpack__`` arrays
from a GPU simulator) into the stacked-info layout on the device: the observation
``(R, 1, *obs)``, the executed ``action`` echo ``(R, 1, A)`` float32 with NaN on reset frames, ``reward``
``(R, 1)`` float32, ``terminated``/``truncated`` ``(R, 1)`` bool. Host arrays go through pinned staging;
device arrays are used in place (no host round trip, no copy).

:class:`EnvPoolSource` drives an ``envpool`` env in sync mode (``batch_size == num_envs``) or async mode
(``send``/``recv`` with ``env_id`` routing) and can append every received row to a :class:`HistoryBuffer`
(flushing envs on their reset frame) and insert transitions into a ``TransitionBuffer``.
Imports are absolute, so this module (``gpubuf.envpool``) never shadows the ``envpool`` package.
"""

from dataclasses import dataclass

import numpy as np
import torch

from gpubuf import ops
from gpubuf.inputs import as_flags, as_index_array, as_tensor, check_cast, check_flags, positive_int
from gpubuf.staging import Staging


@dataclass
class Step:
    """One received batch: ``info`` in the stacked layout (device), and host-side routing.

    ``info`` tensors are valid until the next step: device inputs are passed through without a copy and
    host inputs bound for CUDA sit in the stager's reusable pinned/device staging. The buffers copy what
    they store. ``env_ids`` ``(R,)`` int64 and ``first`` ``(R,)`` bool (reset frames)
    live on the host, where the env already put them.
    """

    info: dict
    env_ids: np.ndarray
    first: np.ndarray


class StepStager:
    """Puts one batch of env outputs on the device in the stacked-info layout, without a host round trip.

    Args:
        n_envs: number of envs (the most rows one call may carry).
        obs_key: the info key of the observation.
        device: output device; ``None`` -> ``cuda`` when available, else ``cpu``.

    Host arrays bound for CUDA go through preallocated pinned staging (one non-blocking copy per key);
    arrays already on the device are used as they are. Shapes are fixed by the first call.
    """

    def __init__(self, n_envs: int, obs_key: str = "observation", *, device=None):
        if not isinstance(obs_key, str) or obs_key in ("action", "reward", "terminated", "truncated"):
            raise ValueError(f"obs_key: expected a str other than the step keys, got {obs_key!r}")
        self.n_envs = positive_int("n_envs", n_envs)
        self.obs_key = obs_key
        self.device = ops.resolve_device(device)
        self._staging = Staging(self.device)
        self._all_ids = np.arange(self.n_envs, dtype=np.int64)
        self._shapes: dict[str, tuple] = {}  # key -> (1, *per_env), fixed by the first call
        self._dtypes = {"action": torch.float32, "reward": torch.float32, "terminated": torch.bool,
                        "truncated": torch.bool}

    def __call__(self, obs, action, reward, terminated, truncated, env_ids=None, first=None) -> Step:
        """Stage ``R`` rows: ``obs (R, *obs)``, ``action (R,)`` or ``(R, A)``, ``reward``/``terminated``/
        ``truncated`` ``(R,)``; ``env_ids (R,)`` host ints (all envs if ``None``); ``first (R,)`` host bools
        marking reset frames, whose action echo becomes NaN. ``action`` and ``reward`` are stored as float32
        and must fit it (:func:`gpubuf.inputs.check_cast`); ``terminated``/``truncated``/``first`` are bool
        or 0/1 integers. Every check runs before any write."""
        ids = self._all_ids if env_ids is None else as_index_array(env_ids, "env_ids", self.n_envs)
        R = len(ids)
        first = np.zeros(R, dtype=bool) if first is None else as_flags(first, "first", (R,))
        raw = {self.obs_key: obs, "action": action, "reward": reward, "terminated": terminated,
               "truncated": truncated}
        values = {}
        for key, value in raw.items():
            t = as_tensor(value, key)
            if t.dim() == 0 or t.shape[0] != R:
                raise ValueError(f"{key}: expected a leading env dim of {R} rows, got shape {tuple(t.shape)}")
            if key == "action" and t.dim() == 1:
                t = t[:, None]
            elif key in ("reward", "terminated", "truncated") and t.dim() != 1:
                raise ValueError(f"{key}: expected shape ({R},), got {tuple(t.shape)}")
            if key in ("terminated", "truncated"):
                check_flags(t, key)
            elif key in self._dtypes:
                check_cast(t, self._dtypes[key], key)
            values[key] = t.reshape(R, 1, *t.shape[1:])
        if not self._shapes:
            self._shapes = {k: tuple(t.shape[1:]) for k, t in values.items()}
        for key, t in values.items():
            want = self._shapes[key]
            if tuple(t.shape[1:]) != want:
                raise ValueError(f"{key}: expected per-env shape {want[1:]}, got {tuple(t.shape[2:])}")
        info = {}
        for key, t in values.items():
            dev = self._staging.to_device(t, key)  # ``t`` itself when already on the device: no copy
            info[key] = dev if dev.dtype == self._dtypes.get(key, dev.dtype) else dev.to(self._dtypes[key])
        if first.any():
            mask = self._staging.to_device(torch.from_numpy(first), "__first__")
            info["action"] = torch.where(mask.view(R, 1, 1), float("nan"), info["action"])
        return Step(info, ids, first)


def _space_layout(space) -> tuple[np.dtype, tuple]:
    """The numpy dtype and per-env shape of one action in ``space`` (Discrete -> ``()``)."""
    shape = tuple(getattr(space, "shape", None) or ())
    return np.dtype(space.dtype), shape


class EnvPoolSource:
    """Steps an ``envpool`` env and hands every received row to the buffers as device tensors.

    Args:
        env: an ``envpool.make(..., env_type="gymnasium")`` env; async when ``batch_size < num_envs``.
        obs_key: info key of the observation (``"pixels"`` suits image envs).
        device: output device; ``None`` -> ``cuda`` when available, else ``cpu``.
        history: a :class:`~gpubuf.HistoryBuffer` with ``n_envs == num_envs``: each received row is
            appended to its env's history, after flushing envs whose row is a reset frame.
        transitions: a ``TransitionBuffer`` built from :meth:`transition_sample`. Vectorized (sync only):
            each step inserts the time row ``(previous obs, action, reward, terminated, truncated)`` of all
            envs; a reset frame's row (previous obs terminal, action ignored) is flagged ``truncated`` so
            that samplers inferring next observations never draw it. Not vectorized (sync or async): each
            received row but reset frames is one transition with its ``next_observation``.

    Sync: ``step = src.reset(); step = src.step(actions)``. Async: ``step = src.reset()`` (first batch),
    then ``src.send(actions, step.env_ids); step = src.recv()``.
    """

    def __init__(self, env, *, obs_key: str = "observation", device=None, history=None, transitions=None):
        config = getattr(env, "config", None)
        if not isinstance(config, dict) or "num_envs" not in config or not hasattr(env, "recv"):
            raise TypeError(f"env: expected an envpool env (envpool.make(...)), got {type(env).__name__}")
        self.env = env
        self.n_envs = int(config["num_envs"])
        self.batch_size = int(config["batch_size"])
        self.is_async = self.batch_size < self.n_envs
        if history is not None and history.n_envs != self.n_envs:
            raise ValueError(f"history: expected a HistoryBuffer with n_envs={self.n_envs}, got {history.n_envs}")
        if transitions is not None and transitions.vectorized_env:
            if self.is_async:
                raise ValueError("transitions: an async env needs a buffer with vectorized_env=False "
                                 "(built from transition_sample(vectorized=False))")
            if transitions.n_envs != self.n_envs:
                raise ValueError(f"transitions: expected a TransitionBuffer over {self.n_envs} envs "
                                 f"(build it from transition_sample()), got {transitions.n_envs}")
        self.history = history
        self.transitions = transitions
        self.stager = StepStager(self.n_envs, obs_key, device=device)
        self.device = self.stager.device
        self._staging = Staging(self.device)
        self.action_dtype, self.action_shape = _space_layout(env.action_space)
        self.n_actions = getattr(env.action_space, "n", None)  # Discrete spaces: actions lie in [0, n)
        self._sent = np.zeros((self.n_envs, *self.action_shape), dtype=self.action_dtype)  # last sent, per env
        self._in_flight = np.zeros(self.n_envs, dtype=bool)  # sent (or reset), not yet received
        self._prev_obs = None  # (n_envs, *obs) device copy of each env's last observation (transitions only)
        self._has_prev = None  # (n_envs,) host: whether _prev_obs holds a real observation

    # ------------------------------------------------------------------ stepping

    def reset(self) -> Step:
        """Reset every env (sync) or start the async pool; returns the first received batch."""
        self._sent[:] = 0
        if self._has_prev is not None:
            self._has_prev[:] = False
        if self.is_async:
            self.env.async_reset()
            self._in_flight[:] = True
            return self.recv()
        obs, info = self.env.reset()
        n = len(info["env_id"])
        zeros = np.zeros(n, dtype=np.float32)
        return self._receive(obs, zeros, zeros.astype(bool), zeros.astype(bool), info)

    def send(self, actions, env_ids=None) -> None:
        """Send one action per listed env (all envs if ``None``): ``(R,)`` for discrete, ``(R, *shape)``.

        ``env_ids`` must be distinct envs that are not in flight (sent or reset and not yet received); with a
        vectorized ``transitions`` buffer every env steps together, so ``env_ids`` must cover all envs. A
        discrete env takes integers in ``[0, n)``; floats are accepted only when integral (``2.0``), so a
        continuous planner's output must be mapped explicitly (e.g. ``(plan > 0).long()``). A continuous env
        takes finite values that fit its action dtype. ``actions`` is ``(R, *shape)`` (singleton axes may be
        added or dropped). Anything else is a ``ValueError``/``TypeError`` before anything is sent."""
        ids = np.arange(self.n_envs) if env_ids is None else as_index_array(env_ids, "env_ids", self.n_envs)
        if len(np.unique(ids)) != len(ids):
            dup = np.unique(ids[np.bincount(ids, minlength=self.n_envs)[ids] > 1])
            raise ValueError(f"env_ids: each env takes one action per send, got duplicates {dup[:5].tolist()}")
        if self._in_flight[ids].any():
            raise ValueError(f"env_ids: envs {ids[self._in_flight[ids]][:5].tolist()} are in flight (sent or reset, "
                             "not yet received): recv() them before sending again")
        if self.transitions is not None and self.transitions.vectorized_env and len(ids) != self.n_envs:
            raise ValueError(f"env_ids: a vectorized transitions buffer stores one time row of all {self.n_envs} "
                             f"envs per step; send an action to every env, got {len(ids)}")
        acts = self._host_actions(actions, len(ids))
        self.env.send(acts, ids.astype(np.int32))
        self._sent[ids] = acts
        self._in_flight[ids] = True

    def recv(self) -> Step:
        """Receive the next batch (``batch_size`` rows), stage it and feed the attached buffers."""
        obs, reward, terminated, truncated, info = self.env.recv()
        return self._receive(obs, reward, terminated, truncated, info)

    def step(self, actions, env_ids=None) -> Step:
        """``send`` then ``recv`` (in async mode the received envs may differ from the sent ones)."""
        self.send(actions, env_ids)
        return self.recv()

    def _host_actions(self, actions, R: int) -> np.ndarray:
        if isinstance(actions, torch.Tensor):
            actions = actions.detach().cpu()  # envpool steps on the host: one read per step
            if actions.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
                actions = actions.float()  # dtypes numpy lacks, widened exactly
            actions = as_tensor(actions, "actions").resolve_conj().resolve_neg().numpy()
        arr = np.asarray(actions)
        want = (R, *self.action_shape)
        if arr.dtype.kind not in "biuf":
            raise TypeError(f"actions: expected numbers shaped {want}, got a {arr.dtype} array")
        if arr.ndim == 0 or arr.shape[0] != R or [d for d in arr.shape[1:] if d != 1] != [
                d for d in self.action_shape if d != 1]:
            raise ValueError(f"actions: expected shape {want}, got {arr.shape}")
        if self.action_dtype.kind == "f":  # a continuous env: finite values its dtype holds
            if arr.dtype.kind == "f" and not np.isfinite(arr).all():
                raise ValueError(f"actions: expected finite actions, got {arr[~np.isfinite(arr)][:5].tolist()}")
            check_cast(torch.from_numpy(np.ascontiguousarray(arr)), torch.from_numpy(
                np.zeros(0, self.action_dtype)).dtype, "actions")
        if self.action_dtype.kind in "iu":  # a discrete env: integral actions only, never truncated silently
            if arr.dtype.kind == "f" and not np.array_equal(arr, np.trunc(arr)):
                bad = arr[~(arr == np.trunc(arr))][:5].tolist()
                raise ValueError(f"actions: a discrete env takes integer actions, got {bad}; map a continuous "
                                 "planner's output explicitly (e.g. (plan > 0).long() or plan.round())")
            if self.n_actions is not None and arr.size and not (0 <= arr.min() and arr.max() < self.n_actions):
                raise ValueError(f"actions: expected actions in [0, {self.n_actions}), got "
                                 f"[{arr.min()}, {arr.max()}]")
        return arr.reshape(want).astype(self.action_dtype, copy=False)

    def _receive(self, obs, reward, terminated, truncated, info) -> Step:
        ids = np.asarray(info["env_id"], dtype=np.int64)
        self._in_flight[ids] = False
        first = np.asarray(info["elapsed_step"]) == 0
        sent = self._sent[ids]
        step = self.stager(obs, sent.reshape(len(ids), -1).astype(np.float32), reward, terminated, truncated,
                           ids, first)
        if self.history is not None:
            if first.any():
                self.history.reset(ids[first])
            self.history.append(step.info, env_ids=ids)
        if self.transitions is not None:
            self._insert_transition(step, sent, reward, terminated, truncated)
        return step

    # ------------------------------------------------------------------ transitions

    def transition_sample(self, vectorized: bool = True):
        """A ``Transition`` shaped like one insert, to build the ``transitions`` buffer from.

        ``vectorized=True`` (sync only): leaves ``(1, num_envs, ...)``, one time row per step, next
        observations inferred by the buffer. ``vectorized=False`` (sync or async; build the buffer with
        ``vectorized_env=False``): leaves ``(1, ...)`` with an explicit ``next_observation``; each received
        row is one transition and reset frames are skipped.
        """
        from gpubuf.replay import Transition

        space = self.env.observation_space
        lead = (1, self.n_envs) if vectorized else (1,)
        obs = torch.from_numpy(np.zeros((*lead, *space.shape), dtype=space.dtype))
        return Transition(
            observation=obs,
            action=torch.from_numpy(np.zeros((*lead, *self.action_shape), dtype=self.action_dtype)),
            reward=torch.zeros(lead, dtype=torch.float32),
            terminated=torch.zeros(lead, dtype=torch.bool),
            truncated=torch.zeros(lead, dtype=torch.bool),
            next_observation=None if vectorized else obs.clone(),
        )

    def _insert_transition(self, step: Step, sent, reward, terminated, truncated) -> None:
        from gpubuf.replay import Transition

        obs = step.info[self.stager.obs_key][:, 0]  # (R, *obs)
        ids = step.env_ids
        if self._prev_obs is None:
            self._prev_obs = torch.zeros((self.n_envs, *obs.shape[1:]), dtype=obs.dtype, device=self.device)
            self._has_prev = np.zeros(self.n_envs, dtype=bool)
        dev_ids = self._staging.to_device(torch.from_numpy(ids), "__transition_ids__")
        host = {"action": sent, "reward": np.asarray(reward, dtype=np.float32),
                "terminated": np.asarray(terminated, dtype=bool), "truncated": np.asarray(truncated, dtype=bool)}
        if self.transitions.vectorized_env:
            if self._has_prev.all():  # rows in env order; a reset frame's row is flagged truncated
                order = np.argsort(ids)
                host["truncated"] = host["truncated"] | step.first
                self.transitions.insert(Transition(
                    observation=self._prev_obs[None], next_observation=None,
                    **{k: v[order][None] for k, v in host.items()}))
        else:
            keep = self._has_prev[ids] & ~step.first
            if keep.any():
                rows = np.flatnonzero(keep)
                dev_rows = self._staging.to_device(torch.from_numpy(rows), "__transition_rows__")
                self.transitions.insert(Transition(
                    observation=self._prev_obs[dev_ids[dev_rows]], next_observation=obs[dev_rows],
                    **{k: v[rows] for k, v in host.items()}))
        if len(ids) == self.n_envs and (ids == np.arange(self.n_envs)).all():
            self._prev_obs.copy_(obs)  # sync, in env order: a plain copy (index_copy_ is ~40x slower on CPU)
        else:
            self._prev_obs.index_copy_(0, dev_ids, obs)
        self._has_prev[ids] = True
