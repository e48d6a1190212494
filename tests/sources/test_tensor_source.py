"""TensorSource on a batched simulator written in torch (standing in for a GPU simulator): envs reset inside the step
that ends their episode, with and without handing over the final observation.

The simulator logs every env step it takes (observation before, action, reward, flags, observation after): with final
observations, each transition of a ``vectorized_env=False`` buffer is exactly one logged step; a vectorized buffer (with
or without them) holds one row per env per step, and no window, next observation, n-step return or stack crosses or
bootstraps across an episode end.
"""

import numpy as np
import pytest
import torch
from extras import needs
from fixtures import reference_return

from gpubuf import HistoryBuffer, TransitionBuffer
from gpubuf.sources.tensors import TensorSource

gym = needs("gymnasium")


class TorchSim:
    """``n`` point masses on a line, batched in torch: obs ``(n, 2)`` (position, velocity), action ``(n, 1)`` in
    ``[-1, 1]``; an episode terminates when ``|position| > 1`` and is truncated after ``limit`` steps; an env that ends
    resets in the same step (its returned observation is the reset frame). Logs every env step."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
    action_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)

    def __init__(self, n, limit=9, seed=0):
        self.n, self.limit = n, limit
        self.g = torch.Generator().manual_seed(seed)
        self.state = self._fresh(n)
        self.t = torch.zeros(n, dtype=torch.int64)
        self.log = [[] for _ in range(n)]  # per env: (obs before, action, reward, terminated, truncated, obs after)

    def _fresh(self, k):
        return torch.rand(k, 2, generator=self.g) * 0.4 - 0.2

    def reset(self):
        return self.state.clone()

    def step(self, action):
        a = action.clamp(-1, 1)
        before = self.state.clone()
        vel = self.state[:, 1] + 0.3 * a[:, 0]
        pos = self.state[:, 0] + vel
        after = torch.stack([pos, vel], 1)
        self.t += 1
        terminated = pos.abs() > 1
        truncated = (self.t >= self.limit) & ~terminated
        reward = -pos.abs()
        ended = terminated | truncated
        self.state = after.clone()
        self.state[ended] = self._fresh(int(ended.sum()))
        self.t[ended] = 0
        for e in range(self.n):
            self.log[e].append((before[e].numpy(), a[e].numpy(), float(reward[e]), bool(terminated[e]),
                                bool(truncated[e]), after[e].numpy()))
        return self.state.clone(), reward, terminated, truncated, after  # after: the final observations


def run(final_obs, vectorized, K=60, E=4, n_steps=1, history=None):
    sim = TorchSim(E)
    src = TensorSource(E, sim.observation_space, sim.action_space, final_obs=final_obs, device="cpu",
                       history=history)
    buf = TransitionBuffer(E * (K + 4), 16, src.transition_sample(vectorized), vectorized_env=vectorized,
                           n_steps=n_steps, device="cpu", seed=0)
    src.transitions = buf
    src.reset(sim.reset())
    g = torch.Generator().manual_seed(1)
    for _ in range(K):
        act = torch.rand(E, 1, generator=g) * 3 - 1.5  # beyond the box: stored clipped
        obs, reward, terminated, truncated, final = sim.step(act)
        src.step(act, obs, reward, terminated, truncated, final_obs=final if final_obs else None)
    return sim, src, buf


def test_with_final_observations_each_transition_is_one_simulator_step():
    sim, src, buf = run(final_obs=True, vectorized=False)
    steps = [s for log in sim.log for s in log]
    assert len(buf) == len(steps) and any(s[3] for s in steps) and any(s[4] for s in steps)
    data = {k: v[:len(buf)].numpy() for k, v in buf.state_dict()["data"].items()}
    by_obs = {s[0].tobytes(): s for s in steps}
    for i in range(len(buf)):
        s = by_obs[data["observation"][i].tobytes()]
        np.testing.assert_array_equal(data["next_observation"][i], s[5])  # the final observation at an end
        np.testing.assert_array_equal(data["action"][i], s[1])
        assert (data["reward"][i], data["terminated"][i], data["truncated"][i]) == (np.float32(s[2]), s[3], s[4])


def expected_rows(sim):
    """``(K, E, ...)`` rows without final observations: the observation before each step, its action, reward, flags."""
    cols = [np.array([[s[i] for s in log] for log in sim.log]) for i in range(5)]
    return {k: np.swapaxes(c, 0, 1) for k, c in zip(("observation", "action", "reward", "terminated", "truncated"),
                                                       cols, strict=True)}


@pytest.mark.parametrize("final_obs", [False, True])
def test_vectorized_rows_are_the_steps_and_nothing_crosses_an_end(final_obs):
    """With or without final observations, a vectorized buffer holds one row per env per step."""
    hist = HistoryBuffer(4, 16, device="cpu")
    sim, src, buf = run(final_obs=final_obs, vectorized=True, n_steps=3, history=hist)
    K = len(sim.log[0])
    want = expected_rows(sim)
    data = buf.state_dict()["data"]
    assert "info['is_last']" not in data
    for key, value in want.items():
        np.testing.assert_array_equal(data[key][:K].numpy(), value.astype(data[key].numpy().dtype), err_msg=key)
    ends = want["terminated"] | want["truncated"]
    assert want["terminated"].any() and want["truncated"].any()
    after = np.swapaxes(np.array([[s[5] for s in log] for log in sim.log]), 0, 1)  # what each action led to
    # the history restarts at each reset frame: its newest frame is the simulator's state
    np.testing.assert_array_equal(hist.get(1)["observation"][:, 0].numpy(), sim.state.numpy())

    # next observations: a truncated last transition is never drawn; the others are what the action led to
    b, idx = buf.sample(key=2, batch_size=200, with_next_obs=True, boundaries="forbid", return_indices=True)
    env, row, _ = (t.numpy() for t in buf.locate(idx))
    rows = row[:, None] + np.arange(3)
    assert not want["truncated"][rows, env[:, None]].any()
    assert not ends[rows[:, :-1], env[:, None]].any()  # an episode end only at a window's last row
    live = ~want["terminated"][rows, env[:, None]]
    np.testing.assert_array_equal(b.next_observation.numpy()[live], after[rows, env[:, None]][live])


@pytest.mark.parametrize("final_obs", [False, True])
def test_vectorized_returns_and_stacks_stop_at_ends(final_obs):
    sim, src, buf = run(final_obs=final_obs, vectorized=True, K=80)
    K, gamma = len(sim.log[0]), 0.5
    want = expected_rows(sim)
    after = np.swapaxes(np.array([[s[5] for s in log] for log in sim.log]), 0, 1)
    b, idx = buf.sample(key=3, batch_size=256, n_step_return=(3, gamma), frame_stack=2, return_indices=True)
    env, row, _ = (t.numpy() for t in buf.locate(idx))
    for i in range(len(idx)):
        e, r = env[i], row[i]
        assert not want["truncated"][r, e]  # its successor is unknown: never a start with a bootstrap
        new_episode = r == 0 or want["terminated"][r - 1, e] or want["truncated"][r - 1, e]
        older = r if new_episode else r - 1
        np.testing.assert_array_equal(b.observation[i].numpy(), np.stack([want["observation"][older, e],
                                                                          want["observation"][r, e]]))
        total, disc, m = reference_return(want["reward"], want["terminated"], want["truncated"], r, e, K, 3, gamma)
        assert b.reward[i].item() == pytest.approx(total, rel=1e-5, abs=1e-6), (e, r)
        assert b.discount[i].item() == pytest.approx(disc, rel=1e-6), (e, r)
        if disc:  # the bootstrap observation: what the m-th action led to, inside the episode
            np.testing.assert_array_equal(b.next_observation[i, -1].numpy(), after[r + m - 1, e])


@pytest.mark.parametrize("final_obs, vectorized, match", [
    (False, False, "transitions: an env without final observations needs a vectorized buffer"),
])
def test_a_buffer_the_rows_do_not_fit_is_refused(final_obs, vectorized, match):
    sim = TorchSim(2)
    src = TensorSource(2, sim.observation_space, sim.action_space, final_obs=final_obs, device="cpu")
    buf = TransitionBuffer(64, 4, src.transition_sample(vectorized), vectorized_env=vectorized, device="cpu")
    with pytest.raises(ValueError, match=match):
        src.transitions = buf
    assert src.transitions is None


def test_bad_steps_are_refused_before_anything_is_written():
    sim = TorchSim(2)
    src = TensorSource(2, sim.observation_space, sim.action_space, final_obs=True, device="cpu",
                       info_keys={"t": np.int64(0)})
    buf = TransitionBuffer(64, 4, src.transition_sample(False), vectorized_env=False, device="cpu")
    src.transitions = buf
    with pytest.raises(RuntimeError, match="reset"):
        src.step(torch.zeros(2, 1), sim.reset(), torch.zeros(2), torch.zeros(2, dtype=torch.bool),
                 torch.zeros(2, dtype=torch.bool), sim.reset(), infos={"t": np.zeros(2, np.int64)})
    src.reset(sim.reset(), infos={"t": np.zeros(2, np.int64)})
    obs, flags, t = sim.reset(), torch.zeros(2, dtype=torch.bool), {"t": np.zeros(2, np.int64)}
    good = dict(actions=torch.zeros(2, 1), obs=obs, reward=torch.zeros(2), terminated=flags, truncated=flags,
                final_obs=obs, infos=t)
    for change, exc, match in (
            ({"reward": torch.zeros(3)}, ValueError, r"reward: expected shape \(2,\)"),
            ({"terminated": torch.tensor([0, 2])}, ValueError, "terminated: expected bools"),
            ({"final_obs": None}, ValueError, "final_obs: this source was built with final_obs=True"),
            ({"final_obs": torch.zeros(2, 3)}, ValueError, r"final_obs: expected shape \(2, 2\)"),
            ({"infos": {}}, ValueError, r"infos: expected the keys of info_keys \['t'\]"),
            ({"infos": {"t": np.zeros(3)}}, ValueError, r"infos\['t'\]: expected shape"),
            ({"actions": torch.zeros(3, 1)}, ValueError, "actions"),
            ({"actions": torch.full((2, 1), float("nan"))}, ValueError, "actions")):
        with pytest.raises(exc, match=match):
            src.step(**{**good, **change})
    assert len(buf) == 0
    src.step(**good)
    assert len(buf) == 2
    for bad, exc, match in ((dict(n_envs=0), ValueError, "n_envs"), (dict(final_obs=1), TypeError, "final_obs"),
                            (dict(observation_space=object()), TypeError, "observation_space")):
        kw = dict(n_envs=2, observation_space=sim.observation_space, action_space=sim.action_space, final_obs=True)
        with pytest.raises(exc, match=match):
            TensorSource(**{**kw, **bad})


# ------------------------------------------------------------------ a JAX simulator through DLPack


@pytest.mark.parametrize("final_obs", [True, False])
def test_gymnax_cartpole_arrays_cross_by_dlpack(final_obs):
    """gymnax's CartPole, vmapped over 4 envs and jitted, with its own same-step auto-reset: the jax arrays go to the
    source as they are; the rows match what each env did (its ``info["final_observation"]`` at episode ends)."""
    jax = needs("jax")
    gymnax = needs("gymnax")
    jnp = jax.numpy
    env, params = gymnax.make("CartPole-v1")
    params = params.replace(max_steps_in_episode=12)  # truncations as well as terminations
    E, K = 4, 40
    step_fn = jax.jit(jax.vmap(env.step, in_axes=(0, 0, 0, None)))
    keys = jax.random.split(jax.random.PRNGKey(0), E)
    obs, state = jax.vmap(env.reset, in_axes=(0, None))(keys, params)
    space = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)
    src = TensorSource(E, space, gym.spaces.Discrete(2), final_obs=final_obs, device="cpu")
    buf = TransitionBuffer(E * (K + 4), 16, src.transition_sample(not final_obs), vectorized_env=not final_obs,
                           device="cpu")
    src.transitions = buf
    src.reset(obs)
    log = []  # (obs before, action, reward, terminated, truncated, obs after) per step, (E, ...) numpy
    rng = np.random.default_rng(0)
    for k in range(K):
        keys = jax.random.split(jax.random.PRNGKey(k + 1), E)
        act = jnp.asarray(rng.integers(0, 2, E), dtype=jnp.int32)
        nxt, state, reward, terminated, truncated, info = step_fn(keys, state, act, params)
        src.step(act, nxt, reward, terminated, truncated, final_obs=info["final_observation"] if final_obs else None)
        log.append((np.asarray(obs), np.asarray(act), np.asarray(reward), np.asarray(terminated),
                    np.asarray(truncated), np.asarray(info["final_observation"])))
        obs = nxt
    term, trunc = np.array([s[3] for s in log]), np.array([s[4] for s in log])
    assert term.any() and trunc.any()
    rows = len(buf) if final_obs else K  # transitions, or time rows of E envs
    data = {k: v[:rows].numpy() for k, v in buf.state_dict()["data"].items()}
    if final_obs:  # one transition per env step, each with its real successor
        steps = {log[k][0][e].tobytes(): (k, e) for k in range(K) for e in range(E)}
        assert len(buf) == K * E
        for i in range(len(buf)):
            k, e = steps[data["observation"][i].tobytes()]
            np.testing.assert_array_equal(data["next_observation"][i], log[k][5][e])
            assert (data["action"][i], data["terminated"][i], data["truncated"][i]) == (log[k][1][e], term[k, e],
                                                                                         trunc[k, e])
    else:  # one row per env per step, the env's own flags
        np.testing.assert_array_equal(data["observation"], np.stack([s[0] for s in log]))
        np.testing.assert_array_equal(data["action"], np.stack([s[1] for s in log]))
        np.testing.assert_array_equal(data["terminated"], term)
        np.testing.assert_array_equal(data["truncated"], trunc)
        b = buf.sample(key=1, batch_size=64, with_next_obs=True)
        assert not (b.truncated & ~b.terminated).any()  # a termination on the time-limit step is a terminal transition


def test_copies_are_refused():
    import copy
    import pickle

    sim = TorchSim(2)
    src = TensorSource(2, sim.observation_space, sim.action_space, final_obs=False, device="cpu")
    for fn in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="TensorSource: cannot be copied or pickled"):
            fn(src)


def test_jax_actions_for_a_box_pass_without_a_warning():
    """A JAX array reads as a read-only numpy view: the action check copies it rather than warn."""
    import warnings

    jnp = needs("jax").numpy
    sim = TorchSim(2)
    src = TensorSource(2, sim.observation_space, sim.action_space, final_obs=False, device="cpu")
    src.reset(sim.reset())
    obs, reward, terminated, truncated, _ = sim.step(torch.zeros(2, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step = src.step(jnp.full((2, 1), 5.0), obs, reward, terminated, truncated)
    assert (step.info["action"] == 1.0).all()  # clipped to the box


# ------------------------------------------------------------------ info fields: cast exactly or refused

INFO_CASTS = [  # (example, value, stored): stored None means refused
    (np.int64(0), 1.7, None), (np.int64(0), np.nan, None), (np.int64(0), 1.0, None), (np.uint8(0), 300, None),
    (np.uint8(0), -1, None), (np.bool_(False), 2, None), (np.float32(0), 1e300, None),
    (np.int64(0), np.int32(7), 7), (np.uint8(0), 200, 200), (np.bool_(False), 1, True), (np.float64(0), 0.1, 0.1),
    (np.float32(0), 0.1, float(np.float32(0.1))), (np.float32(0), np.int16(300), 300.0)]


@pytest.mark.parametrize(("example", "value", "stored"), INFO_CASTS, ids=lambda x: repr(x))
def test_an_info_value_is_stored_exactly_or_refused_by_every_source(example, value, stored):
    """The same rule as every buffer's (docs/dtypes.md) in ``TensorSource`` and ``VectorEnvSource``: a value the
    example's dtype holds is stored (a float64 rounded into float32), one it would change is refused naming the field,
    before anything is written."""
    from gymnasium.vector import SyncVectorEnv

    from gpubuf import VectorEnvSource

    sim = TorchSim(2)
    src = TensorSource(2, sim.observation_space, sim.action_space, final_obs=True, device="cpu",
                       info_keys={"t": example})
    buf = TransitionBuffer(64, 4, src.transition_sample(False), vectorized_env=False, device="cpu")
    src.transitions, src.history = buf, HistoryBuffer(2, 8, device="cpu")
    zeros = {"t": np.zeros(2, np.asarray(example).dtype)}
    src.reset(sim.reset(), infos=zeros)
    values = {"t": np.full(2, value, dtype=np.asarray(value).dtype)}
    step = dict(actions=torch.zeros(2, 1), obs=sim.reset(), reward=torch.zeros(2),
                terminated=torch.zeros(2, dtype=torch.bool), truncated=torch.zeros(2, dtype=torch.bool),
                final_obs=sim.reset())
    if stored is None:
        with pytest.raises(TypeError, match=r"infos\['t'\]: cannot store .* without changing values"):
            src.step(**step, infos=values)
        assert len(buf) == 0 and src.history.num_strided() == [1, 1]
    else:
        src.step(**step, infos=values)
        src.step(**step, infos=zeros)
        held = buf.state_dict()["data"]["info['t']"][:4].tolist()  # each env's two transitions, interleaved
        assert held == [0, 0, stored, stored]  # with the observation it was reported with

    class Reports(LateInfoEnv):
        reported = value

    env = SyncVectorEnv([Reports, Reports])
    vsrc = VectorEnvSource(env, device="cpu", info_keys={"t": example})
    vbuf = TransitionBuffer(64, 4, vsrc.transition_sample(False), vectorized_env=False, device="cpu")
    vsrc.transitions = vbuf
    vsrc.reset(seed=0)
    if stored is None:
        with pytest.raises(ValueError, match=r"info_keys: the env's 't' values .* do not fit the example's dtype .*"
                                             r"cannot store .* without changing values"):
            vsrc.step(np.zeros(2, np.int64))
        assert len(vbuf) == 0
    else:
        vsrc.step(np.zeros(2, np.int64))
        vsrc.step(np.zeros(2, np.int64))
        assert vbuf.state_dict()["data"]["info['t']"][:4].tolist() == [0, 0, stored, stored]


class LateInfoEnv(gym.Env):
    """Reports ``info["t"] = reported`` at its first step only (an int64 0, which every example holds, after a reset
    and later)."""

    observation_space = gym.spaces.Box(-100, 100, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)
    reported = 0

    def reset(self, seed=None, options=None):
        self.k = 0
        return np.zeros(1, np.float32), {"t": np.int64(0)}

    def step(self, action):
        self.k += 1
        return np.full(1, self.k, np.float32), 1.0, False, False, {"t": self.reported if self.k == 1 else np.int64(0)}


@pytest.mark.parametrize("vectorized", [False, True])
def test_observations_a_buffer_cannot_hold_are_refused_naming_the_argument_passed(vectorized):
    """``obs`` (of ``reset`` and ``step``) and ``final_obs`` of the wrong shape or of values the observation space's
    dtype cannot hold raise naming that argument (not the buffer leaf it would have become, nor one call later), with
    nothing written to the transitions or the history."""
    sim = TorchSim(2)
    src = TensorSource(2, sim.observation_space, sim.action_space, final_obs=True, device="cpu")
    buf = TransitionBuffer(64, 4, src.transition_sample(vectorized), vectorized_env=vectorized, device="cpu")
    src.transitions, src.history = buf, HistoryBuffer(2, 8, device="cpu")
    huge = torch.full((2, 2), 1e300, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"^obs: cannot store torch.float64 in the stored dtype torch.float32"):
        src.reset(huge)
    src.reset(sim.reset())
    ended, no = torch.tensor([True, False]), torch.zeros(2, dtype=torch.bool)
    good = dict(actions=torch.zeros(2, 1), obs=sim.reset(), reward=torch.zeros(2), terminated=ended, truncated=no,
                final_obs=sim.reset())
    for change, exc, match in (
            ({"obs": huge}, TypeError, r"^obs: cannot store torch.float64 in the stored dtype torch.float32"),
            ({"obs": torch.zeros(2, 2, dtype=torch.complex64)}, TypeError, r"^obs: cannot store torch.complex64"),
            ({"obs": torch.zeros(2, 3)}, ValueError, r"^obs: expected shape \(2, 2\), got \(2, 3\)"),
            ({"obs": torch.zeros(3, 2)}, ValueError, r"^obs: expected shape \(2, 2\), got \(3, 2\)"),
            ({"final_obs": huge}, TypeError, r"^final_obs: cannot store torch.float64")):
        with pytest.raises(exc, match=match):
            src.step(**{**good, **change})
        assert len(buf) == 0 and src.history.num_strided() == [1, 1]
    src.step(**good)
    src.step(**{**good, "terminated": no, "obs": torch.zeros(2, 2, dtype=torch.float64)})  # exact: stored
    assert len(buf) == 4  # two steps of two envs: transitions, or time rows of both envs


@pytest.mark.parametrize("vectorized", [True, False, None])
def test_a_final_observation_is_in_no_history_get(vectorized):
    """The final observation handed to ``step`` is flushed from the env's history with its episode in the same call
    (the reset frame starts the new history), whatever the buffer: ``get()`` never returns it; a
    ``vectorized_env=False`` buffer stores it as the next observation of the episode's last transition."""
    sim = TorchSim(2, limit=4)
    src = TensorSource(2, sim.observation_space, sim.action_space, final_obs=True, device="cpu")
    src.history = hist = HistoryBuffer(2, 16, device="cpu")
    if vectorized is not None:
        src.transitions = buf = TransitionBuffer(64, 4, src.transition_sample(vectorized), vectorized_env=vectorized,
                                                 device="cpu")
    src.reset(sim.reset())
    ends = 0
    for _ in range(9):
        action = torch.rand(2, 1, generator=sim.g) * 2 - 1
        obs, reward, terminated, truncated, final = sim.step(action)
        src.step(action, obs, reward, terminated, truncated, final_obs=final)
        for e in torch.nonzero(terminated | truncated).flatten().tolist():
            ends += 1
            assert hist.num_strided([e]) == [1]
            frames = hist.get(4, env_ids=[e])["observation"][0]
            assert torch.equal(frames, obs[e].expand(4, 2))  # the reset frame, padded
            assert not (frames == final[e]).all(1).any()
            if vectorized is False:
                held = buf.state_dict()["data"]["next_observation"][:len(buf)]
                assert (held == final[e]).all(1).any()
    assert ends >= 2


