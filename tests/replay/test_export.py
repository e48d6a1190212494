"""Episodes out of a replay buffer (gpubuf.replay.feeds.export): a real gymnasium vector env logs every step each
sub-env took; the buffer's episodes, the Minari dataset loaded back with Minari and the HDF5 file read back with h5py
must each be exactly those episodes, step by step."""

import dataclasses

import numpy as np
import pytest
from extras import needs

gym = needs("gymnasium")
from fixtures import make_transition  # noqa: E402
from gymnasium.vector import AutoresetMode, SyncVectorEnv  # noqa: E402

from gpubuf import TransitionBuffer, VectorEnvSource  # noqa: E402
from gpubuf.replay import export  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
E, K = 3, 120


class Logged(gym.Wrapper):
    """Logs each finished episode of one sub-env: observations (T + 1), actions, rewards, terminations,
    truncations."""

    def __init__(self, env, done: list):
        super().__init__(env)
        self.done, self.ep = done, None

    def reset(self, **kw):
        obs, info = self.env.reset(**kw)
        self.ep = {"observations": [obs], "actions": [], "rewards": [], "terminations": [], "truncations": []}
        return obs, info

    def step(self, action):
        obs, r, te, tr, info = self.env.step(action)
        for key, v in (("observations", obs), ("actions", action), ("rewards", r), ("terminations", te),
                       ("truncations", tr)):
            self.ep[key].append(np.array(v))  # a copy: the vector env reuses its action array
        if te or tr:
            self.done.append({k: np.array(v) for k, v in self.ep.items()})
        return obs, r, te, tr, info


def run(task="CartPole-v1", mode=AutoresetMode.NEXT_STEP, rows=K + 4):
    logs = [[] for _ in range(E)]
    steps = {"CartPole-v1": 25, "Pendulum-v1": 12}[task]  # CartPole terminates and truncates
    env = SyncVectorEnv([lambda log=log: Logged(gym.make(task, max_episode_steps=steps), log) for log in logs],
                        autoreset_mode=mode)
    src = VectorEnvSource(env, device="cpu", info_keys={})
    buf = TransitionBuffer(E * rows, 8, src.transition_sample(extra={"t": np.int64(0)}), device="cpu")
    src.transitions = buf
    src.reset(seed=0)
    rng = np.random.default_rng(0)
    for t in range(K):
        a = rng.integers(0, 2, E) if src.n_actions else rng.uniform(-2, 2, (E, 1)).astype(np.float32)
        src.step(a, extra={"t": np.full(E, t)})
    return buf, logs


def assert_same(got: dict, want: dict):
    np.testing.assert_array_equal(got["observations"], want["observations"].astype(got["observations"].dtype))
    np.testing.assert_array_equal(np.reshape(got["actions"], want["actions"].shape),
                                  want["actions"].astype(np.asarray(got["actions"]).dtype))
    np.testing.assert_allclose(got["rewards"], want["rewards"], rtol=1e-6)
    np.testing.assert_array_equal(got["terminations"], want["terminations"])
    # a step the env reported both terminated and truncated is a termination (the buffer keeps no truncation there)
    np.testing.assert_array_equal(got["truncations"], want["truncations"] & ~want["terminations"])


@pytest.mark.parametrize("task", ["CartPole-v1", "Pendulum-v1"])
def test_episodes_are_the_episodes_each_sub_env_played(task):
    buf, logs = run(task)
    eps = list(export.episodes(buf, first_is_reset=True))
    per_env = [[e for e in eps if e["env"] == i] for i in range(E)]
    for i in range(E):
        # every logged episode, but one that ended on the last step (its final row comes with the next step)
        assert len(logs[i]) - 1 <= len(per_env[i]) <= len(logs[i]) and len(per_env[i]) >= 3
        for got, want in zip(per_env[i], logs[i], strict=False):
            assert_same(got, want)
            assert got["infos"]["t"].shape == (len(want["rewards"]) + 1,)
    assert any(e["truncations"][-1] for e in eps)
    assert any(e["terminations"][-1] for e in eps) or task != "CartPole-v1"
    # without first_is_reset, each env's first episode is left out (its start is not known to be a reset)
    assert len(list(export.episodes(buf))) == len(eps) - E


def test_a_wrapped_ring_exports_only_whole_episodes():
    buf, logs = run(rows=40)  # the ring overwrote the first 50 rows of each env
    eps = list(export.episodes(buf, first_is_reset=True))  # the ring wrapped: the first rows are no reset frames
    for i in range(E):
        mine = [e for e in eps if e["env"] == i]
        assert mine and len(mine) < len(logs[i]) - 1
        by_start = {log["observations"][0].tobytes(): log for log in logs[i]}
        for got in mine:  # each one of the env's episodes, whole
            assert_same(got, by_start[got["observations"][0].tobytes()])
        assert mine[0]["first_step"] > 0


