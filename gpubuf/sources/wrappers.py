"""Gymnasium wrappers: action repeat, and frame stacking in ``info`` held in a device HistoryBuffer.

Both accept a single ``gymnasium.Env`` or a ``gymnasium.vector.VectorEnv`` and return the matching wrapper
(``ActionRepeatWrapper(vec_env, 4)`` is a :class:`VectorActionRepeatWrapper`). Needs gymnasium."""

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode, SyncVectorEnv, VectorEnv, VectorWrapper

from gpubuf._core.inputs import as_tensor, positive_int
from gpubuf.history.buffer import HistoryBuffer


class ActionRepeatWrapper(gym.Wrapper):
    """Repeat each action ``repeat`` times, summing rewards; stop early on termination or truncation."""

    def __new__(cls, env, repeat: int = 1):
        if isinstance(env, VectorEnv):
            return VectorActionRepeatWrapper(env, repeat)
        return super().__new__(cls)

    def __init__(self, env: gym.Env, repeat: int = 1):
        super().__init__(env)
        self.repeat = positive_int("repeat", repeat)

    def step(self, action):
        total = 0.0
        for _ in range(self.repeat):
            obs, reward, terminated, truncated, info = self.env.step(action)
            total += float(reward)
            if terminated or truncated:
                break
        return obs, total, terminated, truncated, info


class VectorActionRepeatWrapper(VectorWrapper):
    """Action repeat for a ``SyncVectorEnv``: each sub-env stops on its own termination or truncation.

    The sub-envs are wrapped in place with :class:`ActionRepeatWrapper`, so an env that finished is not stepped again in
    that call and the vector env's own autoreset sees the final step. An ``AsyncVectorEnv`` runs its envs in other
    processes: wrap each env in its ``env_fns`` instead."""

    def __init__(self, env: VectorEnv, repeat: int = 1):
        self.repeat = positive_int("repeat", repeat)
        base = env.unwrapped
        if not isinstance(base, SyncVectorEnv):
            raise TypeError(f"env: expected a SyncVectorEnv (got {type(base).__name__}); for other vector envs wrap "
                            "each env: AsyncVectorEnv([lambda: ActionRepeatWrapper(make_env(), repeat), ...])")
        super().__init__(env)
        base.envs = [ActionRepeatWrapper(e, self.repeat) for e in base.envs]


class FrameStackInfoWrapper(gym.Wrapper):
    """Replace ``info[key]`` with its last ``num_stack`` frames ``(num_stack, ...)``, oldest first.

    Frames live in a :class:`~gpubuf.HistoryBuffer` on ``device``; the stack is a torch tensor there. Until
    ``num_stack`` frames exist it is left-padded with the episode's first frame; ``reset`` restarts it."""

    def __new__(cls, env, num_stack: int = 4, key: str = "pixels", *, device=None):
        if isinstance(env, VectorEnv):
            return VectorFrameStackInfoWrapper(env, num_stack, key, device=device)
        return super().__new__(cls)

    def __init__(self, env: gym.Env, num_stack: int = 4, key: str = "pixels", *, device=None):
        super().__init__(env)
        self.num_stack = positive_int("num_stack", num_stack)
        self.key = key
        self.history = HistoryBuffer(1, self.num_stack, device=device)

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        self.history.reset()
        return obs, self._push(info)

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        return obs, reward, terminated, truncated, self._push(info)

    def _push(self, info: dict) -> dict:
        frame = as_tensor(_frames(info, self.key), self.key)
        self.history.append({self.key: frame[None, None]})
        info[self.key] = self.history.get(self.num_stack)[self.key][0]
        return info


class VectorFrameStackInfoWrapper(VectorWrapper):
    """Frame stacking for a vector env: ``info[key]`` ``(num_envs, ...)`` -> ``(num_envs, num_stack, ...)``.

    An env that auto-resets starts a fresh stack from its reset frame (``NEXT_STEP``: the step after its episode ended;
    ``SAME_STEP``: the step it ended). ``reset(options={"reset_mask": m})`` restarts only the masked envs."""

    def __init__(self, env: VectorEnv, num_stack: int = 4, key: str = "pixels", *, device=None):
        super().__init__(env)
        self.num_stack = positive_int("num_stack", num_stack)
        self.key = key
        self.history = HistoryBuffer(self.num_envs, self.num_stack, device=device)
        mode = env.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP)
        self.autoreset_mode = mode if isinstance(mode, AutoresetMode) else AutoresetMode(mode)
        # envs whose episode ended at the last step
        self._ended = np.zeros(self.num_envs, dtype=bool)

    def reset(self, *, seed=None, options=None):
        obs, info = self.env.reset(seed=seed, options=options)
        mask = (options or {}).get("reset_mask")
        ids = np.arange(self.num_envs) if mask is None else np.flatnonzero(mask)
        self._ended[ids] = False
        self.history.reset(ids)
        return obs, self._push(info, ids)

    def step(self, actions):
        obs, reward, terminated, truncated, info = self.env.step(actions)
        ended = np.asarray(terminated) | np.asarray(truncated)
        if self.autoreset_mode == AutoresetMode.NEXT_STEP:
            fresh = self._ended
        elif self.autoreset_mode == AutoresetMode.SAME_STEP:
            fresh = ended
        else:
            fresh = np.zeros(self.num_envs, dtype=bool)
        self._ended = ended
        self.history.reset(np.flatnonzero(fresh))
        return obs, reward, terminated, truncated, self._push(info, None)

    def _push(self, info: dict, ids) -> dict:
        frames = as_tensor(_frames(info, self.key), self.key)  # (num_envs, ...)
        if ids is not None:
            frames = frames[ids]
        self.history.append({self.key: frames[:, None]}, env_ids=ids)
        info[self.key] = self.history.get(self.num_stack)[self.key]
        return info


def _frames(info: dict, key: str):
    if key not in info:
        raise KeyError(f"{key}: not in the env's info (keys: {sorted(info)})")
    return info[key]
