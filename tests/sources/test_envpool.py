"""The EnvPool driver on real EnvPool envs (sync and async): EnvPoolSource stages exactly the env's raw outputs
(StepStager also takes device arrays in place), routes every async row to its env, sends actions as the env executes
them (checked, clipped to a Box, the steady-state paths falling back to the checked ones when a layout changes), and
rejects bad inputs before anything is sent or written."""

from unittest import mock

import numpy as np
import pytest
import torch
from dlpack_only import DlpackOnly
from extras import needs

from gpubuf import HistoryBuffer
from gpubuf.sources.actions import ActionCodec
from gpubuf.sources.envpool import EnvPoolSource, StepStager

envpool = needs("envpool")  # absent on the GPU machine, which has no registry

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def make(task="CartPole-v1", num_envs=4, batch_size=None, seed=0):
    return envpool.make(task, env_type="gymnasium", num_envs=num_envs, batch_size=batch_size or num_envs, seed=seed)


def test_sync_layout_matches_raw_envpool_outputs(device):
    """A twin env with the same seed and actions gives the raw arrays the source must have staged."""
    src, twin = EnvPoolSource(make(), device=device), make()
    step = src.reset()
    obs, _ = twin.reset()
    assert step.first.all() and torch.isnan(step.info["action"]).all()
    rng = np.random.default_rng(0)
    seen_reset = False
    for _ in range(60):
        act = rng.integers(0, 2, 4).astype(np.int32)
        step = src.step(act)
        obs, rew, term, trunc, info = twin.step(act)
        assert {k: tuple(v.shape) for k, v in step.info.items()} == {
            "observation": (4, 1, 4), "action": (4, 1, 1), "reward": (4, 1), "terminated": (4, 1), "truncated": (4, 1)}
        assert all(v.device.type == torch.device(device).type for v in step.info.values())
        np.testing.assert_array_equal(step.info["observation"][:, 0].cpu().numpy(), obs)
        np.testing.assert_array_equal(step.info["reward"][:, 0].cpu().numpy(), rew)
        np.testing.assert_array_equal(step.info["terminated"][:, 0].cpu().numpy(), term)
        np.testing.assert_array_equal(step.info["truncated"][:, 0].cpu().numpy(), trunc)
        first = info["elapsed_step"] == 0
        np.testing.assert_array_equal(step.first, first)
        echo = step.info["action"][:, 0, 0].cpu().numpy()
        np.testing.assert_array_equal(echo[~first], act[~first].astype(np.float32))
        assert np.isnan(echo[first]).all()
        seen_reset |= bool(first.any())
    assert seen_reset, "no episode ended: the test did not exercise reset frames"


def test_pong_pixels_feed_history_and_flush_on_reset(device):
    hist = HistoryBuffer(2, 4, block_keys=("action",), device=device)
    src = EnvPoolSource(make("Pong-v5", 2), obs_key="pixels", history=hist, device=device)
    step = src.reset()
    assert step.info["pixels"].shape == (2, 1, 4, 84, 84) and step.info["pixels"].dtype == torch.uint8
    for _ in range(3):
        step = src.step(np.array([2, 3]))
    assert hist.num_strided() == [4, 4]
    out = hist.get(4)
    assert out["pixels"].shape == (2, 4, 4, 84, 84)  # (envs, n * T, *obs) with T = 1
    np.testing.assert_array_equal(out["pixels"][:, -1].cpu().numpy(), step.info["pixels"][:, 0].cpu().numpy())
    np.testing.assert_array_equal(out["action"][:, :, 0].cpu().numpy(), [[2, 2, 2], [3, 3, 3]])
    src.reset()  # every row is a reset frame: histories restart from it
    assert hist.num_strided() == [1, 1]


