"""Rows that hold no transition, in a learner's hands, on real EnvPool envs.

- ``has_transition`` on batches sampled with ``boundaries="mask"``/``"forbid"`` (uniform and prioritized, frame
  stacks, n-step returns, a GraphSampler's outputs): False exactly on the ``info["is_last"]`` rows, which stay
  inside ``mask`` (a world model's target) but hold the action fill and reward 0;
- ``EnvPoolSource(action_fill=...)``: the action stored and echoed on every row whose action the env ignored;
- EnvPool's life-loss soft reset (Atari ``episodic_life=True``): the action sent after a life loss is ignored
  (checked on a twin env here), so that step's row is written as after an episode end;
- the n-step return at the newest row held: it stops before that row.
"""

import numpy as np
import pytest
import torch
from extras import needs

from gpubuf import HistoryBuffer, PrioritizedTransitionBuffer, Transition, TransitionBuffer
from gpubuf.sources.envpool import EnvPoolSource, StepStager, action_fill

envpool = needs("envpool")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def make(task, num_envs, seed=0, **kw):
    return envpool.make(task, env_type="gymnasium", num_envs=num_envs, seed=seed, **kw)


def fed(task, E, steps, device, n_steps=6, cls=TransitionBuffer, seed=0, **source_kw):
    """A source over ``task`` (short episodes: some terminate, some are truncated) feeding a fresh buffer with
    ``steps`` random steps after a reset; returns both."""
    env_kw = {"max_episode_steps": 15} if task == "CartPole-v1" else {"max_episode_steps": 10}
    src = EnvPoolSource(make(task, E, seed, **env_kw), device=device, **source_kw)
    buf = cls(E * (steps + 8), 16, src.transition_sample(), n_steps=n_steps, device=device, seed=1)
    src.transitions = buf
    src.reset()
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        if src.n_actions is None:
            src.step(rng.uniform(-2, 2, (E, 1)).astype(np.float32))
        else:
            src.step(rng.integers(0, src.n_actions, E))
    return src, buf


def sampled(buf, **kw):
    out = buf.sample(**kw)
    return out[0] if isinstance(out, tuple) else out


# ------------------------------------------------------------------ has_transition


@pytest.mark.parametrize("cls", [TransitionBuffer, PrioritizedTransitionBuffer])
def test_has_transition_is_false_exactly_on_the_rows_holding_no_transition(backend, device, cls):
    src, buf = fed("CartPole-v1", 4, 60, device, cls=cls)
    for boundaries in ("mask", "forbid"):
        batch = sampled(buf, key=3, batch_size=48, boundaries=boundaries, with_replacement=True)
        has, last = batch.has_transition, batch.info["is_last"]
        assert has.dtype == torch.bool and has.shape == batch.mask.shape == batch.is_first.shape == (48, 6)
        assert torch.equal(has, ~last)
        assert (batch.action[~has] == action_fill(src.action_dtype)).all() and (batch.reward[~has] == 0).all()
        kept = batch.action[batch.mask & has]  # what a learner of transitions keeps: real actions only
        assert ((kept >= 0) & (kept < 2)).all()
        torch.nn.functional.one_hot(kept, 2)  # a Dreamer-style encoding no longer sees the fill
        if boundaries == "mask":  # the last observation stays inside its episode, as a world model needs
            assert (batch.mask & ~has).any()
        else:  # a window inside one episode may end on its last observation, never hold one before
            assert not (~has[:, :-1]).any() and (~has[:, -1]).any()
    assert sampled(buf, key=1, boundaries="allow").has_transition is None  # unmarked, as is_first and mask


