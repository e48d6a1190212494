"""The demo's learner: the ensemble's shapes and member routing, train_step learning a known system (and feeding
priorities back), the episode log, a short agent run through the shared env loop, and every config field checked by
name."""

import numpy as np
import pytest
import torch
from extras import needs

from gpubuf import PrioritizedTransitionBuffer, Step, Transition, TransitionBuffer
from gpubuf.apps.mbrl import EnsembleDynamics, EpisodeLog, MBRLAgent, MBRLConfig, to_discrete, train_step
from gpubuf.planning import cartpole_cost


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one thread is many times faster than two on a busy 2-core box (no OpenMP contention)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_to_discrete_cuts_the_range_into_equal_bins():
    plan = torch.tensor([-1.0, -0.01, 0.0, 0.4, 1.0])
    assert to_discrete(plan, 2).tolist() == [0, 0, 1, 1, 1]
    assert to_discrete(plan, 3).tolist() == [0, 1, 1, 2, 2]


def test_plan_step_rolls_row_i_out_on_member_i_mod_members():
    torch.manual_seed(0)
    model = EnsembleDynamics(obs_dim=3, n_actions=2, members=3, hidden=8)
    N = 7  # not a multiple of the members: padded inside
    state, action = torch.randn(N, 5), torch.rand(N, 1) * 2 - 1
    out = model.plan_step(state, action)
    assert out.shape == (N, 5)
    act = model.one_hot(to_discrete(action[:, 0], 2))
    for i in range(N):
        k = i % 3
        nxt = model.next_obs(state[None, i:i + 1, :3].expand(3, 1, 3), act[None, i:i + 1].expand(3, 1, 2))[k, 0]
        reward, logit = model.outcome(nxt[None, None].expand(3, 1, 3))
        torch.testing.assert_close(out[i], torch.cat([nxt, reward[k], logit[k]]))


def test_plan_cost_is_minus_the_reward_plus_the_task_cost():
    state = torch.tensor([[0.5, 0.0, 0.1, 0.0, 2.0, -3.0]])
    action = torch.zeros(1, 1)
    assert EnsembleDynamics(4, 2).plan_cost(state, action).tolist() == [-2.0]
    with_task = EnsembleDynamics(4, 2, task_cost=cartpole_cost).plan_cost(state, action)
    torch.testing.assert_close(with_task, -2.0 + cartpole_cost(state[:, :4], action))
    assert EnsembleDynamics(4, 2).plan_terminated(state).tolist() == [False]


def linear_rollout(T, E, gen):
    """Transitions of x' = 0.9 x + (a - 0.5), reward = x[0]; terminated where |x'[0]| > 2."""
    obs = torch.zeros(T + 1, E, 2)
    obs[0] = torch.randn(E, 2, generator=gen)
    action = torch.randint(0, 2, (T, E), generator=gen)
    for t in range(T):
        obs[t + 1] = 0.9 * obs[t] + (action[t, :, None] - 0.5)
    return Transition(observation=obs[:-1], action=action, reward=obs[1:, :, 0],
                      terminated=obs[1:, :, 0].abs() > 2, truncated=torch.zeros(T, E, dtype=torch.bool))