def test_minari_and_hdf5_round_trips(tmp_path, monkeypatch):
    minari = needs("minari")
    h5py = needs("h5py")
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari"))
    buf, logs = run()
    eps = list(export.episodes(buf, first_is_reset=True))
    export.to_minari(buf, "gpubuf/cartpole-test-v0", env="CartPole-v1", first_is_reset=True, author="gpubuf tests")
    loaded = minari.load_dataset("gpubuf/cartpole-test-v0")
    assert loaded.total_episodes == len(eps) and loaded.total_steps == sum(len(e["rewards"]) for e in eps)
    for ep, want in zip(loaded.iterate_episodes(), eps, strict=True):
        assert_same({"observations": ep.observations, "actions": ep.actions, "rewards": ep.rewards,
                     "terminations": ep.terminations, "truncations": ep.truncations}, want)
        np.testing.assert_array_equal(ep.infos["t"], want["infos"]["t"])

    path = tmp_path / "episodes.h5"
    assert export.to_hdf5(buf, path, first_is_reset=True) == len(eps)
    with h5py.File(path) as f:
        assert f.attrs["total_episodes"] == len(eps)
        for i, want in enumerate(eps):
            g = f[f"episode_{i}"]
            assert g.attrs["env"] == want["env"] and g.attrs["first_step"] == want["first_step"]
            assert_same({k: g[k][()] for k in ("observations", "actions", "rewards", "terminations", "truncations")},
                        want)
            np.testing.assert_array_equal(g["infos/t"][()], want["infos"]["t"])


def test_stored_next_observations_give_the_final_observation():
    """A vectorized buffer that stores next_observation: episodes end at terminated | truncated rows."""
    tr = make_transition(0, 10, 2, trunc_steps=(4,))
    tr.terminated[7] = True
    tr = dataclasses.replace(tr, next_observation=tr.observation + 0.5)
    buf = TransitionBuffer(2 * 16, 4, dataclasses.replace(tr, **{k: getattr(tr, k)[:1] for k in (
        "observation", "action", "reward", "terminated", "truncated", "next_observation")},
        info={"step": tr.info["step"][:1]}), device="cpu")
    buf.insert(tr)
    eps = list(export.episodes(buf))  # rows 5..7 end terminated (rows 0..4 precede the first end: left out)
    assert [e["env"] for e in eps] == [0, 1]
    for e, ep in enumerate(eps):
        np.testing.assert_array_equal(ep["observations"][:, 0], [g * 2 + e for g in (5, 6, 7)] + [7 * 2 + e + 0.5])
        assert list(ep["terminations"]) == [False, False, True] and not ep["truncations"].any()
    first = list(export.episodes(buf, first_is_reset=True))
    assert len(first) == 4 and list(first[0]["truncations"]) == [False] * 4 + [True]


def test_buffers_without_final_observations_or_episodes_are_refused():
    buf, _ = run(mode=AutoresetMode.SAME_STEP)
    with pytest.raises(ValueError, match="buffer: it keeps no final observations"):
        list(export.episodes(buf))
    flat = TransitionBuffer(16, 4, make_transition(0, 1, 1, vectorized=False), vectorized_env=False, device="cpu")
    with pytest.raises(ValueError, match="buffer: its transitions interleave the envs"):
        list(export.episodes(flat))
    good, _ = run()
    with pytest.raises(ValueError, match="env: give the env"):
        export.to_minari(good, "gpubuf/x-v0")
    with pytest.raises(TypeError, match="first_is_reset: expected True or False"):
        list(export.episodes(good, first_is_reset=1))
    src = VectorEnvSource(gym.make_vec("CartPole-v1", 2, vectorization_mode="sync"), device="cpu")
    empty = TransitionBuffer(2 * 8, 4, src.transition_sample(), device="cpu")
    assert list(export.episodes(empty)) == []
    with pytest.raises(ValueError, match="buffer: it holds no whole episode"):
        export.to_minari(empty, "gpubuf/y-v0", env="CartPole-v1")


def test_nested_leaves_and_non_buffers():
    nested = make_transition(0, 1, 2, multi_agent=True)
    buf = TransitionBuffer(2 * 8, 4, nested, device="cpu")
    with pytest.raises(ValueError, match="buffer: nested observations or actions"):
        list(export.episodes(buf))
    with pytest.raises(TypeError, match="buffer: expected a TransitionBuffer, got object"):
        list(export.episodes(object()))
    tr = make_transition(0, 6, 2, trunc_steps=(2,))
    tr = dataclasses.replace(tr, next_observation=tr.observation + 0.5,
                             info={"agent": {"lp": tr.reward.clone()}})
    flat = TransitionBuffer(2 * 8, 4, dataclasses.replace(tr, **{k: getattr(tr, k)[:1] for k in (
        "observation", "action", "reward", "terminated", "truncated", "next_observation")},
        info={"agent": {"lp": tr.reward[:1]}}), device="cpu")
    flat.insert(tr)
    eps = list(export.episodes(flat, first_is_reset=True))
    assert eps and all(set(e["infos"]) == {"agent/lp"} for e in eps)  # a nested info leaf: its path joined by /
