"""The gymnasium wrappers on real envs, single and vector: ActionRepeatWrapper sums rewards and stops each env on its
own end; FrameStackInfoWrapper stacks ``info[key]`` oldest first, padded with the episode's first frame and restarted
per env on reset and autoreset; bad arguments are named."""

from collections import deque

import numpy as np
import pytest
import torch
from extras import needs

gym = needs("gymnasium")  # absent on the GPU machine, which has no registry

from gymnasium.vector import AutoresetMode, SyncVectorEnv  # noqa: E402

from gpubuf.sources.wrappers import (  # noqa: E402
    ActionRepeatWrapper,
    FrameStackInfoWrapper,
    VectorActionRepeatWrapper,
    VectorFrameStackInfoWrapper,
)


class ObsToInfo(gym.Wrapper):
    """Lifts the observation into ``info["pixels"]``, as stable-worldmodel's EverythingToInfoWrapper does."""

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        return obs, {**info, "pixels": obs.copy()}

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        return obs, reward, terminated, truncated, {**info, "pixels": obs.copy()}


def cartpole(max_steps=500):
    return ObsToInfo(gym.make("CartPole-v1", max_episode_steps=max_steps))


# ------------------------------------------------------------------ action repeat


def test_single_env_sums_rewards_and_stops_on_truncation():
    env = ActionRepeatWrapper(cartpole(max_steps=5), repeat=3)
    env.reset(seed=0)
    _, reward, terminated, truncated, _ = env.step(0)
    assert reward == 3.0 and not (terminated or truncated)
    _, reward, terminated, truncated, _ = env.step(1)
    assert reward == 2.0 and truncated  # stopped early at the 5th step


def test_vector_env_stops_each_env_on_its_own_and_autoresets():
    vec = SyncVectorEnv([lambda: cartpole(max_steps=4), lambda: cartpole(max_steps=7)])
    env = ActionRepeatWrapper(vec, 3)
    assert isinstance(env, VectorActionRepeatWrapper)
    env.reset(seed=0)
    actions = np.array([0, 1])
    _, reward, _, truncated, _ = env.step(actions)
    np.testing.assert_array_equal(reward, [3, 3])
    _, reward, _, truncated, _ = env.step(actions)
    np.testing.assert_array_equal(reward, [1, 3])  # env 0 hit its limit after one more step
    np.testing.assert_array_equal(truncated, [True, False])
    assert vec.envs[0].env.env._elapsed_steps == 4  # not stepped again in that call
    _, reward, _, truncated, _ = env.step(actions)
    np.testing.assert_array_equal(reward, [0, 1])  # env 0 auto-resets (NEXT_STEP), env 1 truncates at 7
    np.testing.assert_array_equal(truncated, [False, True])


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_repeat_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match=f"repeat: expected a positive int, got {bad!r}"):
        ActionRepeatWrapper(cartpole(), bad)


def test_vector_action_repeat_rejects_async_vector_envs():
    vec = gym.vector.AsyncVectorEnv([cartpole, cartpole])
    try:
        with pytest.raises(TypeError, match="env: expected a SyncVectorEnv \\(got AsyncVectorEnv\\)"):
            ActionRepeatWrapper(vec, 2)
    finally:
        vec.close()


# ------------------------------------------------------------------ frame stack


class StackModel:
    """Per-env deques that restart on reset frames: what the stacks must hold."""

    def __init__(self, n, k):
        self.stacks = [deque(maxlen=k) for _ in range(n)]
        self.k = k

    def push(self, frames, fresh):
        for i, (frame, new) in enumerate(zip(frames, fresh, strict=True)):
            if new:
                self.stacks[i].clear()
            self.stacks[i].append(frame)

    def expected(self):
        return np.stack([np.stack([s[0]] * (self.k - len(s)) + list(s)) for s in self.stacks])


def test_single_env_stack_pads_then_slides_and_restarts_on_reset(device):
    env = FrameStackInfoWrapper(cartpole(), num_stack=3, device=device)
    model = StackModel(1, 3)
    obs, info = env.reset(seed=1)
    model.push([obs], [True])
    assert info["pixels"].shape == (3, 4) and info["pixels"].device.type == torch.device(device).type
    for t in range(5):
        obs, *_, info = env.step(t % 2)
        model.push([obs], [False])
        np.testing.assert_array_equal(info["pixels"].cpu().numpy(), model.expected()[0])
    obs, info = env.reset()
    model.push([obs], [True])
    np.testing.assert_array_equal(info["pixels"].cpu().numpy(), np.stack([obs] * 3))


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP])
def test_vector_stack_restarts_per_env_on_autoreset(device, mode):
    vec = SyncVectorEnv([lambda: cartpole(max_steps=6), lambda: cartpole(max_steps=9)], autoreset_mode=mode)
    env = FrameStackInfoWrapper(vec, num_stack=4, device=device)
    assert isinstance(env, VectorFrameStackInfoWrapper)
    model = StackModel(2, 4)
    obs, info = env.reset(seed=2)
    model.push(obs, [True, True])
    ended = np.zeros(2, dtype=bool)
    restarts = 0
    for t in range(20):
        obs, _, terminated, truncated, info = env.step(np.array([t % 2, (t + 1) % 2]))
        done = terminated | truncated
        fresh = ended if mode == AutoresetMode.NEXT_STEP else done
        restarts += int(fresh.sum())
        model.push(obs, fresh)  # the vector env returns the reset observation of an env that restarted
        assert info["pixels"].shape == (2, 4, 4)
        np.testing.assert_array_equal(info["pixels"].cpu().numpy(), model.expected())
        ended = done
    assert restarts >= 3, "the envs did not auto-reset: the test exercised nothing"


def test_vector_stack_frames_are_the_envs_observations(device):
    vec = SyncVectorEnv([cartpole, cartpole])
    env = FrameStackInfoWrapper(vec, num_stack=2, device=device)
    obs, info = env.reset(seed=3)
    obs2, *_, info = env.step(np.array([0, 1]))
    np.testing.assert_array_equal(info["pixels"].cpu().numpy(), np.stack([obs, obs2], axis=1))


def test_frame_stack_rejects_bad_num_stack():
    with pytest.raises(ValueError, match="num_stack: expected a positive int, got 0"):
        FrameStackInfoWrapper(cartpole(), num_stack=0)


def test_frame_stack_names_a_missing_key():
    env = FrameStackInfoWrapper(cartpole(), key="rgb")
    with pytest.raises(KeyError, match="rgb: not in the env's info"):
        env.reset(seed=0)
