"""An env that terminates on its last allowed step: gymnasium's ``TimeLimit`` reports the row both ``terminated``
and ``truncated``. That transition is a termination (discount 0, no successor needed) and is drawn like any other,
on a real CartPole run through ``VectorEnvSource`` in the same-step autoreset mode."""

import numpy as np
import pytest
import torch
from extras import needs

import gpubuf

gym = needs("gymnasium")
from gymnasium.vector import AutoresetMode  # noqa: E402

E = 4


def cartpole_run(device, cls, steps=150):
    """A vectorized buffer fed by CartPole with a 12-step time limit and a policy pushing right two steps in three,
    so that some episodes fall exactly on their 12th step; returns the buffer and its stored rows."""
    env = gym.make_vec("CartPole-v1", num_envs=E, vectorization_mode="sync", max_episode_steps=12,
                       vector_kwargs={"autoreset_mode": AutoresetMode.SAME_STEP})
    source = gpubuf.VectorEnvSource(env)
    replay = cls(E * (steps + 8), 32, source.transition_sample(), device=device, seed=0)
    source.transitions = replay
    source.reset(seed=0)
    rng = np.random.default_rng(0)
    for t in range(steps):
        source.step(np.ones(E, np.int64) if t % 3 else rng.integers(0, 2, E))
    env.close()
    return replay, {k: v.cpu().numpy()[:steps] for k, v in replay.state_dict()["data"].items()}


@pytest.mark.parametrize("cls", [gpubuf.TransitionBuffer, gpubuf.PrioritizedTransitionBuffer])
def test_cartpole_terminations_on_the_time_limit_step_are_drawn(backend, device, cls):
    replay, data = cartpole_run(device, cls)
    both = data["terminated"] & data["truncated"]  # (rows, E)
    rows, envs = np.nonzero(both[:-1])  # their successors are written
    assert len(rows) >= 3, "the run should end some episodes exactly on the time-limit step"
    flat = rows * E + envs
    mass = replay.sampling_mass(True).cpu().numpy()
    assert (mass[flat] > 0).all()
    cut = np.flatnonzero((data["truncated"] & ~data["terminated"])[:-1].reshape(-1))
    assert (mass[cut] == 0).all()
    # such starts, sampled (prioritized: made far likelier than the others): n-step returns end on them with
    # discount 0, their own reward, terminated
    if isinstance(replay, gpubuf.PrioritizedTransitionBuffer):
        replay.update_priorities(torch.from_numpy(flat), torch.full((len(flat),), 1e3))
    batch, idx = replay.sample(batch_size=len(flat) * 40, with_replacement=True, return_indices=True, key=0,
                               n_step_return=(3, 0.9))
    idx = idx.cpu().numpy()
    drawn = np.isin(flat, idx)
    assert drawn.all() if isinstance(replay, gpubuf.PrioritizedTransitionBuffer) else drawn.any()
    for f in flat[drawn]:
        hit = torch.from_numpy(idx == f)
        assert batch.terminated.cpu()[hit].all() and batch.discount.cpu()[hit].eq(0).all()
        assert batch.reward.cpu()[hit].eq(float(data["reward"].reshape(-1)[f])).all()