def test_discrete_actions_are_whole_numbers_of_any_real_dtype_with_unit_axes_and_the_rest_is_refused():
    """What docs/sources-and-rows.md lists: a Discrete(n) env takes ``(n_envs,)`` actions (extra axes of size 1
    dropped) of an integer dtype, bools (0/1) or whole-number floats, each in ``[0, n)``, stored in the space's dtype;
    anything else raises naming ``actions`` before a row is written. The spaces no source encodes are refused when the
    source is built."""
    space = gym.spaces.Box(-1, 1, (1,), np.float32)
    src = TensorSource(2, space, gym.spaces.Discrete(3), final_obs=True, device="cpu")
    buf = TransitionBuffer(64, 4, src.transition_sample(False), vectorized_env=False, device="cpu")
    src.transitions = buf
    obs, no = torch.zeros(2, 1), torch.zeros(2, dtype=torch.bool)
    src.reset(obs)
    accepted = [np.array([0, 2]), np.array([1, 2], np.uint8), torch.tensor([2, 1], dtype=torch.int32),
                np.array([True, False]), np.array([2.0, 0.0]), torch.tensor([1.0, 2.0], dtype=torch.bfloat16),
                np.array([[1], [0]]), torch.tensor([[[2]], [[2]]]), [0, 1]]
    for actions in accepted:
        src.step(actions, obs, torch.zeros(2), no, no, final_obs=obs)
    stored = buf.state_dict()["data"]["action"][:len(buf)]
    assert stored.dtype == torch.int64
    assert stored.view(-1, 2).tolist() == [[0, 2], [1, 2], [2, 1], [1, 0], [2, 0], [1, 2], [1, 0], [2, 2], [0, 1]]
    for actions, match in ((np.array([0.0, 1.5]), r"a discrete env takes integer actions, got \[1.5\]"),
                           (np.array([np.nan, 1.0]), "a discrete env takes integer actions, got \\[nan\\]"),
                           (np.array([0, 3]), r"expected actions in \[0, 3\), got \[0, 3\]"),
                           (np.array([-1, 0]), r"expected actions in \[0, 3\)"),
                           (np.array([np.inf, 0.0]), r"expected actions in \[0, 3\)"),
                           (np.array([[0, 1]]), r"expected shape \(2,\), got \(1, 2\)"),
                           (np.array([[0, 1], [1, 2]]), r"expected shape \(2,\), got \(2, 2\)"),
                           (np.array([1j, 0]), "expected numbers shaped")):
        with pytest.raises((ValueError, TypeError), match=f"^actions: .*{match}"):
            src.step(actions, obs, torch.zeros(2), no, no, final_obs=obs)
    assert len(buf) == 2 * len(accepted)
    for unsupported in (gym.spaces.MultiDiscrete([2, 3]), gym.spaces.MultiBinary(4),
                        gym.spaces.Box(0, 3, (1,), np.int64), gym.spaces.Box(0, 1, (2,), bool),
                        gym.spaces.Discrete(3, start=1)):
        with pytest.raises(TypeError, match=r"action_space: expected an action space Discrete\(n\) \(from 0\) or a "
                                            r"float Box, got .*gymnasium action wrapper"):
            TensorSource(2, space, unsupported, final_obs=True, device="cpu")