def test_async_routes_every_received_row_to_its_env_history(device):
    """Unique continuous actions per (env, send): each env's history echoes exactly what it was sent."""
    n_envs, batch = 6, 3
    hist = HistoryBuffer(n_envs, 200, device=device)
    src = EnvPoolSource(make("Pendulum-v1", n_envs, batch), history=hist, device=device)
    assert src.is_async
    sent = {e: [] for e in range(n_envs)}
    received = np.zeros(n_envs, dtype=int)
    step = src.reset()
    received[step.env_ids] += 1
    for k in range(40):
        acts = (step.env_ids * 0.1 + k * 1e-3).astype(np.float32)[:, None]
        for e, a in zip(step.env_ids, acts[:, 0], strict=True):
            sent[e].append(a)
        src.send(acts, step.env_ids)
        step = src.recv()
        assert len(step.env_ids) == batch and len(set(step.env_ids)) == batch
        received[step.env_ids] += 1
    assert hist.num_strided() == received.tolist()  # no row lost, none duplicated (episodes last 200 steps)
    for e in range(n_envs):
        echo = hist.get(int(received[e]), [e])["action"][0, :, 0].cpu().numpy()
        assert np.isnan(echo[0])  # the reset frame
        np.testing.assert_array_equal(echo[1:], np.array(sent[e][: received[e] - 1], dtype=np.float32))


