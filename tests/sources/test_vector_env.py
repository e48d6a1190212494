"""VectorEnvSource on real gymnasium vector envs (CartPole-v1 and Pendulum-v1, sync and async, all three autoreset
modes), every stored row checked against what each sub-env did.

The ground truth is a wrapper around each sub-env that logs every ``reset`` and ``step`` it runs (observation before,
action executed, reward, flags, observation after), whatever the vector env's autoreset mode: a transition of a buffer
with ``vectorized_env=False`` must be exactly one logged step, in order; a vectorized buffer must hold the row
convention's rows built from the logs (a step's row: observation before, executed action, reward, ``terminated``;
``NEXT_STEP``: the step after an episode end holds the final observation with ``is_last``, ``truncated``, reward 0 and
the fill; the same-step modes: the env's own flags, no ``is_last`` rows), and its windows, next observations and n-step
returns never cross an episode end.
"""

import numpy as np
import pytest
import torch
from extras import needs

gym = needs("gymnasium")
from fixtures import reference_return  # noqa: E402
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv  # noqa: E402

from gpubuf import HistoryBuffer, PrioritizedTransitionBuffer, TransitionBuffer  # noqa: E402
from gpubuf.sources.actions import action_fill  # noqa: E402
from gpubuf.sources.vector_env import VectorEnvSource  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED]
# max_episode_steps: CartPole and Hopper (MuJoCo, falls over) both terminate and truncate
TASKS = {"CartPole-v1": 15, "Pendulum-v1": 12, "Hopper-v5": 15}
try:
    import mujoco  # noqa: F401
except ImportError:  # gymnasium's MuJoCo envs need it (the test extra installs it)
    del TASKS["Hopper-v5"]


class Logged(gym.Wrapper):
    """Logs every reset and step of one sub-env: ``("reset", obs)`` and ``("step", obs_before, action, reward,
    terminated, truncated, obs_after, info)``."""

    def __init__(self, env, log: list):
        super().__init__(env)
        self.log, self.obs = log, None

    def reset(self, **kw):
        obs, info = self.env.reset(**kw)
        self.obs = obs
        self.log.append(("reset", obs))
        return obs, info

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.log.append(("step", self.obs, np.array(action), float(reward), bool(terminated), bool(truncated), obs,
                         dict(info)))
        self.obs = obs
        return obs, reward, terminated, truncated, info


def logged_env(task, E, mode, logs=None):
    """A SyncVectorEnv of ``E`` logged sub-envs (``logs[i]`` their logs), or without ``logs`` an AsyncVectorEnv."""
    steps = TASKS[task]
    if logs is None:
        return AsyncVectorEnv([lambda: gym.make(task, max_episode_steps=steps)] * E, autoreset_mode=mode)
    return SyncVectorEnv([lambda log=log: Logged(gym.make(task, max_episode_steps=steps), log) for log in logs],
                         autoreset_mode=mode)


def random_actions(src, rng):
    if src.n_actions is not None:
        return rng.integers(0, src.n_actions, src.n_envs)
    return rng.uniform(-3, 3, (src.n_envs, *src.action_shape)).astype(np.float32)  # beyond Pendulum's box: clipped


def drive(src, K, seed=0, extra=None):
    rng = np.random.default_rng(seed)
    src.reset(seed=seed)
    for _ in range(K):
        src.step(random_actions(src, rng), extra=None if extra is None else extra(rng))


def transitions_of(buf) -> dict:
    """The held transitions of a ``vectorized_env=False`` buffer, in insert order (no wrap)."""
    data = buf.state_dict()["data"]
    n = len(buf)
    return {k: v[:n].cpu().numpy() for k, v in data.items()}