def test_single_transitions_and_buffers_without_is_last_always_hold_one(device):
    _, buf = fed("CartPole-v1", 4, 60, device, n_steps=1)
    for boundaries in ("mask", "forbid"):
        batch = sampled(buf, key=2, batch_size=64, boundaries=boundaries)
        assert batch.has_transition.shape == (64,) and batch.has_transition.all()
        assert not batch.info["is_last"].any()
    T, E = 12, 2
    done = np.zeros((T, E), bool)
    done[4] = True
    rows = Transition(observation=np.zeros((T, E, 3), np.float32), action=np.zeros((T, E), np.int64),
                      reward=np.zeros((T, E), np.float32), terminated=done, truncated=np.zeros((T, E), bool))
    own = TransitionBuffer(T * E, 8, rows, n_steps=4, device=device, seed=0).insert(rows)  # rows of a user's own
    for boundaries in ("mask", "forbid"):
        batch = own.sample(boundaries=boundaries)
        assert batch.has_transition.shape == (8, 4) and batch.has_transition.all()


def test_float_actions_are_nan_only_where_there_is_no_transition(device):
    """A TD-MPC2-style loss: weighing by the flags keeps the fill's NaN (NaN * 0 is NaN), selecting drops it; a
    finite action_fill makes the weighted loss finite too."""
    src, buf = fed("Pendulum-v1", 2, 40, device, n_steps=4)
    for boundaries in ("mask", "forbid"):
        batch = sampled(buf, key=1, batch_size=64, boundaries=boundaries)
        keep = batch.mask & batch.has_transition
        assert torch.equal(batch.action.isnan().any(-1), ~batch.has_transition)
        assert (~batch.has_transition).any()
        err = (torch.zeros_like(batch.action) - batch.action) ** 2
        assert torch.isnan((err * keep[..., None]).sum())
        assert torch.isfinite(torch.where(keep[..., None], err, 0.0).sum())
    src, buf = fed("Pendulum-v1", 2, 40, device, n_steps=4, action_fill=0.0)
    batch = sampled(buf, key=1, batch_size=64, boundaries="mask")
    assert (batch.action[~batch.has_transition] == 0).all() and not batch.action.isnan().any()


def test_frame_stacks_and_n_step_returns_carry_the_flag(device):
    src, buf = fed("CartPole-v1", 4, 60, device, n_steps=4)
    for boundaries in ("mask", "forbid"):
        batch = sampled(buf, key=4, batch_size=32, boundaries=boundaries, frame_stack=3)
        assert batch.observation.shape == (32, 4, 3, 4)
        assert torch.equal(batch.has_transition, ~batch.info["is_last"])
        assert (~batch.has_transition).any() if boundaries == "mask" else batch.has_transition[:, :-1].all()
        # next observations: windows of transitions only (they never hold a truncated row but their last)
        batch = sampled(buf, key=4, batch_size=32, boundaries=boundaries, frame_stack=3, with_next_obs=True)
        assert batch.next_observation.shape == (32, 4, 3, 4) and batch.has_transition.all()
    _, single = fed("CartPole-v1", 4, 60, device, n_steps=1)
    batch = sampled(single, key=5, batch_size=32, boundaries="mask", frame_stack=3, n_step_return=(3, 0.9))
    assert batch.has_transition.shape == (32,) and batch.has_transition.all()  # a return starts at a transition


def test_atari_pixels_through_the_source_stack_with_their_channel_axis(device):
    """The README's pixel replay shapes, through EnvPool: one (1, 84, 84) frame per env and row (stack_num=1), so
    k-frame stacks come back (B, k, 1, 84, 84)."""
    E = 2
    src = EnvPoolSource(make("Breakout-v5", E, stack_num=1, max_episode_steps=40), device=device)
    assert src.env.observation_space.shape == (1, 84, 84)
    buf = PrioritizedTransitionBuffer(E * 128, 32, src.transition_sample(), device=device, seed=0)
    src.transitions = buf
    src.reset()
    rng = np.random.default_rng(0)
    for _ in range(100):
        src.step(rng.integers(0, 4, E))
    batch, idx = buf.sample(with_replacement=True, frame_stack=4, n_step_return=(3, 0.99), boundaries="forbid")
    assert batch.observation.shape == batch.next_observation.shape == (32, 4, 1, 84, 84)
    assert batch.has_transition.all() and batch.action.shape == (32,)