def test_sync_transitions_follow_the_dynamics(device):
    """Sampled (obs, action, next obs) triples obey CartPole's own equations: rows are aligned."""
    from gpubuf.planning import cartpole_dynamics
    from gpubuf.replay.buffer import TransitionBuffer

    env = make(num_envs=4)
    src = EnvPoolSource(env, device=device)
    tb = TransitionBuffer(4 * 64, 32, src.transition_sample(), device=device)
    src.transitions = tb
    src.reset()
    rng = np.random.default_rng(1)
    for _ in range(40):
        src.step(rng.integers(0, 2, 4))
    assert len(tb) == 40 * 4  # one row per step after the reset
    batch = tb.sample(0, batch_size=64, with_next_obs=True)
    live = ~batch.terminated.bool()
    pred = cartpole_dynamics(batch.observation.float(), batch.action.float()[:, None] * 2 - 1)
    torch.testing.assert_close(pred[live], batch.next_observation[live].float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("wrap", [lambda t: t, DlpackOnly], ids=["torch", "dlpack"])
def test_stager_takes_device_arrays_from_gpu_simulators(device, wrap):
    stager = StepStager(3, device=device)
    obs = torch.arange(6.0, device=device).reshape(3, 2)
    step = stager(wrap(obs), wrap(torch.ones(3, 2, device=device)), wrap(torch.zeros(3, device=device)),
                  wrap(torch.zeros(3, dtype=torch.bool, device=device)),
                  wrap(torch.ones(3, dtype=torch.bool, device=device)), env_ids=[2, 0, 1], first=[False, True, False])
    torch.testing.assert_close(step.info["observation"][:, 0], obs)
    assert torch.isnan(step.info["action"][1]).all() and (step.info["action"][[0, 2]] == 1).all()
    assert step.info["truncated"].all() and step.env_ids.tolist() == [2, 0, 1]
    assert step.info["observation"].data_ptr() == obs.data_ptr()  # used in place: no copy


@pytest.mark.cuda
def test_stager_cuda_inputs_stay_on_device():
    stager = StepStager(2, device="cuda")
    x = torch.randn(2, 5, device="cuda")
    step = stager(x, torch.zeros(2, device="cuda"), torch.zeros(2, device="cuda"), torch.zeros(2, device="cuda"),
                  torch.zeros(2, device="cuda"))
    assert step.info["observation"].is_cuda
    torch.testing.assert_close(step.info["observation"][:, 0], x)


# ------------------------------------------------------------------ rejected input


def stage(stager, rows=2, obs=None, env_ids=None, first=None, reward=None):
    obs = np.zeros((rows, 3), np.float32) if obs is None else obs
    reward = np.zeros(rows) if reward is None else reward
    return stager(obs, np.zeros(rows), reward, np.zeros(rows, bool), np.zeros(rows, bool), env_ids, first)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_stager_rejects_bad_n_envs(bad):
    with pytest.raises(ValueError, match=f"n_envs: expected a positive int, got {bad!r}"):
        StepStager(bad)


def test_stager_rejects_obs_key_that_collides():
    with pytest.raises(ValueError, match="obs_key: expected a str other than the step keys, got 'reward'"):
        StepStager(2, "reward")


def test_stager_rejects_wrong_row_count():
    with pytest.raises(ValueError, match=r"observation: expected a leading env dim of 2 rows, got shape \(3, 3\)"):
        stage(StepStager(2), obs=np.zeros((3, 3), np.float32))


def test_stager_rejects_out_of_range_env_ids():
    with pytest.raises(IndexError, match=r"env_ids: ids must lie in \[-2, 2\), got \[5\]"):
        stage(StepStager(2), rows=1, env_ids=[5])


def test_stager_rejects_bad_first_mask():
    with pytest.raises(ValueError, match=r"first: expected flags of shape \(2,\), got shape \(3,\)"):
        stage(StepStager(2), first=[True, False, True])


def test_stager_rejects_reward_with_extra_dims():
    with pytest.raises(ValueError, match=r"reward: expected shape \(2,\), got \(2, 2\)"):
        stage(StepStager(2), reward=np.zeros((2, 2)))


def test_stager_rejects_a_shape_change():
    stager = StepStager(2)
    stage(stager)
    with pytest.raises(ValueError, match=r"observation: expected per-env shape \(3,\), got \(4,\)"):
        stage(stager, obs=np.ones((2, 4), np.float32))


def test_stager_rejects_non_numeric_values():
    with pytest.raises(TypeError, match="observation: expected a torch tensor"):
        stage(StepStager(2), obs=["a", "b"])


def test_source_rejects_a_non_envpool_env():
    with pytest.raises(TypeError, match="env: expected an envpool env"):
        EnvPoolSource(object())


def test_source_rejects_history_of_another_size():
    with pytest.raises(ValueError, match="history: expected a HistoryBuffer with n_envs=4, got 3"):
        EnvPoolSource(make(), history=HistoryBuffer(3, 2))


def test_source_rejects_a_vectorized_transition_buffer_in_async_mode():
    from gpubuf.replay.buffer import TransitionBuffer

    tb = TransitionBuffer(64, 4, EnvPoolSource(make()).transition_sample(), device="cpu")
    with pytest.raises(ValueError, match="transitions: an async env needs a buffer with vectorized_env=False"):
        EnvPoolSource(make(num_envs=4, batch_size=2), transitions=tb)


def test_source_rejects_actions_of_the_wrong_size():
    src = EnvPoolSource(make())
    src.reset()
    with pytest.raises(ValueError, match=r"actions: expected shape \(4,\), got \(3,\)"):
        src.step(np.zeros(3, dtype=np.int64))
    with pytest.raises(ValueError, match=r"actions: expected shape \(4,\), got \(2, 2\)"):
        src.step(np.zeros((2, 2), dtype=np.int64))  # the same count of numbers is not enough
    src.step(np.zeros((4, 1), dtype=np.int64))  # a singleton axis may be added


@pytest.mark.parametrize("batch_size", [4, 2], ids=["sync", "async"])
def test_row_transitions_skip_reset_frames_and_follow_the_dynamics(device, batch_size):
    from gpubuf.planning import cartpole_dynamics
    from gpubuf.replay.buffer import TransitionBuffer

    src = EnvPoolSource(make(num_envs=4, batch_size=batch_size), device=device)
    tb = TransitionBuffer(512, 32, src.transition_sample(vectorized=False), vectorized_env=False, device=device)
    src.transitions = tb
    step = src.reset()
    rng = np.random.default_rng(2)
    expected = 0
    for _ in range(60):
        step = src.step(rng.integers(0, 2, len(step.env_ids)), step.env_ids)
        expected += int((~step.first).sum())
    assert len(tb) == expected  # every received row but reset frames
    batch = tb.sample(0, batch_size=128)
    live = ~batch.terminated.bool()
    pred = cartpole_dynamics(batch.observation.float(), batch.action.float()[:, None] * 2 - 1)
    torch.testing.assert_close(pred[live], batch.next_observation[live].float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("actions, message", [
    (np.array([0.7, -0.7, 1.0, 0.0]), r"actions: a discrete env takes integer actions, got \[0.7, -0.7\]"),
    (np.array([0.0, 1.0, np.nan, 0.0]), "actions: a discrete env takes integer actions"),
    (np.array([0, 1, 2, 0]), r"actions: expected actions in \[0, 2\), got \[0, 2\]"),
    (np.array([0, -1, 1, 0]), r"actions: expected actions in \[0, 2\), got \[-1, 1\]"),
])
def test_discrete_env_rejects_non_integral_or_out_of_range_actions(actions, message):
    """Nothing is sent: the env steps on exactly as the twin that never saw the bad call."""
    src, twin = EnvPoolSource(make(), device="cpu"), make()
    src.reset()
    twin.reset()
    with pytest.raises(ValueError, match=message):
        src.step(actions)
    step = src.step(np.array([1.0, 0.0, 1.0, 1.0]))  # integral floats are fine
    obs, *_ = twin.step(np.array([1, 0, 1, 1], np.int32))
    np.testing.assert_array_equal(step.info["observation"][:, 0].numpy(), obs)


def test_send_rejects_duplicate_env_ids_before_sending():
    src = EnvPoolSource(make(), device="cpu")
    src.reset()
    with pytest.raises(ValueError, match=r"env_ids: each env takes one action per send, got duplicates \[1\]"):
        src.send(np.array([0, 1]), env_ids=[1, 1])
    with pytest.raises(TypeError, match="env_ids: expected a 1-D sequence of ints"):
        src.send(np.zeros((0,)), env_ids=np.zeros((0, 2), np.int64))
    src.step(np.array([1, 0, 1, 1]))  # the env is still in step with its sends


@pytest.mark.parametrize("kw, exc, message", [
    ({"reward": np.array([1e300, 0.0])}, TypeError, r"reward: cannot store torch.float64 .* exceeds the largest"),
    ({"terminated": np.array([0.5, 0.0])}, TypeError, "terminated: expected bool flags"),
    ({"truncated": np.array([7, -3])}, ValueError, r"truncated: expected flags 0 or 1, got \[-3, 7\]"),
    ({"first": np.array([0.2, 0.0])}, TypeError, "first: expected bool flags"),
    ({"action": np.array([2**24 + 1, 0])}, TypeError, r"action: cannot store torch.int64 .*torch.float32"),
])
def test_stager_keeps_values_as_the_buffers_do(kw, exc, message):
    args = {"obs": np.zeros((2, 3), np.float32), "action": np.zeros(2), "reward": np.zeros(2),
            "terminated": np.zeros(2, bool), "truncated": np.zeros(2, bool), "first": None, **kw}
    with pytest.raises(exc, match=message):
        StepStager(2)(args["obs"], args["action"], args["reward"], args["terminated"], args["truncated"],
                      None, args["first"])
    StepStager(2)(args["obs"], np.zeros(2), np.zeros(2), np.array([0, 1]), np.zeros(2, np.uint8), None,
                  np.array([1, 0]))  # 0/1 integers are flags


def test_async_send_to_envs_in_flight_is_rejected():
    src = EnvPoolSource(make(num_envs=4, batch_size=2))
    step = src.reset()  # every env was reset: the two not received yet are still in flight
    rest = np.setdiff1d(np.arange(4), step.env_ids)
    with pytest.raises(ValueError, match=rf"env_ids: envs \{rest.tolist()}\ are in flight"):
        src.send(np.zeros(2, np.int64), rest)
    src.send(np.ones(2, np.int64), step.env_ids)
    with pytest.raises(ValueError, match="are in flight"):
        src.send(np.zeros(2, np.int64), step.env_ids)  # sent, not received: a second action would be lost
    got = src.recv()
    assert set(got.env_ids.tolist()) <= set(range(4))


def test_vectorized_transitions_need_every_env_before_anything_steps(device):
    from gpubuf import TransitionBuffer
    hist = HistoryBuffer(2, 4, device=device)
    src = EnvPoolSource(make(num_envs=2), history=hist, device=device)
    src.transitions = TransitionBuffer(20, 2, src.transition_sample(), device=device)
    src.reset()
    src.step(np.zeros(2, np.int64))
    counts, rows = hist.num_strided(), len(src.transitions)
    with pytest.raises(ValueError, match="env_ids: a vectorized transitions buffer stores one time row of all 2"):
        src.step(np.zeros(1, np.int64), env_ids=[0])
    assert hist.num_strided() == counts and len(src.transitions) == rows
    src.step(np.zeros(2, np.int64))  # nothing was sent: the env is still in step


@pytest.mark.parametrize("actions, exc, message", [
    (np.array([[np.nan], [0.0]], np.float32), ValueError, r"actions: expected finite actions, got \[nan\]"),
    (np.array([[1e300], [0.0]]), TypeError, r"actions: cannot store torch.float64 .*torch.float32"),
    (np.zeros((1, 2), np.float32), ValueError, r"actions: expected shape \(2, 1\), got \(1, 2\)"),
])
def test_continuous_env_rejects_bad_actions_before_sending(actions, exc, message):
    src, twin = EnvPoolSource(make("Pendulum-v1", num_envs=2), device="cpu"), make("Pendulum-v1", num_envs=2)
    src.reset()
    twin.reset()
    with pytest.raises(exc, match=message):
        src.step(actions)
    step = src.step(np.array([0.5, -0.5], np.float32))  # (R,) for a (1,)-shaped action: a singleton axis dropped
    obs, *_ = twin.step(np.array([[0.5], [-0.5]], np.float32))
    np.testing.assert_array_equal(step.info["observation"][:, 0].numpy(), obs)


def test_cached_action_path_falls_back_when_the_action_dtype_or_shape_changes():
    """The steady-state path is taken for actions like the last accepted ones; any other dtype,
    type or shape takes the checked path, and bad values raise there, with nothing sent."""
    src, twin = EnvPoolSource(make("Pendulum-v1", num_envs=2), device="cpu"), make("Pendulum-v1", num_envs=2)
    src.reset()
    twin.reset()

    def check(actions, executed):
        step = src.step(actions)
        obs, *_ = twin.step(np.asarray(executed, np.float32).reshape(2, 1))
        np.testing.assert_array_equal(step.info["observation"][:, 0].numpy(), obs)
        np.testing.assert_array_equal(step.info["action"][:, 0, 0].numpy(), np.asarray(executed, np.float32))
        assert step.info["action"].dtype == torch.float32

    with mock.patch.object(ActionCodec, "_checked", autospec=True,
                           side_effect=ActionCodec.__dict__["_checked"]) as checked:
        check(np.array([[0.5], [-3.0]], np.float32), [0.5, -2.0])
        check(np.array([[1.0], [9.0]], np.float32), [1.0, 2.0])  # the cached path, clipped
        assert checked.call_count == 1
        check(np.array([5.0, -0.25]), [2.0, -0.25])  # float64 (2,): the checked path, then cached
        check(np.array([0.125, 0.0]), [0.125, 0.0])
        assert checked.call_count == 2
    check(torch.tensor([[0.75], [-7.0]], requires_grad=True), [0.75, -2.0])  # a CPU tensor
    check(torch.tensor([[0.75], [-7.0]], dtype=torch.float16), [0.75, -2.0])
    check(np.array([[1.5], [0.0]], np.float16), [1.5, 0.0])
    for bad, exc, message in [
        (np.array([[np.nan], [0.0]], np.float16), ValueError, r"actions: expected finite actions, got \[nan\]"),
        (np.array([[np.inf], [0.0]], np.float32), ValueError, r"actions: expected finite actions, got \[inf\]"),
        (np.zeros((1, 2), np.float32), ValueError, r"actions: expected shape \(2, 1\), got \(1, 2\)"),
        (np.zeros((3, 1), np.float32), ValueError, r"actions: expected shape \(2, 1\), got \(3, 1\)"),
    ]:
        with pytest.raises(exc, match=message):
            src.step(bad)
    check(np.array([1e30, 0.0]), [2.0, 0.0])
    with pytest.raises(TypeError, match=r"actions: cannot store torch.float64 .*torch.float32"):
        src.step(np.array([1e300, 0.0]))  # same signature as the last accepted: a value check
    with pytest.raises(ValueError, match="actions: expected finite actions"):
        src.step(torch.tensor([[0.0], [float("nan")]]))
    check(np.array([[0.5], [-0.5]], np.float32), [0.5, -0.5])  # nothing was sent by the bad calls

    disc, dtwin = EnvPoolSource(make(num_envs=3), device="cpu"), make(num_envs=3)
    disc.reset()
    dtwin.reset()
    for actions in (np.array([0, 1, 1]), np.array([1, 1, 0]), np.array([[1], [0], [1]], np.int32),
                    np.array([1.0, 0.0, 0.0]), torch.tensor([0, 0, 1]), np.array([1, 0, 1], np.uint8)):
        step = disc.step(actions)
        obs, *_ = dtwin.step(np.asarray(actions).reshape(3).astype(np.int32))
        np.testing.assert_array_equal(step.info["observation"][:, 0].numpy(), obs)
        bad = np.array([0, 2, 1]).reshape(np.shape(actions)).astype(np.asarray(actions).dtype)
        bad = torch.from_numpy(bad) if isinstance(actions, torch.Tensor) else bad  # same signature
        with pytest.raises(ValueError, match=r"actions: expected actions in \[0, 2\), got \[0(\.0)?, 2"):
            disc.step(bad)
    with pytest.raises(ValueError, match="a discrete env takes integer actions"):
        disc.step(np.array([0.5, 0.0, 1.0]))
    step = disc.step(np.array([0, 0, 0]))
    obs, *_ = dtwin.step(np.zeros(3, np.int32))
    np.testing.assert_array_equal(step.info["observation"][:, 0].numpy(), obs)


def test_cached_stager_path_falls_back_when_a_layout_changes():
    stager = StepStager(2)
    obs = np.arange(6, dtype=np.float32).reshape(2, 3)
    step = stager(obs, np.zeros(2, np.float32), np.zeros(2, np.float32), np.zeros(2, bool), np.zeros(2, bool))
    with mock.patch.object(StepStager, "_checked", autospec=True,
                           side_effect=StepStager.__dict__["_checked"]) as checked:
        stager(obs + 1, np.zeros(2, np.float32), np.zeros(2, np.float32), np.zeros(2, bool), np.zeros(2, bool))
        assert checked.call_count == 0  # the cached path
        step = stager(obs, np.ones(2, np.float32), np.array([1.5, 2.0]), np.array([0, 1]), np.zeros(2, bool))
        assert step.info["reward"].dtype == torch.float32 and step.info["terminated"].dtype == torch.bool
        np.testing.assert_array_equal(step.info["reward"][:, 0].numpy(), [1.5, 2.0])
        np.testing.assert_array_equal(step.info["terminated"][:, 0].numpy(), [False, True])
        stager(obs, np.ones(2, np.float32), np.array([1.5, 2.0]), np.array([0, 1]), np.zeros(2, bool))
        assert checked.call_count == 1
    # the cached layout (float64 reward, int flags) still checks values
    with pytest.raises(ValueError, match=r"terminated: expected flags 0 or 1, got \[2\]"):
        stager(obs, np.ones(2, np.float32), np.zeros(2), np.array([0, 2]), np.zeros(2, bool))
    with pytest.raises(TypeError, match="reward: cannot store torch.float64"):
        stager(obs, np.ones(2, np.float32), np.array([1e300, 0.0]), np.array([0, 1]), np.zeros(2, bool))
    with pytest.raises(ValueError, match=r"observation: expected per-env shape"):
        stager(np.zeros((2, 4), np.float32), np.ones(2, np.float32), np.zeros(2), np.zeros(2, bool),
               np.zeros(2, bool))
    step = stager(obs[:, ::-1], torch.ones(2, 1), np.zeros(2, np.float16), np.zeros(2, bool), np.zeros(2, bool),
                  first=np.array([True, False]))  # a strided view, a tensor: the checked path
    np.testing.assert_array_equal(step.info["observation"][:, 0].numpy(), obs[:, ::-1])
    assert torch.isnan(step.info["action"][0]).all() and step.info["action"][1, 0, 0] == 1
    assert step.info["reward"].dtype == torch.float32


def test_sending_to_every_env_while_some_are_in_flight_is_rejected():
    src = EnvPoolSource(make(num_envs=4, batch_size=2), device="cpu")
    step = src.reset()
    with pytest.raises(ValueError, match="are in flight"):
        src.send(np.zeros(4, np.int64))
    src.send(np.zeros(2, np.int64), env_ids=step.env_ids)
