"""Same-step envs: the buffer that keeps each true final observation (``vectorized_env=False``) refuses n-step
returns and frame stacks naming the buffer that has them, and a sample of single transitions given to a vectorized
buffer names ``vectorized_env=False``; the two buffers behave as docs/replay.md's table says."""

import numpy as np
import pytest

import gpubuf

gym = pytest.importorskip("gymnasium")
from gymnasium.vector import AutoresetMode  # noqa: E402


def same_step_source(E=2):
    env = gym.make_vec("CartPole-v1", num_envs=E, vectorization_mode="sync", max_episode_steps=6,
                       vector_kwargs={"autoreset_mode": AutoresetMode.SAME_STEP})
    return env, gpubuf.VectorEnvSource(env, device="cpu")


def test_single_transitions_refuse_returns_and_stacks_naming_the_buffer_that_has_them():
    env, source = same_step_source()
    flat = gpubuf.TransitionBuffer(64, 4, source.transition_sample(vectorized=False), vectorized_env=False,
                                   device="cpu", seed=0)
    source.transitions = flat
    source.reset(seed=0)
    for _ in range(12):
        source.step(np.zeros(2, np.int64))
    flat.sample()  # 1-step transitions, each with its true next observation
    for kw in ({"n_step_return": (3, 0.99)}, {"frame_stack": 4}):
        with pytest.raises(ValueError, match=r"vectorized_env=False buffer holds single transitions.*build a "
                                             r"vectorized buffer from the source's transition_sample\(\)"):
            flat.sample(**kw)
    # the other choice: a vectorized buffer takes returns, and never draws a truncated last transition
    vec = gpubuf.TransitionBuffer(64, 4, source.transition_sample(), device="cpu", seed=0)
    source.transitions = vec
    for _ in range(12):
        source.step(np.zeros(2, np.int64))
    batch = vec.sample(batch_size=32, n_step_return=(3, 0.99))
    assert batch.discount.shape == (32,)
    env.close()


def test_a_vectorized_buffer_given_single_transitions_names_vectorized_env():
    env, source = same_step_source()
    with pytest.raises(ValueError, match=r"expected leaves shaped \(T, E, \.\.\.\), got \(1,\); single transitions "
                                         r".*transition_sample\(vectorized=False\), need vectorized_env=False"):
        gpubuf.TransitionBuffer(64, 4, source.transition_sample(vectorized=False))
    env.close()