def test_graph_sampler_outputs_refresh_the_flag_in_place(device):
    _, buf = fed("CartPole-v1", 4, 60, device)
    gs = buf.graph_sampler(batch_size=64, boundaries="forbid", generator=torch.Generator(device=device).manual_seed(0))
    seen = 0
    for _ in range(3):
        out, _ = gs.sample()
        has = out.has_transition
        buf.config.refresh_flags(out)
        assert out.has_transition is has  # the same tensor, refilled
        assert torch.equal(has, ~out.info["is_last"]) and not (~has[:, :-1]).any()
        seen += int((~has[:, -1]).sum())
    assert seen


def test_graph_sampler_flag_follows_each_draw_by_itself(device):
    _, buf = fed("CartPole-v1", 4, 60, device)
    gs = buf.graph_sampler(batch_size=64, boundaries="forbid", generator=torch.Generator(device=device).manual_seed(0))
    for _ in range(3):
        out, _ = gs.sample()
        assert torch.equal(out.has_transition, ~out.info["is_last"])


# ------------------------------------------------------------------ action_fill


@pytest.mark.parametrize("task,fill", [("CartPole-v1", 0), ("CartPole-v1", 1.0), ("Pendulum-v1", 0.0),
                                       ("Pendulum-v1", float("inf"))])
def test_the_chosen_fill_is_stored_and_echoed_where_the_env_ignored_the_action(device, task, fill):
    E = 2
    hist = HistoryBuffer(E, 64, device=device)
    src = EnvPoolSource(make(task, E, max_episode_steps=8), device=device, history=hist, action_fill=fill)
    buf = TransitionBuffer(E * 64, 4, src.transition_sample(), n_steps=2, device=device)
    src.transitions = buf
    echoes, firsts = [], []
    for k in range(20):
        step = src.step(np.zeros((E, 1), np.float32) if src.n_actions is None else np.ones(E, np.int64)) if k \
            else src.reset()
        echoes.append(step.info["action"][:, 0, 0].cpu().numpy())
        firsts.append(step.first)
    echoes, firsts = np.stack(echoes), np.stack(firsts)
    assert firsts[1:].any()
    np.testing.assert_array_equal(echoes[firsts], np.float32(fill))  # the echo: the fill, not NaN
    n = len(echoes) - max(int(np.flatnonzero(firsts[:, e]).max()) for e in range(E))  # rows since a reset frame
    got = hist.get(n)["action"].cpu().numpy()  # (E, n, 1): the history since its flush, the reset frame first
    np.testing.assert_array_equal(got[..., 0], echoes[-n:].T)
    assert (got[:, 0, 0] == np.float32(fill)).any()
    data = buf.state_dict()["data"]
    last = data["info['is_last']"][:19].cpu().numpy()
    action = data["action"][:19].cpu().numpy().reshape(19, E)
    assert last.any() and (action[last] == fill).all()
    assert src.action_fill == fill and type(src.action_fill) is (int if task == "CartPole-v1" else float)


def test_the_default_fill_is_action_fill_stored_and_nan_echoed(device):
    src = EnvPoolSource(make("CartPole-v1", 2), device=device)
    assert src.action_fill == -1 == action_fill(np.int64)
    assert torch.isnan(src.reset().info["action"]).all()
    assert np.isnan(EnvPoolSource(make("Pendulum-v1", 2), device=device).action_fill)