# ------------------------------------------------------------------ single transitions, every mode


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("task", list(TASKS))
def test_each_transition_is_one_step_a_sub_env_took(task, mode, device):
    E, K = 3, 40
    logs = [[] for _ in range(E)]
    src = VectorEnvSource(logged_env(task, E, mode, logs), device=device)
    buf = TransitionBuffer(E * K + 8, 8, src.transition_sample(vectorized=False), vectorized_env=False,
                           device=device)
    src.transitions = buf
    drive(src, K)
    got = transitions_of(buf)
    steps = [entry for log in logs for entry in log if entry[0] == "step"]
    assert len(buf) == len(steps) and any(s[4] for s in steps) + any(s[5] for s in steps) >= 1
    # the buffer's transitions, per env in order, are the logged steps (matched by their observation)
    by_obs = {s[1].tobytes(): s for s in steps}
    assert len(by_obs) == len(steps), "observations must identify steps"
    for i in range(len(buf)):
        s = by_obs[got["observation"][i].astype(steps[0][1].dtype).tobytes()]
        np.testing.assert_array_equal(got["next_observation"][i], s[6].astype(got["next_observation"].dtype))  # final
        np.testing.assert_array_equal(got["action"][i].reshape(s[2].shape), s[2].astype(got["action"].dtype))
        assert got["reward"][i] == np.float32(s[3]) and got["terminated"][i] == s[4] and got["truncated"][i] == s[5]
    ends = sum(s[4] or s[5] for s in steps)
    assert ends >= E, f"the run must end episodes ({ends})"


# ------------------------------------------------------------------ the vectorized rows (NEXT_STEP)


def expected_rows(logs, fill, K, shape):
    """``(K, E, ...)`` rows the convention prescribes for a NEXT_STEP run of ``K`` steps after a reset, from the sub-env
    logs (a NEXT_STEP env answers the step after an end with a reset: the row of the final observation)."""
    rows = {k: [] for k in ("observation", "action", "reward", "terminated", "truncated", "is_last")}
    for log in logs:
        obs, col = log[0][1], {k: [] for k in rows}
        for entry in log[1:K + 1]:
            if entry[0] == "reset":  # the action of this step was ignored: the final observation's row
                row = (obs, np.full(shape, fill), 0.0, False, True, True)
                obs = entry[1]
            else:
                row = (obs, np.reshape(entry[2], shape), entry[3], entry[4], False, False)
                obs = entry[6]
            for k, v in zip(col, row, strict=True):
                col[k].append(v)
        for k in rows:
            rows[k].append(col[k])
    return {k: np.swapaxes(np.array(v), 0, 1) for k, v in rows.items()}


def next_step_run(task, device, n_steps, K=40, E=3):
    """A logged NEXT_STEP run of ``K`` steps into a vectorized buffer of ``n_steps`` windows and a history:
    ``(source, buffer, history, logs, expected rows)``."""
    logs = [[] for _ in range(E)]
    src = VectorEnvSource(logged_env(task, E, AutoresetMode.NEXT_STEP, logs), device=device)
    hist = HistoryBuffer(E, 64, device=device)
    src.history = hist
    buf = TransitionBuffer(E * (K + 4), 8, src.transition_sample(), n_steps=n_steps, device=device)
    src.transitions = buf
    drive(src, K)
    return src, buf, hist, logs, expected_rows(logs, action_fill(src.action_dtype), K, src.action_shape)


