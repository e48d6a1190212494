"""Provenance of flat buffers: ``locate()`` on a ``vectorized_env=False`` buffer fed by a source with several envs
reports the env each transition came from (the source's ``info["env_id"]``), on a real gymnasium vector env, an
EnvPool async pool and a storage_dir; a flat buffer without that leaf reports its one stream, env 0."""

import numpy as np
import pytest
import torch

import gpubuf

gym = pytest.importorskip("gymnasium")


def observed_envs(rows: np.ndarray, shown: dict) -> np.ndarray:
    """The env that showed each observation of ``rows`` (R, D) (``shown``: observation bytes -> env)."""
    return np.array([shown[r.tobytes()] for r in rows])


@pytest.mark.parametrize("mode", ["NEXT_STEP", "SAME_STEP"])
def test_a_flat_buffer_fed_by_a_vector_env_locates_each_row_to_its_env(host_backend, tmp_path, mode):
    from gymnasium.vector import AutoresetMode

    E = 3
    env = gym.make_vec("CartPole-v1", num_envs=E, vectorization_mode="sync", max_episode_steps=9,
                       vector_kwargs={"autoreset_mode": getattr(AutoresetMode, mode)})
    source = gpubuf.VectorEnvSource(env, device="cpu")
    sample = source.transition_sample(vectorized=False)
    assert sample.info["env_id"].dtype == torch.int64
    replay = gpubuf.TransitionBuffer(E * 40, 16, sample, vectorized_env=False, device="cpu", seed=0,
                                     storage_dir=tmp_path / "flat")
    source.transitions = replay
    shown = {}
    step = source.reset(seed=0)
    rng = np.random.default_rng(0)
    for _ in range(30):
        obs = step.info["observation"][:, 0].numpy()
        shown.update({o.tobytes(): int(e) for o, e in zip(obs, step.env_ids, strict=True)})
        step = source.step(rng.integers(0, 2, E))
    env.close()
    batch, idx = replay.sample(batch_size=64, return_indices=True, key=0)
    env_id, row, _ = replay.locate(idx)
    want = observed_envs(batch.observation.numpy(), shown)
    assert set(want.tolist()) == set(range(E))
    np.testing.assert_array_equal(env_id.numpy(), want)
    np.testing.assert_array_equal(batch.info["env_id"].numpy(), want)
    assert (row == idx).all()
    replay.close()


def test_an_envpool_async_pool_s_flat_rows_carry_their_env():
    envpool = pytest.importorskip("envpool")
    E = 4
    env = envpool.make("CartPole-v1", env_type="gymnasium", num_envs=E, batch_size=2, seed=0)
    source = gpubuf.EnvPoolSource(env, device="cpu")
    replay = gpubuf.TransitionBuffer(200, 16, source.transition_sample(vectorized=False), vectorized_env=False,
                                     device="cpu", seed=0)
    source.transitions = replay
    shown = {}
    step = source.reset()
    for _ in range(40):
        obs = step.info["observation"][:, 0].numpy()
        shown.update({o.tobytes(): int(e) for o, e in zip(obs, step.env_ids, strict=True)})
        step = source.step(np.zeros(len(step.env_ids), np.int64), step.env_ids)
    batch, idx = replay.sample(batch_size=64, return_indices=True, key=0)
    want = observed_envs(batch.observation.numpy(), shown)
    assert len(set(want.tolist())) > 1
    np.testing.assert_array_equal(replay.locate(idx)[0].numpy(), want)


def test_a_flat_buffer_without_env_ids_is_one_stream_and_a_source_refuses_it():
    """A flat buffer of rows the caller inserted holds one stream: env 0, step its row number. A source with several
    envs refuses a flat buffer that cannot record which env each row came from."""
    rows = gpubuf.Transition(observation=np.arange(6, dtype=np.float32)[:, None], action=np.zeros(6, np.int64),
                             reward=np.zeros(6, np.float32), terminated=np.zeros(6, bool),
                             truncated=np.zeros(6, bool), next_observation=np.zeros((6, 1), np.float32))
    buf = gpubuf.TransitionBuffer(8, 4, rows, vectorized_env=False, device="cpu")
    buf.insert(rows)
    env, row, step = buf.locate(torch.tensor([0, 5]))
    assert env.tolist() == [0, 0] and step.tolist() == [0, 5]
    env = gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync")
    source = gpubuf.VectorEnvSource(env, device="cpu")
    old = source.transition_sample(vectorized=False)
    del old.info["env_id"]
    with pytest.raises(ValueError, match=r"no leaf info\['env_id'\].*transition_sample\(vectorized=False\)"):
        source.transitions = gpubuf.TransitionBuffer(64, 4, old, vectorized_env=False, device="cpu")
    env.close()