@pytest.mark.parametrize("task,fill,exc,message", [
    ("CartPole-v1", 1.5, ValueError, r"action_fill: 1.5 does not fit the actions \(int64 actions are integers\)"),
    ("CartPole-v1", float("nan"), ValueError, r"action_fill: nan does not fit the actions \(int64 actions are"),
    ("CartPole-v1", 2**63, ValueError, r"action_fill: 9223372036854775808 does not fit the actions \(int64 actions "
                                       r"lie in"),
    ("CartPole-v1", 2**24 + 1, ValueError, r"action_fill: 16777217 does not fit the actions \(the float32 action "
                                           r"echo holds integers up to 2\*\*24 exactly\)"),
    ("CartPole-v1", "0", TypeError, r"action_fill: expected a real number, got '0'"),
    ("CartPole-v1", True, TypeError, r"action_fill: expected a real number, got True"),
    ("CartPole-v1", np.zeros(2), TypeError, r"action_fill: expected a real number, got array"),
    ("Pendulum-v1", 1e39, ValueError, r"action_fill: 1e\+39 does not fit the actions \(a float32 action cannot "
                                      r"hold it\)"),
    ("Pendulum-v1", 1j, TypeError, r"action_fill: expected a real number, got 1j"),
    ("Pendulum-v1", 10**20, ValueError, r"action_fill: 100000000000000000000 does not fit the actions \(a "
                                        r"float32 action holds it only rounded \(to 1.0000000200408773e\+20\)\)"),
])
def test_a_fill_the_actions_cannot_hold_is_rejected_before_anything_is_written(device, task, fill, exc, message):
    E = 2
    env = make(task, E)
    probe = EnvPoolSource(make(task, E), device=device)
    hist = HistoryBuffer(E, 8, device=device)
    buf = TransitionBuffer(E * 16, 2, probe.transition_sample(), device=device)
    with pytest.raises(exc, match=message):
        EnvPoolSource(env, device=device, history=hist, transitions=buf, action_fill=fill)
    assert len(buf) == 0 and hist.get(1) is None  # nothing written
    EnvPoolSource(env, device=device, history=hist, transitions=buf).reset()  # the env and buffers still work
    assert len(buf) == 0 and hist.get(1) is not None


@pytest.mark.parametrize("fill,exc,message", [
    ("nan", TypeError, "action_fill: expected a real number, got 'nan'"),
    (1e39, ValueError, r"action_fill: 1e\+39 does not fit the float32 action echo"),
])
def test_the_stager_checks_its_fill(fill, exc, message):
    with pytest.raises(exc, match=message):
        StepStager(2, device="cpu", action_fill=fill)
    stager = StepStager(2, device="cpu", action_fill=-1)
    step = stager(np.zeros((2, 3)), np.ones(2), np.zeros(2), np.zeros(2, bool), np.zeros(2, bool),
                  first=np.array([True, False]))
    assert step.info["action"][:, 0, 0].tolist() == [-1.0, 1.0]


# ------------------------------------------------------------------ the life-loss soft reset


def drive_breakout(device, vectorized=True, steps=240, E=2, seed=5):
    """A Breakout source with episodic_life=True, random actions until every env lost at least two lives (at most
    ``steps`` steps). Returns the source, its buffer and history, and what it received (index 0: the reset):
    obs, the action sent to reach each row, reward, terminated, truncated, elapsed, lives (K+1, E, ...)."""
    env = make("Breakout-v5", E, seed, stack_num=1, episodic_life=True)
    hist = HistoryBuffer(E, steps + 1, device=device)
    src = EnvPoolSource(env, device=device, history=hist, info_keys=("elapsed_step", "lives"))
    buf = TransitionBuffer(E * (steps + 2), 8, src.transition_sample(vectorized), vectorized_env=vectorized,
                           n_steps=4 if vectorized else 1, device=device, seed=0)
    src.transitions = buf
    rng = np.random.default_rng(seed)
    names = {"obs": "observation", "echo": "action", "reward": "reward", "terminated": "terminated",
             "truncated": "truncated", "elapsed": "elapsed_step", "lives": "lives"}
    log = {k: [] for k in ("action", *names)}
    step, act = src.reset(), np.zeros(E, np.int64)
    for k in range(steps + 1):
        if k:
            act = rng.integers(0, 4, E)
            step = src.step(act)
        log["action"].append(act)
        for key, name in names.items():
            log[key].append(step.info[name][:, 0].cpu().numpy().reshape(E, *step.info[name].shape[2:]))
        log["echo"][-1] = log["echo"][-1][:, 0]
        # a life lost (terminated with lives left) twice by every env, the soft reset after it received
        lost = (np.stack(log["terminated"][:-1]) & (np.stack(log["lives"][:-1]) > 0)) if k > 1 else None
        if lost is not None and (lost.sum(0) >= 2).all():
            break
    return src, buf, hist, {k: np.stack(v) for k, v in log.items()}