@pytest.mark.parametrize("task", list(TASKS))
def test_next_step_rows_follow_the_convention(task, backend, device):
    K = 40
    src, buf, hist, logs, want = next_step_run(task, device, 3, K)
    data = buf.state_dict()["data"]
    got = {"observation": data["observation"], "action": data["action"], "reward": data["reward"],
           "terminated": data["terminated"], "truncated": data["truncated"], "is_last": data["info['is_last']"]}
    for key, value in want.items():
        np.testing.assert_array_equal(got[key][:K].cpu().numpy(), value.reshape(got[key][:K].shape).astype(
            got[key].cpu().numpy().dtype), err_msg=key)
    assert want["is_last"].any() and len(buf) == K * src.n_envs
    # the history's newest frame is each env's current observation
    frames = hist.get(1)["observation"][:, 0].cpu().numpy()
    np.testing.assert_array_equal(frames, np.stack([log[-1][1] if log[-1][0] == "reset" else log[-1][6]
                                                    for log in logs]).astype(frames.dtype))

    # windows never cross an episode end; next observations are the frames the actions led to
    batch, idx = buf.sample(key=3, batch_size=32, boundaries="forbid", with_next_obs=True, return_indices=True)
    env, row, _ = (t.cpu().numpy() for t in buf.locate(idx))
    rows = row[:, None] + np.arange(3)
    np.testing.assert_array_equal(batch.observation.cpu().numpy(), want["observation"][rows, env[:, None]])
    assert not want["is_last"][rows, env[:, None]].any()
    nxt = np.concatenate([want["observation"], want["observation"][-1:]])  # the frame after row r is row r + 1's
    np.testing.assert_array_equal(batch.next_observation.cpu().numpy(), nxt[rows + 1, env[:, None]])


@pytest.mark.parametrize("task", list(TASKS))
def test_next_step_returns_and_stacks_stop_at_episode_ends(task, device):
    K, gamma = 40, 0.5
    src, buf, _, _, want = next_step_run(task, device, 1, K)
    first = np.zeros_like(want["is_last"])
    first[1:] = want["is_last"][:-1]  # the row after a final observation holds the reset frame
    b, idx = buf.sample(key=4, batch_size=64, n_step_return=(3, gamma), frame_stack=2, return_indices=True)
    env, row, _ = (t.cpu().numpy() for t in buf.locate(idx))
    for i in range(len(idx)):
        e, r = env[i], row[i]
        assert not want["is_last"][r, e]
        older = r if r == 0 or first[r, e] else r - 1  # padding repeats the episode's first frame
        np.testing.assert_array_equal(b.observation[i].cpu().numpy(),
                                      np.stack([want["observation"][older, e], want["observation"][r, e]]))
        total, disc, m = reference_return(want["reward"], want["terminated"], want["is_last"], r, e, K, 3, gamma)
        assert b.reward[i].item() == pytest.approx(total, rel=1e-5, abs=1e-5), (e, r)
        assert b.discount[i].item() == pytest.approx(disc, rel=1e-6), (e, r)
        if disc:  # the bootstrap observation: m rows later, inside the episode
            np.testing.assert_array_equal(b.next_observation[i, -1].cpu().numpy(), want["observation"][r + m, e])


def same_step_rows(logs, K):
    """``(K, E, ...)`` rows of a same-step run of ``K`` steps into a vectorized buffer: each logged step is one row
    (observation before, action, reward, flags), plus ``after``: the observation each step led to (the final one at an
    episode end)."""
    steps = [[entry for entry in log if entry[0] == "step"][:K] for log in logs]
    cols = [np.array([[s[i] for s in col] for col in steps]) for i in range(1, 7)]
    names = ("observation", "action", "reward", "terminated", "truncated", "after")
    return {k: np.swapaxes(c, 0, 1) for k, c in zip(names, cols, strict=True)}


def same_step_run(task, mode, device, n_steps, K=45, E=3):
    """A logged same-step run of ``K`` steps into a vectorized buffer of ``n_steps`` windows and a history:
    ``(buffer, history, logs, expected rows)``."""
    logs = [[] for _ in range(E)]
    src = VectorEnvSource(logged_env(task, E, mode, logs), device=device)
    hist = HistoryBuffer(E, 64, device=device)
    src.history = hist
    buf = TransitionBuffer(E * (K + 4), 8, src.transition_sample(), n_steps=n_steps, device=device)
    src.transitions = buf
    drive(src, K)
    return buf, hist, logs, same_step_rows(logs, K)


SAME_STEP_CASES = [(t, m) for t in ("CartPole-v1", "Pendulum-v1") for m in MODES[1:]]