@pytest.mark.parametrize("prioritized", [False, True])
def test_train_step_learns_a_known_system_and_feeds_priorities_back(prioritized):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    data = linear_rollout(100, 8, gen)
    cls = PrioritizedTransitionBuffer if prioritized else TransitionBuffer
    buffer = cls(8 * 100, 3 * 32, linear_rollout(1, 8, gen), n_steps=3, device="cpu", seed=0)
    buffer.insert(data)
    model = EnsembleDynamics(2, 2, members=3, hidden=32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = train_step(buffer, model, opt, batch_size=32)
    for _ in range(60):
        last = train_step(buffer, model, opt, batch_size=32)
    assert last < first / 5
    if prioritized:
        assert buffer.max_priority > 1.0  # window errors came back as priorities
    with torch.no_grad():
        obs = torch.tensor([[[1.0, -1.0]]]).expand(3, 1, 2)
        nxt = model.next_obs(obs, model.one_hot(torch.ones(3, 1)))
    torch.testing.assert_close(nxt, torch.tensor([[[1.4, -0.4]]]).expand(3, 1, 2), atol=0.15, rtol=0)


def test_train_step_rejects_bad_arguments():
    model = EnsembleDynamics(2, 2)
    gen = torch.Generator().manual_seed(0)
    buffer = TransitionBuffer(80, 6, linear_rollout(1, 8, gen), device="cpu")
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(TypeError, match="buffer: expected a gpubuf TransitionBuffer, got list"):
        train_step([], model, opt)
    with pytest.raises(TypeError, match="model: expected an EnsembleDynamics, got Linear"):
        train_step(buffer, torch.nn.Linear(1, 1), opt)
    with pytest.raises(ValueError, match="batch_size: expected a positive int, got 0"):
        train_step(buffer, model, opt, batch_size=0)


def fake_step(ids, reward, terminated, truncated=None):
    R = len(ids)
    truncated = torch.zeros(R, dtype=torch.bool) if truncated is None else torch.tensor(truncated)
    info = {"reward": torch.tensor(reward, dtype=torch.float32)[:, None],
            "terminated": torch.tensor(terminated)[:, None], "truncated": truncated[:, None]}
    return Step(info, np.asarray(ids), np.zeros(R, dtype=bool))


def test_episode_log_closes_episodes_on_termination_or_truncation():
    log = EpisodeLog(2)
    log.record(fake_step([0, 1], [1.0, 2.0], [False, False]))
    log.record(fake_step([0, 1], [1.0, 2.0], [True, False]))
    log.record(fake_step([1], [5.0], [False], [True]))  # async-style subset
    assert log.episodes == [[4, 2.0], [5, 9.0]] and log.env_steps == 5
    assert log.last_mean(10) == 5.5 and log.last_mean(1) == 9.0
    assert log.solved_at(5.0, window=2) == 5 and log.solved_at(5.0, window=1) == 5
    assert log.solved_at(10.0, window=1) is None and log.solved_at(1.0, window=3) is None
    assert np.isnan(EpisodeLog(1).last_mean())


envpool = needs("envpool")


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_agent_runs_a_short_learning_run(alpha):
    env = envpool.make("CartPole-v1", env_type="gymnasium", num_envs=4, seed=0)
    config = MBRLConfig(capacity=4 * 100, batch_size=8, updates=1, horizon=5, num_samples=12, num_elites=3,
                        iterations=1, alpha=alpha)
    agent = MBRLAgent(env, config, task_cost=cartpole_cost, device="cpu", seed=0)
    log = agent.run(60, progress=lambda log: None)
    assert log.env_steps == 60 and log.episodes  # random-ish early play ends episodes
    assert isinstance(agent.buffer, PrioritizedTransitionBuffer) == (alpha > 0)
    assert np.isfinite(agent.loss) and agent.history.num_strided() == [1] * 4
    agent.run(4)
    assert log.env_steps == 64


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_agent_rejects_what_it_cannot_learn():
    with pytest.raises(TypeError, match="config: expected an MBRLConfig, got dict"):
        MBRLAgent(envpool.make("CartPole-v1", env_type="gymnasium", num_envs=2), {})
    with pytest.raises(ValueError, match=r"env: expected vector observations and discrete actions, got observations "
                                         r"\(4, 84, 84\)"):
        MBRLAgent(envpool.make("Pong-v5", env_type="gymnasium", num_envs=2))
    with pytest.raises(ValueError, match=r"env: expected a sync env \(batch_size == num_envs\)"):
        MBRLAgent(envpool.make("CartPole-v1", env_type="gymnasium", num_envs=4, batch_size=2))


@pytest.mark.parametrize(("kw", "error", "message"), [
    ({"obs_dim": 0}, ValueError, "obs_dim: expected a positive int, got 0"),
    ({"n_actions": 1.5}, ValueError, "n_actions: expected a positive int, got 1.5"),
    ({"members": -1}, ValueError, "members: expected a positive int, got -1"),
    ({"hidden": 0}, ValueError, "hidden: expected a positive int, got 0"),
    ({"task_cost": 3}, TypeError, "task_cost: expected a callable or None, got int"),
])
def test_ensemble_rejects_bad_sizes(kw, error, message):
    with pytest.raises(error, match=message):
        EnsembleDynamics(**{"obs_dim": 4, "n_actions": 2, **kw})


@pytest.mark.parametrize(("kw", "message"), [
    ({"capacity": 0}, "capacity: expected a positive int, got 0"),
    ({"horizon": 2.0}, "horizon: expected a positive int, got 2.0"),
    ({"alpha": -0.1}, "alpha: expected a finite number >= 0, got -0.1"),
    ({"lr": 0.0}, "lr: expected a finite number > 0, got 0.0"),
])
def test_config_rejects_bad_values(kw, message):
    with pytest.raises(ValueError, match=message):
        MBRLConfig(**kw)


@pytest.mark.parametrize(("kw", "message"), [
    ({"capacity": 8}, r"capacity: expected at least 195 for members \* batch_size = 192 windows of n_steps = 4 rows, "
                      r"got 8"),
    ({"capacity": 100, "batch_size": 33}, r"capacity: expected at least 102 for members \* batch_size = 99 windows"),
    ({"n_steps": 20_000}, r"capacity: expected at least 20191 for .* n_steps = 20000 rows, got 20000"),
    ({"batch_size": 0}, "batch_size: expected a positive int, got 0"),
    ({"members": True}, "members: expected a positive int, got True"),
    ({"updates": 0}, "updates: expected a positive int, got 0"),
    ({"hidden": None}, "hidden: expected a positive int, got None"),
    ({"iterations": -2}, "iterations: expected a positive int, got -2"),
    ({"num_samples": 0}, "num_samples: expected a positive int, got 0"),
    ({"beta": float("nan")}, "beta: expected a finite number >= 0, got nan"),
    ({"alpha": 60.0}, r"alpha: expected at most 51.28 \(eps\*\*alpha with the buffer's eps 1e-06 must not underflow\), "
                      r"got 60.0"),
    ({"lr": float("inf")}, "lr: expected a finite number > 0, got inf"),
    ({"receding_horizon": 16}, r"receding_horizon: expected <= horizon \(15\), got 16"),
    ({"num_elites": 65}, r"num_elites: expected <= num_samples \(64\), got 65"),
])
def test_config_names_the_field_that_is_wrong(kw, message):
    """Every field is checked by the config itself, which names it (never a buffer's or solver's argument)."""
    with pytest.raises(ValueError, match=message) as err:
        MBRLConfig(**kw)
    assert not any(word in str(err.value) for word in ("max_size", "sample_batch_size", "E*(M"))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_agent_names_the_capacity_its_envs_need_before_any_work():
    """Each env holds capacity // n_envs rows: 16 envs need 16 * (12 + 3) = 240 for 192 windows of 4 rows."""
    config = MBRLConfig(capacity=239)
    assert config.min_capacity(16) == 240 and config.min_capacity(1) == 195
    env = envpool.make("CartPole-v1", env_type="gymnasium", num_envs=16)
    with pytest.raises(ValueError, match=r"capacity: expected at least 240 for members \* batch_size = 192 windows "
                                         r"of n_steps = 4 rows over 16 envs \(15 rows each\), got 239"):
        MBRLAgent(env, config, device="cpu")
    MBRLAgent(env, MBRLConfig(capacity=240), device="cpu")  # the smallest that samples