def ignored_steps(log):
    """(K, E): step k + 1 ignored its action: it returned a reset frame, or followed an end without one (the
    soft reset)."""
    ended = log["terminated"][:-1] | log["truncated"][:-1]
    first = log["elapsed"][1:] == 0
    return first | ended, ended & ~first


def test_envpool_ignores_the_action_sent_after_a_life_loss(device):
    """The premise, on EnvPool itself: after a life loss (terminated, lives left) the next step returns the same
    elapsed_step and reward 0, and which action it was sent changes nothing that follows; the step after it does."""
    _, _, _, log = drive_breakout(device)
    ignored, soft = ignored_steps(log)
    k, e = map(int, np.argwhere(soft)[0])  # step k + 1 is a soft reset of env e
    assert log["terminated"][k, e] and log["lives"][k, e] > 0 and log["lives"][k, e] < log["lives"][0, e]
    assert log["elapsed"][k + 1, e] == log["elapsed"][k, e] and log["reward"][k + 1, e] == 0
    assert (soft.sum(0) >= 1).all()

    def replay(change_at=None, by=0):
        twin = make("Breakout-v5", 2, 5, stack_num=1, episodic_life=True)  # drive_breakout's env
        twin.reset()
        frames = []
        for j in range(1, min(k + 12, len(log["action"]))):
            a = log["action"][j].copy()
            if j == change_at:
                a[e] = (a[e] + by) % 4
            frames.append(twin.step(a)[0][e])
        return np.stack(frames)

    same = replay()
    np.testing.assert_array_equal(same[:k + 1], log["obs"][1:k + 2, e])  # the twin is the source's env
    for by in (1, 2, 3):
        np.testing.assert_array_equal(replay(k + 1, by), same)  # the soft reset's action: ignored
    assert any(not np.array_equal(replay(k + 4, by), same) for by in (1, 2, 3))  # a later one is executed


def test_the_step_after_a_life_loss_is_stored_as_after_an_episode_end(device):
    src, buf, hist, log = drive_breakout(device)
    K, E = log["elapsed"].shape[0] - 1, log["elapsed"].shape[1]
    ignored, soft = ignored_steps(log)
    assert (soft.sum(0) >= 2).all()
    ks, es = np.nonzero(soft)  # step ks + 1 of env es: the soft reset after the life lost at row ks
    assert (log["lives"][ks, es] > 0).all() and (log["elapsed"][ks + 1, es] == log["elapsed"][ks, es]).all()
    fill = action_fill(src.action_dtype)
    data = buf.state_dict()["data"]
    got = {k: data[name][:K].cpu().numpy() for k, name in (
        ("observation", "observation"), ("action", "action"), ("reward", "reward"), ("terminated", "terminated"),
        ("truncated", "truncated"), ("is_last", "info['is_last']"), ("lives", "info['lives']"))}
    np.testing.assert_array_equal(got["observation"], log["obs"][:-1])
    np.testing.assert_array_equal(got["action"], np.where(ignored, fill, log["action"][1:]))
    np.testing.assert_array_equal(got["reward"], np.where(ignored, 0.0, log["reward"][1:]))
    np.testing.assert_array_equal(got["terminated"], log["terminated"][1:] & ~ignored)
    np.testing.assert_array_equal(got["truncated"], ignored)
    np.testing.assert_array_equal(got["is_last"], ignored)
    np.testing.assert_array_equal(got["lives"], log["lives"][:-1])
    # the life's last transition is terminated, its last observation follows, then the frame the game resumes from
    inside = ks + 1 < K
    assert got["terminated"][ks - 1, es].all() and got["is_last"][ks, es].all()
    assert not got["is_last"][ks[inside] + 1, es[inside]].any()
    # the echo: the fill (NaN) on the soft reset, as on reset frames; the history goes on through a life loss
    assert np.isnan(log["echo"][1:][ignored]).all() and not np.isnan(log["echo"][1:][~ignored]).any()
    n = 1 + K - max(int(np.flatnonzero(log["elapsed"][:, e] == 0).max()) for e in range(E))
    held = hist.get(n, keys=("action", "lives"))
    np.testing.assert_array_equal(held["action"][..., 0].cpu().numpy(), log["echo"][-n:].T)
    assert np.isnan(held["action"][:, 1:].cpu().numpy()).any()  # a soft reset inside the history since its flush

    batch, idx = buf.sample(key=0, batch_size=64, boundaries="mask", return_indices=True)
    env, row, _ = (t.cpu().numpy() for t in buf.locate(idx))
    rows = row[:, None] + np.arange(4)
    envs = np.broadcast_to(env[:, None], rows.shape)
    np.testing.assert_array_equal(batch.has_transition.cpu().numpy(), ~ignored[rows, envs])
    np.testing.assert_array_equal(batch.is_first[:, 1:].cpu().numpy(), ignored[rows, envs][:, :-1])
    assert soft[rows, envs].any()  # some windows cross a life loss