@pytest.mark.parametrize("task, mode", SAME_STEP_CASES, ids=lambda x: getattr(x, "value", x))
def test_same_step_modes_into_a_vectorized_buffer_never_cross_an_end(task, mode, device):
    """A same-step env into a vectorized buffer: one row per env per step, the env's own flags, no ``is_last`` leaf;
    windows and next observations stay inside episodes, and a truncated last transition (whose successor, the final
    observation, is not stored) is never drawn with a next observation."""
    K = 45
    buf, hist, logs, want = same_step_run(task, mode, device, 3, K)
    data = buf.state_dict()["data"]
    assert "info['is_last']" not in data and len(buf) == K * 3
    for key in ("observation", "action", "reward", "terminated", "truncated"):
        np.testing.assert_array_equal(data[key][:K].cpu().numpy(), want[key].reshape(data[key][:K].shape).astype(
            data[key].cpu().numpy().dtype), err_msg=key)
    ends = want["terminated"] | want["truncated"]
    assert want["truncated"].any(), "the run must truncate an episode"
    # the history holds each env's current observation (the reset frame after an end)
    frames = hist.get(1)["observation"][:, 0].cpu().numpy()
    last = [log[-1][1] if log[-1][0] == "reset" else log[-1][6] for log in logs]
    np.testing.assert_array_equal(frames, np.stack(last).astype(frames.dtype))

    b, idx = buf.sample(key=2, batch_size=64, with_next_obs=True, boundaries="forbid", return_indices=True)
    env, row, _ = (t.cpu().numpy() for t in buf.locate(idx))
    rows = row[:, None] + np.arange(3)
    assert not want["truncated"][rows, env[:, None]].any()  # never a truncated last transition with a next obs
    assert not ends[rows[:, :-1], env[:, None]].any()  # an episode end only at a window's last row
    live = ~want["terminated"][rows, env[:, None]]
    got = b.next_observation.cpu().numpy()
    np.testing.assert_array_equal(got[live], want["after"][rows, env[:, None]][live].astype(got.dtype))


@pytest.mark.parametrize("task, mode", SAME_STEP_CASES, ids=lambda x: getattr(x, "value", x))
def test_same_step_returns_and_stacks_stop_at_episode_ends(task, mode, device):
    K, gamma = 45, 0.5
    buf, _, _, want = same_step_run(task, mode, device, 1, K)
    b, idx = buf.sample(key=4, batch_size=64, n_step_return=(3, gamma), frame_stack=2, return_indices=True)
    env, row, _ = (t.cpu().numpy() for t in buf.locate(idx))
    obs = b.observation.cpu().numpy()
    for i in range(len(idx)):
        e, r = env[i], row[i]
        assert not want["truncated"][r, e]  # its successor is not stored: never a start with a bootstrap
        new_episode = r == 0 or want["terminated"][r - 1, e] or want["truncated"][r - 1, e]
        older = r if new_episode else r - 1
        np.testing.assert_array_equal(obs[i], np.stack([want["observation"][older, e],
                                                        want["observation"][r, e]]).astype(obs.dtype))
        total, disc, m = reference_return(want["reward"], want["terminated"], want["truncated"], r, e, K, 3, gamma)
        assert b.reward[i].item() == pytest.approx(total, rel=1e-5, abs=1e-5), (e, r)
        assert b.discount[i].item() == pytest.approx(disc, rel=1e-6), (e, r)
        if disc:  # the bootstrap observation: what the m-th action led to, inside the episode
            np.testing.assert_array_equal(b.next_observation[i, -1].cpu().numpy(),
                                          want["after"][r + m - 1, e].astype(obs.dtype))