def test_row_transitions_skip_the_step_after_a_life_loss(device):
    src, buf, _, log = drive_breakout(device, vectorized=False)
    ignored, soft = ignored_steps(log)
    assert soft.any()
    keep = ~ignored  # (K, E): step k + 1 executed its action, a transition from row k's observation
    assert len(buf) == int(keep.sum())
    ks, es = np.nonzero(keep)  # step order, then env order: the order the source inserted them
    data = buf.state_dict()["data"]
    np.testing.assert_array_equal(data["observation"][:len(ks)].cpu().numpy(), log["obs"][ks, es])
    np.testing.assert_array_equal(data["next_observation"][:len(ks)].cpu().numpy(), log["obs"][ks + 1, es])
    np.testing.assert_array_equal(data["action"][:len(ks)].cpu().numpy(), log["action"][ks + 1, es])
    np.testing.assert_array_equal(data["terminated"][:len(ks)].cpu().numpy(), log["terminated"][ks + 1, es])


# ------------------------------------------------------------------ n-step returns at the newest row held


def test_an_n_step_return_stops_before_the_newest_row_held(backend, device):
    """The newest row's reward is never taken (its next observation is not held yet): the return stops before it
    and bootstraps from its observation, with truncated set when fewer than n rewards were taken."""
    T, n, gamma = 6, 3, 0.5
    rows = Transition(observation=torch.arange(T, dtype=torch.float32).view(T, 1, 1),
                      action=torch.zeros(T, 1, dtype=torch.int64),
                      reward=torch.arange(1, T + 1, dtype=torch.float32).view(T, 1),
                      terminated=torch.zeros(T, 1, dtype=torch.bool), truncated=torch.zeros(T, 1, dtype=torch.bool))
    buf = TransitionBuffer(16, 4, rows, device=device, seed=0).insert(rows)
    assert buf.num_valid(with_next_obs=True) == T - 1  # the newest row starts none
    batch = buf.sample(batch_size=T - 1, with_replacement=False, n_step_return=(n, gamma))
    for s, ret, disc, nxt, cut in zip(batch.observation[:, 0].tolist(), batch.reward.tolist(),
                                      batch.discount.tolist(), batch.next_observation[:, 0].tolist(),
                                      batch.truncated.tolist(), strict=True):
        s = int(s)
        m = min(n, T - 1 - s)  # rewards of rows s .. s + m - 1, never the newest row's (T - 1)
        assert ret == pytest.approx(sum(gamma**i * (s + i + 1) for i in range(m)))
        assert disc == pytest.approx(gamma**m) and nxt == s + m and cut == (m < n)