@pytest.mark.parametrize("mode", MODES[1:], ids=lambda m: m.value)
@pytest.mark.parametrize("cut", ["reset", "detach"])
def test_a_cut_same_step_run_adds_no_row_and_nothing_crosses_the_cut(mode, cut, device):
    """A reset (or the buffer detached and attached again) mid-run: each env's newest row is marked truncated in
    place, no fill row is written, and no window, next observation or return reaches across the cut."""
    E, K = 3, 10
    src = VectorEnvSource(gym.make_vec("Pendulum-v1", E, vectorization_mode="sync",
                                       vector_kwargs={"autoreset_mode": mode}), device=device)
    buf = TransitionBuffer(E * 64, 8, src.transition_sample(), n_steps=3, device=device)
    src.transitions = buf
    drive(src, K)
    if cut == "reset":
        drive(src, K, seed=1)  # drive resets first
    else:
        src.transitions = None
        src.transitions = buf
        rng = np.random.default_rng(2)
        for _ in range(K):
            src.step(random_actions(src, rng))
    data = buf.state_dict()["data"]
    assert len(buf) == 2 * K * E  # one row per env per step: nothing added at the cut
    assert not torch.isnan(data["action"][:2 * K]).any()
    assert data["truncated"][K - 1].all()  # the cut: each env's newest row before it
    for boundaries in ("mask", "forbid"):
        b, idx = buf.sample(key=1, batch_size=256, boundaries=boundaries, return_indices=True)
        _, row, _ = (t.cpu().numpy() for t in buf.locate(idx))
        if boundaries == "forbid":  # the cut (row K - 1) only ever a window's last row
            assert not np.isin(row, [K - 2, K - 1]).any()
        else:
            first = b.is_first.cpu().numpy()
            crosses = (row[:, None] + np.arange(3)) == K  # the row after the cut inside a window
            assert first[crosses & (np.arange(3) > 0)].all()  # starts a new episode there


@pytest.mark.parametrize("mode", MODES[1:], ids=lambda m: m.value)
def test_same_step_history_is_the_same_whatever_the_buffer(mode, device):
    """The history is the same with a vectorized buffer, a flat one or none."""
    E, K = 2, 30
    got = []
    for vectorized in (True, False, None):
        src = VectorEnvSource(gym.make_vec("CartPole-v1", E, vectorization_mode="sync",
                                           vector_kwargs={"autoreset_mode": mode}), device=device)
        src.history = hist = HistoryBuffer(E, 64, device=device)
        if vectorized is not None:
            src.transitions = TransitionBuffer(E * (K + 4), 4, src.transition_sample(vectorized),
                                               vectorized_env=vectorized, device=device)
        drive(src, K)
        got.append(hist.get(40))
    for other in got[1:]:
        for key in got[0]:
            torch.testing.assert_close(got[0][key], other[key], equal_nan=True, msg=key)


# ------------------------------------------------------------------ async, info fields, extra data


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_async_writes_the_rows_sync_writes(mode, device):
    E, K = 3, 30
    out = []
    for logs, vectorized in (([[] for _ in range(E)], True), (None, True), ([[] for _ in range(E)], False),
                             (None, False)):
        src = VectorEnvSource(logged_env("Pendulum-v1", E, mode, logs), device=device)
        buf = PrioritizedTransitionBuffer(E * (K + 4), 8, src.transition_sample(vectorized), vectorized_env=vectorized,
                                          device=device)
        src.transitions = buf
        drive(src, K, seed=5)
        out.append(buf.state_dict()["data"])
        src.env.close()
    for a, b in ((out[0], out[1]), (out[2], out[3])):
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, equal_nan=True, msg=key)


def test_extra_data_rides_with_its_row_and_an_unreported_info_field_is_zero(device):
    E, K = 2, 25
    env = SyncVectorEnv([lambda: gym.make("CartPole-v1", max_episode_steps=9)] * E)
    src = VectorEnvSource(env, device=device, info_keys={"episode_step": np.int64(0)})
    tb = TransitionBuffer(E * (K + 4), 4, src.transition_sample(extra={"logp": np.float32(0)}), device=device)
    src.transitions = tb
    rng, sent = np.random.default_rng(0), []
    src.reset(seed=1)
    for _ in range(K):
        logp = rng.normal(size=E).astype(np.float32)
        src.step(rng.integers(0, 2, E), extra={"logp": logp})
        sent.append(logp)
    data = tb.state_dict()["data"]
    np.testing.assert_array_equal(data["info['logp']"][:K].cpu().numpy(), np.stack(sent))
    assert (data["info['episode_step']"][:K] == 0).all()  # CartPole reports no such field


def test_an_info_field_the_env_reports_is_stored_with_the_row_of_its_observation(device):
    E, K = 2, 20

    class Stamped(gym.Wrapper):  # info["stamp"]: the observation's first value, reported with it
        def reset(self, **kw):
            obs, info = self.env.reset(**kw)
            return obs, {**info, "stamp": np.float32(obs[0])}

        def step(self, action):
            obs, r, te, tr, info = self.env.step(action)
            return obs, r, te, tr, {**info, "stamp": np.float32(obs[0])}

    env = SyncVectorEnv([lambda: Stamped(gym.make("CartPole-v1", max_episode_steps=7))] * E)
    src = VectorEnvSource(env, device=device, info_keys={"stamp": np.float32(0)})
    tb = TransitionBuffer(E * (K + 4), 4, src.transition_sample(), device=device)
    src.transitions = tb
    drive(src, K)
    data = tb.state_dict()["data"]
    np.testing.assert_array_equal(data["info['stamp']"][:K].cpu().numpy(), data["observation"][:K, :, 0].cpu().numpy())


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("make, exc, match", [
    (lambda: gym.make("CartPole-v1"), TypeError, "env: expected a gymnasium VectorEnv"),
    (lambda: object(), TypeError, "env: expected a gymnasium VectorEnv"),
])
def test_a_non_vector_env_is_refused(make, exc, match):
    with pytest.raises(exc, match=match):
        VectorEnvSource(make(), device="cpu")


@pytest.mark.parametrize("info_keys, exc, match", [
    (("x",), TypeError, "info_keys: expected a dict"),
    ({"reward": 0.0}, ValueError, "info_keys: expected field names other than"),
    ({"_x": 0.0}, ValueError, "'_'-prefixed masks, got '_x'"),
    ({"final_obs": 0.0}, ValueError, "got 'final_obs'"),
    ({"x": "text"}, TypeError, r"info_keys\['x'\]: expected a bool or numeric example"),
])
def test_bad_info_keys_are_refused(info_keys, exc, match):
    with pytest.raises(exc, match=match):
        VectorEnvSource(gym.make_vec("CartPole-v1", 2), device="cpu", info_keys=info_keys)


def test_bad_actions_and_calls_are_refused_before_the_env_steps(device):
    logs = [[], []]
    src = VectorEnvSource(logged_env("CartPole-v1", 2, AutoresetMode.NEXT_STEP, logs), device=device)
    tb = TransitionBuffer(64, 4, src.transition_sample(), device=device)
    src.transitions = tb
    with pytest.raises(RuntimeError, match="step: reset"):
        src.step(np.zeros(2, np.int64))
    src.reset(seed=0)
    before = [len(log) for log in logs]
    for bad, exc in ((np.zeros(3, np.int64), ValueError), (np.array([0, 2]), ValueError),
                     (np.array([0.5, 1.0]), ValueError), ("x", TypeError)):
        with pytest.raises(exc, match="actions"):
            src.step(bad)
    with pytest.raises(ValueError, match="extra"):
        src.step(np.zeros(2, np.int64), extra={"nope": np.zeros(2)})
    assert [len(log) for log in logs] == before and len(tb) == 0
    with pytest.raises(ValueError, match="autoreset_mode"):
        env = gym.make_vec("CartPole-v1", 2)
        env.metadata = {**env.metadata, "autoreset_mode": "Sometimes"}
        VectorEnvSource(env, device=device)


def test_copies_are_refused():
    import copy
    import pickle

    src = VectorEnvSource(gym.make_vec("CartPole-v1", 2), device="cpu")
    for fn in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="cannot be copied or pickled"):
            fn(src)


# ------------------------------------------------------------------ review findings


class LateInfo(gym.Env):
    """Reports ``info["x"]`` (a 2-vector, or a float when ``value`` says so) only at its third step."""

    observation_space = gym.spaces.Box(-100, 100, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, value=None):
        self.value = np.ones(2) if value is None else value

    def reset(self, seed=None, options=None):
        self.t = 0
        return np.zeros(1, np.float32), {}

    def step(self, action):
        self.t += 1
        return np.full(1, self.t, np.float32), 1.0, False, False, ({"x": self.value} if self.t == 3 else {})


def test_env_outputs_that_cannot_be_written_stop_the_source_until_a_reset():
    env = SyncVectorEnv([LateInfo, LateInfo])
    src = VectorEnvSource(env, device="cpu", info_keys={"x": np.float64(0)})
    buf = TransitionBuffer(100, 4, src.transition_sample(vectorized=False), vectorized_env=False, device="cpu")
    src.transitions = buf
    with pytest.warns(UserWarning, match="info_keys: the env reported no 'x'"):
        src.reset(seed=0)
    src.step(np.zeros(2, np.int64))
    src.step(np.zeros(2, np.int64))
    with pytest.raises(ValueError, match=r"info_keys: the env's 'x' came as .*reset\(\) the source before the next"):
        src.step(np.zeros(2, np.int64))
    with pytest.raises(RuntimeError, match="step: reset"):
        src.step(np.zeros(2, np.int64))
    src.reset(seed=0)
    src.step(np.zeros(2, np.int64))
    data = buf.state_dict()["data"]
    held = slice(0, len(buf))
    pairs = {(float(o), float(n)) for o, n in zip(data["observation"][held, 0], data["next_observation"][held, 0],
                                                  strict=True)}
    assert pairs == {(0.0, 1.0), (1.0, 2.0)}, pairs  # never the stale (2 -> 4)


def test_an_info_value_the_example_dtype_cannot_hold_is_refused():
    env = SyncVectorEnv([lambda: LateInfo(0.7)] * 2)
    src = VectorEnvSource(env, device="cpu", info_keys={"x": np.int64(0)})
    src.reset(seed=0)
    for _ in range(2):
        src.step(np.zeros(2, np.int64))
    with pytest.raises(ValueError, match="info_keys: the env's 'x' values .* do not fit the example's dtype int64"):
        src.step(np.zeros(2, np.int64))


@pytest.mark.parametrize("space", [gym.spaces.MultiDiscrete([2, 3]), gym.spaces.MultiBinary(5),
                                   gym.spaces.Box(0, 3, (1,), np.int64), gym.spaces.Discrete(3, start=-1),
                                   gym.spaces.Tuple((gym.spaces.Discrete(2), gym.spaces.Discrete(2)))])
def test_action_spaces_the_source_cannot_encode_are_refused(space):
    class Env(gym.Env):
        observation_space = gym.spaces.Box(-1, 1, (1,), np.float32)
        action_space = space

    with pytest.raises(TypeError, match="env: expected an action space Discrete\\(n\\) \\(from 0\\) or a float Box"):
        VectorEnvSource(SyncVectorEnv([Env]), device="cpu")


def test_interleaved_single_transitions_refuse_windows():
    src = VectorEnvSource(gym.make_vec("CartPole-v1", 2, vectorization_mode="sync"), device="cpu")
    buf = TransitionBuffer(200, 8, src.transition_sample(vectorized=False), vectorized_env=False, n_steps=3)
    with pytest.raises(ValueError, match="transitions: a buffer with vectorized_env=False stores the transitions of "
                                         "the 2 envs interleaved"):
        src.transitions = buf


def test_two_threads_stepping_one_source_take_turns():
    """Each call runs whole under the source's lock: every stored transition is one real sub-env step."""
    import threading

    E, K = 2, 30
    logs = [[] for _ in range(E)]
    src = VectorEnvSource(logged_env("CartPole-v1", E, AutoresetMode.SAME_STEP, logs), device="cpu")
    buf = TransitionBuffer(E * 2 * K + 8, 8, src.transition_sample(vectorized=False), vectorized_env=False,
                           device="cpu")
    src.transitions = buf
    src.reset(seed=0)
    errors = []

    def stepper(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(K):
                src.step(rng.integers(0, 2, E))
        except BaseException as err:  # noqa: B036 - reported below
            errors.append(err)

    threads = [threading.Thread(target=stepper, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads)
    steps = {(s[1].tobytes(), s[6].tobytes()) for log in logs for s in log if s[0] == "step"}
    data = buf.state_dict()["data"]
    got = {(o.numpy().tobytes(), n.numpy().tobytes()) for o, n in zip(data["observation"][:len(buf)],
                                                                      data["next_observation"][:len(buf)],
                                                                      strict=True)}
    assert len(buf) == 2 * K * E and got == steps


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP], ids=lambda m: m.value)
def test_a_closed_storage_dir_buffer_can_be_detached_and_its_reopened_self_attached(mode, tmp_path):
    """Closing a storage_dir buffer a source writes: detaching it (or resetting) writes nothing into the closed files;
    the re-opened buffer can be attached and written."""
    src = VectorEnvSource(gym.make_vec("Pendulum-v1", 2, vectorization_mode="sync",
                                       vector_kwargs={"autoreset_mode": mode}), device="cpu")
    buf = TransitionBuffer(2 * 32, 4, src.transition_sample(), device="cpu", storage_dir=tmp_path / "r")
    src.transitions = buf
    drive(src, 5)
    n = len(buf)
    buf.close()
    with pytest.raises(ValueError, match="was closed"):
        src.step(np.zeros((2, 1), np.float32))
    src.transitions = None
    src.reset(seed=1)
    again = TransitionBuffer(2 * 32, 4, src.transition_sample(), device="cpu", storage_dir=tmp_path / "r")
    assert len(again) == n
    src.transitions = again
    src.step(np.zeros((2, 1), np.float32))
    assert len(again) == n + 2
    again.close()


@pytest.mark.parametrize("mode", MODES[1:], ids=lambda m: m.value)
@pytest.mark.parametrize("vectorized", [True, False, None])
def test_same_step_final_observations_are_in_no_history_get_and_stay_in_source_last(mode, vectorized, device):
    """After an episode end in a same-step mode the env's history starts at its reset frame: the final observation is
    flushed with its episode in the same call, so no ``get()`` returns it, whatever the buffer. SAME_STEP keeps it in
    ``source.last``'s ``info["final_obs"]``; a ``vectorized_env=False`` buffer stores it as a next observation."""
    E = 2
    src = VectorEnvSource(gym.make_vec("CartPole-v1", E, vectorization_mode="sync",
                                       vector_kwargs={"autoreset_mode": mode}), device=device)
    src.history = hist = HistoryBuffer(E, 64, device=device)
    if vectorized is not None:
        src.transitions = buf = TransitionBuffer(E * 80, 4, src.transition_sample(vectorized),
                                                 vectorized_env=vectorized, device=device)
    src.reset(seed=0)
    rng, seen = np.random.default_rng(0), 0
    for _ in range(60):
        step = src.step(random_actions(src, rng))
        obs, _, terminated, truncated, info = src.last
        for e in np.flatnonzero(np.asarray(terminated) | np.asarray(truncated)):
            seen += 1
            assert hist.num_strided([e]) == [1]
            frames = hist.get(3, env_ids=[e])["observation"][0].cpu().numpy()  # (3, 4): the reset frame, padded
            np.testing.assert_array_equal(frames, np.repeat(obs[e][None], 3, 0))
            np.testing.assert_array_equal(step.info["observation"][e, 0].cpu().numpy(), obs[e])
            if mode == AutoresetMode.SAME_STEP:
                final = info["final_obs"][e]
                assert not (frames == final).all(1).any()
                if vectorized is False:
                    held = buf.state_dict()["data"]["next_observation"][:len(buf)].cpu().numpy()
                    assert (held == final).all(1).any()
    assert seen >= 2
