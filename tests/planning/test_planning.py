"""Planner (queues, subset re-planning, flush on reset) and CEMSolver, on the CPU torch path."""

import numpy as np
import pytest
import torch
from extras import needs

from gpubuf import CEMSolver, EnvPoolSource, HistoryBuffer, PlanConfig, Planner
from gpubuf.planning import cartpole_cost, cartpole_dynamics

envpool = needs("envpool")  # absent on the GPU machine, which has no registry


class RecordingSolver:
    """Plans whose action values say who asked and when: ``1000 * call + 10 * env + step``."""

    def __init__(self, horizon, dim):
        self.horizon, self.dim, self.calls = horizon, dim, []

    def __call__(self, history, env_ids):
        self.calls.append((np.asarray(env_ids).tolist(), {k: tuple(v.shape) for k, v in history.items()}))
        call = len(self.calls)
        steps = torch.arange(self.horizon * self.dim, dtype=torch.float32).view(1, self.horizon, self.dim)
        return 1000 * call + 10 * torch.as_tensor(env_ids, dtype=torch.float32).view(-1, 1, 1) + steps


def info(rows, t):
    return {"observation": torch.full((rows, 1, 2), float(t)), "action": torch.zeros(rows, 1, 1)}


def test_queues_pop_in_order_and_refill_when_empty(device):
    cfg = PlanConfig(horizon=3, receding_horizon=2, action_block=2, history_len=2)
    solver = RecordingSolver(3, 2)  # (horizon, action_block * action_dim)
    planner = Planner(cfg, solver, n_envs=2, action_dim=1, device=device)
    popped = [planner.act(info(2, t))[:, 0].cpu().tolist() for t in range(6)]
    # queue = the first receding_horizon planned steps, each unrolled into action_block env actions
    assert popped[:4] == [[1000.0, 1010.0], [1001.0, 1011.0], [1002.0, 1012.0], [1003.0, 1013.0]]
    assert popped[4:] == [[2000.0, 2010.0], [2001.0, 2011.0]]
    assert [c[0] for c in solver.calls] == [[0, 1], [0, 1]]
    # n = min(history_len, max(num_strided)): 1 frame at the first call, 2 (with one action block) later
    assert solver.calls[0][1] == {"observation": (2, 1, 2)}
    assert solver.calls[1][1] == {"observation": (2, 2, 2), "action": (2, 1, 2)}


def test_only_envs_with_empty_queues_are_replanned(device):
    planner = Planner(PlanConfig(4, 2), RecordingSolver(4, 1), n_envs=3, action_dim=1, device=device)
    planner.act(info(3, 0))  # all three plan
    a = planner.act(info(2, 1), env_ids=[2, 0])  # async-style subset: one action left for 0 and 2
    assert a[:, 0].tolist() == [1021.0, 1001.0]
    a = planner.act(info(2, 2), env_ids=[0, 1])  # 0 is empty -> re-planned alone; 1 still holds one
    assert planner.replanned.tolist() == [0]
    assert a[:, 0].tolist() == [2000.0, 1011.0]
    assert [c[0] for c in planner.solver.calls] == [[0, 1, 2], [0]]


def test_reset_frames_flush_history_and_queue(device):
    planner = Planner(PlanConfig(4, 4, history_len=3), RecordingSolver(4, 1), n_envs=2, action_dim=1, device=device)
    for t in range(3):
        planner.act(info(2, t))
    assert planner.history.num_strided() == [3, 3]
    a = planner.act(info(2, 9), first=[False, True])
    # env 1 restarts from its reset frame (the history keeps one spare slot: env 0 holds 4 entries, reads 3)
    assert planner.history.num_strided() == [4, 1]
    assert planner.replanned.tolist() == [1] and a[:, 0].tolist() == [1003.0, 2010.0]
    assert planner.solver.calls[-1][1] == {"observation": (1, 1, 2)}  # n = 1: only the reset frame is real


def test_cem_solver_finds_the_minimum_of_a_known_cost():
    target = torch.tensor([[0.5], [-0.25]])
    solver = CEMSolver(lambda s, a: s + a, lambda s, a: ((s - target.repeat_interleave(128, 0)) ** 2).sum(1),
                       horizon=1, action_dim=1, num_samples=128, num_elites=16, iterations=6)  # no Planner: sizes here
    plan = solver({"observation": torch.zeros(2, 1, 1)}, [0, 1])
    assert plan.shape == (2, 1, 1)
    torch.testing.assert_close(plan[:, 0], target, atol=0.05, rtol=0)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_cem_planner_balances_real_cartpole(device):
    """Planner + CEM over CartPole's equations on EnvPool: no episode ends in 150 steps."""
    env = envpool.make("CartPole-v1", env_type="gymnasium", num_envs=4, seed=3)
    src = EnvPoolSource(env, device=device)
    planner = Planner(PlanConfig(horizon=10, receding_horizon=2), CEMSolver(cartpole_dynamics, cartpole_cost),
                      n_envs=4, action_dim=1, device=device)
    step = src.reset()
    for _ in range(150):
        a = planner.act(step.info, step.env_ids, step.first)
        step = src.step((a[:, 0] > 0).cpu().numpy().astype(np.int32))
        assert not step.info["terminated"].any()


# ------------------------------------------------------------------ rejected input


@pytest.mark.parametrize("field", ["horizon", "receding_horizon", "action_block", "history_len"])
def test_plan_config_sizes_must_be_positive(field):
    kwargs = dict(horizon=4, receding_horizon=2, action_block=1, history_len=1)
    kwargs[field] = 0
    with pytest.raises(ValueError, match=f"{field}: expected a positive int, got 0"):
        PlanConfig(**kwargs)


def test_plan_config_receding_horizon_within_horizon():
    with pytest.raises(ValueError, match=r"receding_horizon: expected <= horizon \(2\), got 3"):
        PlanConfig(horizon=2, receding_horizon=3)


def test_planner_rejects_bad_config_and_solver():
    with pytest.raises(TypeError, match="config: expected a PlanConfig, got dict"):
        Planner({}, RecordingSolver(1, 1), 2, 1)
    with pytest.raises(TypeError, match="solver: expected a callable solver"):
        Planner(PlanConfig(1, 1), None, 2, 1)


def test_planner_rejects_a_solver_output_of_the_wrong_shape():
    planner = Planner(PlanConfig(3, 1), lambda h, ids: torch.zeros(len(ids), 2, 1), n_envs=2, action_dim=1)
    with pytest.raises(ValueError, match=r"solver: expected float actions of shape \(2, 3, 1\), got torch.float32 "
                                         r"\(2, 2, 1\)"):
        planner.act(info(2, 0))


class FlakySolver(RecordingSolver):
    """Fails (raises, or returns a wrong shape) on the calls listed in ``fail_on``."""

    def __init__(self, horizon, width, fail_on, how):
        super().__init__(horizon, width)
        self.n, self.fail_on, self.how = 0, fail_on, how

    def __call__(self, history, ids):
        self.n += 1
        if self.n in self.fail_on:
            if self.how == "raise":
                raise RuntimeError("model crashed")
            return torch.zeros(len(ids), 1, 1)
        return super().__call__(history, ids)


@pytest.mark.parametrize("how", ["raise", "shape"])
def test_failed_act_leaves_the_planner_as_before_and_a_retry_matches(how, device):
    """A solver failure half-way through act() (after the step was appended, on a full history, with a reset
    frame in the batch) undoes everything: retrying the same step gives what a planner that never failed gives."""
    cfg = PlanConfig(2, 1, history_len=3)
    ok = Planner(cfg, RecordingSolver(2, 1), n_envs=3, action_dim=1, device=device)
    flaky = Planner(cfg, FlakySolver(2, 1, fail_on={6}, how=how), n_envs=3, action_dim=1, device=device)
    firsts = [None, None, None, None, None, [False, True, False], None]
    for t, first in enumerate(firsts):
        want = ok.act(info(3, t), first=first)
        if t == 5:
            with pytest.raises((RuntimeError, ValueError)):
                flaky.act(info(3, 99), first=first)  # other data: a write that was not undone would show
        got = flaky.act(info(3, t), first=first)
        assert torch.equal(got, want), t
        assert flaky.history.num_strided() == ok.history.num_strided()
        assert all(torch.equal(flaky.history.get(3)[k], v) for k, v in ok.history.get(3).items())


def test_planner_rejects_duplicate_env_ids():
    planner = Planner(PlanConfig(1, 1), RecordingSolver(1, 1), n_envs=2, action_dim=1)
    with pytest.raises(ValueError, match=r"env_ids: expected distinct envs"):
        planner.act(info(2, 0), env_ids=[1, 1])


def test_planner_rejects_a_first_mask_of_the_wrong_shape():
    planner = Planner(PlanConfig(1, 1), RecordingSolver(1, 1), n_envs=2, action_dim=1)
    with pytest.raises(ValueError, match=r"first: expected flags of shape \(2,\), got shape \(3,\)"):
        planner.act(info(2, 0), first=[True, False, True])
    with pytest.raises(TypeError, match="first: expected bool flags"):
        planner.act(info(2, 0), first=[0.2, 0.0])


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e300])
def test_a_non_finite_plan_is_rejected_and_undone(value, device):
    """NaN, inf, or a float64 plan beyond float32's range never reaches the action queue."""
    cfg = PlanConfig(2, 1, history_len=2)
    bad = {"on": False}

    def solver(history, ids):
        plan = RecordingSolver(2, 1)(history, ids).double()
        return plan.fill_(value) if bad["on"] else plan

    planner = Planner(cfg, solver, n_envs=2, action_dim=1, device=device)
    planner.act(info(2, 0))
    before = planner.history.get(2)
    bad["on"] = True
    with pytest.raises(ValueError, match=r"solver: planned actions must be finite in torch.float32"):
        planner.act(info(2, 1))
    assert all(torch.equal(planner.history.get(2)[k], v) for k, v in before.items())
    bad["on"] = False
    assert planner.act(info(2, 1)).isfinite().all()


@pytest.mark.parametrize("kw, message", [
    ({"init_std": float("nan")}, "init_std: expected a finite number > 0, got nan"),
    ({"init_std": 0.0}, "init_std: expected a finite number > 0, got 0.0"),
    ({"low": float("-inf")}, "low: expected a finite number, got -inf"),
    ({"high": float("nan")}, "high: expected a finite number, got nan"),
    ({"low": 1.0, "high": 1.0}, "low, high: expected low < high"),
    ({"seed": -1}, r"seed: expected an int in \[0, 2\*\*64\), got -1"),
    ({"seed": 1.5}, "seed: expected an int"),
    ({"seed": True}, "seed: expected an int"),
])
def test_cem_rejects_non_finite_parameters(kw, message):
    with pytest.raises(ValueError, match=message):
        CEMSolver(cartpole_dynamics, cartpole_cost, 2, 1, **kw)


def test_cem_rejects_more_elites_than_samples():
    with pytest.raises(ValueError, match=r"num_elites: expected <= num_samples \(4\), got 8"):
        CEMSolver(cartpole_dynamics, cartpole_cost, 2, 1, num_samples=4, num_elites=8)


# ------------------------------------------------------------------ warm start, cost contract, shared history


class InitRecorder(RecordingSolver):
    """A RecordingSolver that takes ``init`` (so the planner warm-starts it) and records it."""

    def __init__(self, horizon, dim):
        super().__init__(horizon, dim)
        self.inits = []

    def __call__(self, history, env_ids, init):
        self.inits.append(init.clone())
        return super().__call__(history, env_ids)


def test_planner_warm_starts_from_the_shifted_plan_and_resets_fresh(device):
    solver = InitRecorder(4, 1)
    planner = Planner(PlanConfig(horizon=4, receding_horizon=2), solver, n_envs=2, action_dim=1, device=device)
    planner.act(info(2, 0))
    assert solver.inits[0].shape == (2, 4, 1) and solver.inits[0].isnan().all()  # nothing planned yet
    planner.act(info(2, 1))
    planner.act(info(2, 2), first=[False, True])  # both queues empty: re-plan; env 1 was reset
    init = solver.inits[1].cpu()
    # env 0: the first plan (1000 + 10 * env + step) shifted by the 2 executed steps, NaN tail
    assert init[0, :2, 0].tolist() == [1002.0, 1003.0] and init[0, 2:].isnan().all()
    assert init[1].isnan().all()  # a reset env starts from the solver's default
    assert len(solver.calls) == 2


def test_a_solver_without_init_is_called_as_before(device):
    solver = RecordingSolver(3, 1)
    planner = Planner(PlanConfig(3, 1), solver, n_envs=2, action_dim=1, device=device)
    planner.act(info(2, 0))
    planner.act(info(2, 1))
    assert len(solver.calls) == 2


def test_cem_starts_from_init_and_fills_nan_with_the_middle_of_the_bounds():
    solver = CEMSolver(lambda s, a: s, lambda s, a: s[:, 0] * 0, num_samples=4, num_elites=4, iterations=1,
                       init_std=1e-6, low=0.0, high=2.0)
    init = torch.tensor([[[0.25], [float("nan")]], [[float("nan")], [1.5]]])
    plan = solver({"observation": torch.zeros(2, 1, 1)}, [0, 1], init=init)
    torch.testing.assert_close(plan, torch.tensor([[[0.25], [1.0]], [[1.0], [1.5]]]), atol=1e-4, rtol=0)


def test_cem_runs_models_without_autograd():
    layer = torch.nn.Linear(1, 1)

    def dynamics(s, a):
        assert not torch.is_grad_enabled()
        return layer(s) + a

    solver = CEMSolver(dynamics, lambda s, a: s[:, 0] ** 2, horizon=2, action_dim=1)
    plan = solver({"observation": torch.zeros(3, 1, 1)}, [0, 1, 2])
    assert not plan.requires_grad and layer.weight.grad is None


def run_cem(cost, dynamics, horizon, **kw):
    solver = CEMSolver(dynamics, cost, horizon=horizon, action_dim=1, num_samples=512, num_elites=32, iterations=8,
                       **kw)
    return solver({"observation": torch.zeros(1, 1, 2)}, [0])[0, :, 0]


def test_termination_freezes_the_return_after_the_terminal_step():
    """Reward = position (cost -x), x' = x + a, terminal once x' > 1.5. Without termination: a = (1, 1, 1). With it:
    reach 1.5 without crossing, then cross on the last step, which still pays its cost: a = (1, 0.5, 1)."""
    dynamics = lambda s, a: s + torch.cat([a, a], 1)
    cost = lambda s, a: -s[:, 0]
    assert run_cem(cost, dynamics, 3).tolist() == pytest.approx([1, 1, 1], abs=0.05)
    plan = run_cem(cost, dynamics, 3, terminated=lambda s: s[:, 0] > 1.5)
    assert plan.tolist() == pytest.approx([1, 0.5, 1], abs=0.1)


def test_discount_weighs_later_costs():
    """Step 0 costs a0, step 1 pays back 2 * a0: worth it (a0 = 1) undiscounted, not with discount 0.25."""

    def dynamics(s, a):  # state (x, t): x keeps the first action, t counts steps
        return torch.stack([torch.where(s[:, 1] == 0, a[:, 0], s[:, 0]), s[:, 1] + 1], 1)

    cost = lambda s, a: torch.where(s[:, 1] == 1, a[:, 0], -2 * s[:, 0])
    assert run_cem(cost, dynamics, 2)[0] > 0.9
    assert run_cem(cost, dynamics, 2, discount=0.25)[0] < -0.9


def test_terminal_cost_is_discounted_and_skipped_after_termination():
    """Each unit of action costs its step's weight and earns 3 where the rollout ends (weight discount**2): worth it
    undiscounted; with discount 0.5 the first step (1 vs 0.75) is not, the second (0.5 vs 0.75) is. With
    termination past 1.5, a rollout that crosses earns nothing at the end: it stops at 1.5."""
    dynamics = lambda s, a: s + torch.cat([a, a], 1)
    cost, end = (lambda s, a: a[:, 0]), (lambda s: -3 * s[:, 0])
    assert run_cem(cost, dynamics, 2, terminal_cost=end).tolist() == pytest.approx([1, 1], abs=0.05)
    assert run_cem(cost, dynamics, 2, terminal_cost=end, discount=0.5).tolist() == pytest.approx([-1, 1], abs=0.05)
    plan = run_cem(lambda s, a: 0 * s[:, 0], dynamics, 2, terminal_cost=lambda s: -s[:, 0],
                   terminated=lambda s: s[:, 0] > 1.5)
    assert float(plan.sum()) == pytest.approx(1.5, abs=0.1)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_shared_history_is_appended_once_per_step(device):
    env = envpool.make("CartPole-v1", env_type="gymnasium", num_envs=3, seed=0)
    history = HistoryBuffer(3, 50, 1, ("action",), device=device)
    src = EnvPoolSource(env, device=device, history=history)
    planner = Planner(PlanConfig(4, 2, history_len=2), RecordingSolver(4, 1), 3, 1, history=history)
    step = src.reset()
    with pytest.raises(ValueError, match=r"info: expected None: this planner reads the history it was given"):
        planner.act(step.info, step.env_ids, step.first)
    for t in range(5):
        a = planner.act(None, step.env_ids, step.first)
        assert history.num_strided() == [t + 1] * 3  # the source's append only
        step = src.step(np.zeros(3, np.int32))
    assert a.shape == (3, 1) and planner.solver.calls[-1][1]["observation"] == (3, 2, 4)


@pytest.mark.parametrize(("kw", "error", "message"), [
    ({"history": {}}, TypeError, "history: expected a gpubuf.HistoryBuffer, got dict"),
    ({"history": HistoryBuffer(3, 5, device="cpu")}, ValueError,
     r"history: expected n_envs=2 \(the planner's\), got a HistoryBuffer with n_envs=3"),
    ({"history": HistoryBuffer(2, 5, 2, device="cpu")}, ValueError,
     r"history: expected action_block=1 \(config.action_block\), got a HistoryBuffer with action_block=2"),
    ({"history": HistoryBuffer(2, 2, device="cpu")}, ValueError,
     r"history: expected max_len >= 3 .* got a HistoryBuffer with max_len=2"),
    ({"history": HistoryBuffer(2, 3, device="cpu"), "device": "meta"}, ValueError,
     r"device: expected the history's device \(cpu\) or None, got 'meta'"),
    ({"solver": CEMSolver(cartpole_dynamics, cartpole_cost, 5)}, ValueError,
     r"solver: its horizon \(5\) differs from config.horizon \(4\); state it once"),
    ({"solver": CEMSolver(cartpole_dynamics, cartpole_cost, 4, 2)}, ValueError,
     r"solver: its action_dim \(2\) differs from action_block \* action_dim \(1\)"),
])
def test_planner_rejects_mismatched_history_and_solver(kw, error, message):
    solver = kw.pop("solver", RecordingSolver(4, 1))
    with pytest.raises(error, match=message):
        Planner(PlanConfig(4, 2, history_len=3), solver, n_envs=2, action_dim=1, **kw)


def test_a_solver_stating_the_same_horizon_is_accepted():
    planner = Planner(PlanConfig(4, 2), CEMSolver(cartpole_dynamics, cartpole_cost, 4, 1), n_envs=2, action_dim=1)
    assert planner.act({"observation": torch.zeros(2, 1, 4), "action": torch.zeros(2, 1, 1)}).shape == (2, 1)


def test_planner_with_its_own_history_needs_info():
    planner = Planner(PlanConfig(1, 1), RecordingSolver(1, 1), n_envs=2, action_dim=1)
    with pytest.raises(ValueError, match=r"info: expected the step's info dict .*, got None"):
        planner.act(None)


def test_planner_over_an_empty_shared_history_says_who_must_append():
    planner = Planner(PlanConfig(1, 1), RecordingSolver(1, 1), 2, 1, history=HistoryBuffer(2, 1, device="cpu"))
    with pytest.raises(ValueError, match=r"history: envs \[0, 1\] hold no entry; the history's owner must append"):
        planner.act(None)


@pytest.mark.parametrize(("kw", "error", "message"), [
    ({"discount": 0.0}, ValueError, "discount: expected a finite number > 0, got 0.0"),
    ({"discount": 1.5}, ValueError, r"discount: expected a number in \(0, 1\], got 1.5"),
    ({"terminated": 3}, TypeError, "terminated: expected a callable, got int"),
    ({"terminal_cost": 1.0}, TypeError, "terminal_cost: expected a callable, got float"),
    ({"encode": "last"}, TypeError, "encode: expected a callable, got str"),
    ({"dynamics": None}, TypeError, "dynamics: expected a callable, got NoneType"),
    ({"cost": None}, TypeError, "cost: expected a callable, got NoneType"),
    ({"horizon": 0}, ValueError, "horizon: expected a positive int, got 0"),
    ({"action_dim": 1.0}, ValueError, "action_dim: expected a positive int, got 1.0"),
])
def test_cem_rejects_bad_functions_and_sizes(kw, error, message):
    args = {"dynamics": cartpole_dynamics, "cost": cartpole_cost, **kw}
    with pytest.raises(error, match=message):
        CEMSolver(**args)


@pytest.mark.parametrize(("kw", "call", "message"), [
    ({}, {}, r"horizon: a CEMSolver called without init \(outside a Planner\) needs horizon= and action_dim="),
    ({}, {"init": torch.zeros(2, 3)}, r"init: expected float \(R=2, horizon, action_dim\), got torch.float32 \(2, 3\)"),
    ({}, {"init": torch.zeros(3, 3, 1)}, r"init: expected float \(R=2, horizon, action_dim\)"),
    ({"horizon": 4}, {"init": torch.zeros(2, 3, 1)}, r"init: expected horizon 4 \(the solver's\), got 3"),
    ({"cost": lambda s, a: s}, {"init": torch.zeros(2, 3, 1)}, r"cost: expected shape \(128,\), got \(128, 4\)"),
    ({"terminal_cost": lambda s: s[:, :1]}, {"init": torch.zeros(2, 3, 1)},
     r"terminal_cost: expected shape \(128,\), got \(128, 1\)"),
    ({"terminated": lambda s: s[:, 0]}, {"init": torch.zeros(2, 3, 1)},
     r"terminated: expected a bool tensor of shape \(128,\), got torch.float32 \(128,\)"),
])
def test_cem_rejects_bad_calls_and_model_outputs(kw, call, message):
    solver = CEMSolver(**{"dynamics": cartpole_dynamics, "cost": cartpole_cost, **kw})
    with pytest.raises(ValueError, match=message):
        solver({"observation": torch.zeros(2, 1, 4)}, [0, 1], **call)


# ------------------------------------------------------------------ non-finite rollouts, failed first act


def test_cem_ranks_non_finite_returns_last():
    """Candidates pushing right (a > 0) roll out -inf (as a number, the best) or NaN: the elites are the finite ones
    (a <= 0), whose best is a = -1."""
    cost = lambda s, a: torch.where(a[:, 0] > 0.5, float("nan"), torch.where(a[:, 0] > 0, -torch.inf, a[:, 0]))
    solver = CEMSolver(lambda s, a: s, cost, horizon=1, action_dim=1, num_samples=64, num_elites=8, iterations=4)
    plan = solver({"observation": torch.zeros(2, 1, 1)}, [0, 1])
    assert plan.isfinite().all() and bool((plan <= 0).all())
    torch.testing.assert_close(plan, torch.full((2, 1, 1), -1.0), atol=0.1, rtol=0)  # the best finite action


@pytest.mark.parametrize(("kw", "message"), [
    ({"dynamics": lambda s, a: s * float("nan")}, r"dynamics: expected finite values, got NaN/inf in the next state "
                                                  r"at step 0 from .*<lambda>"),
    ({"cost": lambda s, a: s[:, 0] + float("inf")}, r"cost: expected finite values, got NaN/inf in the cost at step 0"),
    ({"terminal_cost": lambda s: s[:, 0] * float("nan")}, r"terminal_cost: expected finite values"),
    ({"encode": lambda h: h["observation"][:, -1] * float("nan")}, r"encode: expected finite values"),
])
def test_cem_raises_naming_the_model_output_when_every_candidate_is_non_finite(kw, message):
    args = {"dynamics": lambda s, a: s + a, "cost": lambda s, a: s[:, 0] ** 2, **kw}
    solver = CEMSolver(**args, horizon=2, action_dim=1, num_samples=16, num_elites=4)
    with pytest.raises(ValueError, match=message):
        solver({"observation": torch.zeros(2, 1, 1)}, [3, 5])


def test_cem_names_the_envs_whose_rollouts_are_all_non_finite():
    cost = lambda s, a: torch.where(s[:, 0] > 0, float("nan"), s[:, 0] ** 2)  # env 7 starts at 1: all NaN
    solver = CEMSolver(lambda s, a: s, cost, horizon=2, action_dim=1, num_samples=16, num_elites=4)
    state = {"observation": torch.tensor([[[0.0]], [[1.0]]])}
    with pytest.raises(ValueError, match=r"cost: expected finite values, .* every one of the 16 candidate returns of "
                                         r"envs \[7\] is non-finite"):
        solver(state, [2, 7])


def test_a_planner_over_a_nan_model_raises_and_is_left_as_before(device):
    solver = CEMSolver(lambda s, a: s, lambda s, a: s[:, 0] * float("nan"), num_samples=8, num_elites=2)
    planner = Planner(PlanConfig(2, 1), solver, n_envs=2, action_dim=1, device=device)
    with pytest.raises(ValueError, match="cost: expected finite values"):
        planner.act(info(2, 0))
    assert planner.history.keys == () and planner.history.num_strided() == [0, 0]


@pytest.mark.parametrize("how", ["raise", "shape"])
def test_a_failed_first_act_fixes_no_key_shape_or_dtype(how, device):
    """The first act() fails after its append: the history forgets the keys, shapes and dtypes it fixed, so a retry
    with other ones (which a fresh planner accepts) succeeds and gives what a fresh planner gives."""
    cfg = PlanConfig(2, 1, history_len=2)
    flaky = Planner(cfg, FlakySolver(2, 1, fail_on={1}, how=how), n_envs=2, action_dim=1, device=device)
    with pytest.raises((RuntimeError, ValueError)):
        flaky.act({"pixels": torch.zeros(2, 1, 3, dtype=torch.uint8), "action": torch.zeros(2, 1, 1)})
    assert flaky.history.keys == () and flaky.history.nbytes == 0 and flaky.history.num_strided() == [0, 0]
    assert flaky.replanned.tolist() == []
    fresh = Planner(cfg, RecordingSolver(2, 1), n_envs=2, action_dim=1, device=device)
    step = {"observation": torch.ones(2, 1, 4, dtype=torch.float64), "action": torch.zeros(2, 1, 1)}
    want = fresh.act(step)
    flaky.solver.calls.clear()
    assert torch.equal(flaky.act(step), want)
    assert flaky.history.keys == ("observation", "action")
    assert flaky.history.get(1)["observation"].dtype == torch.float64


# ------------------------------------------------------------------ non-finite model states under a finite cost


def nan_past_one(s, a):
    """x' = x + a, NaN once |x'| > 1 (a model leaving its domain)."""
    x = s + a
    return torch.where(x.abs() > 1, float("nan"), x)


@pytest.mark.parametrize(("cost", "terminated"), [
    (lambda s, a: torch.where(s[:, 0].abs() > 0.2, 1.0, 0.0), None),  # a threshold: NaN > 0.2 is False
    (lambda s, a: torch.nan_to_num(s[:, 0]) ** 2, None),
    (lambda s, a: a[:, 0] ** 2, lambda s: s[:, 0] > 5),  # action-only cost, never terminated by NaN
], ids=["threshold", "nan_to_num", "action_only"])
def test_cem_raises_naming_dynamics_when_every_rollout_passes_a_nan_state(cost, terminated):
    """The dynamics go NaN at step 0 for every candidate; the cost hides it (finite returns): the call still raises."""
    solver = CEMSolver(lambda s, a: s * float("nan"), cost, horizon=2, action_dim=1, num_samples=16, num_elites=4,
                       terminated=terminated)
    with pytest.raises(ValueError, match=r"dynamics: expected finite values, got NaN/inf in the next state at step 0 "
                                         r"from .*<lambda>, so every one of the 16 candidate returns of envs \[3, 5\]"):
        solver({"observation": torch.zeros(2, 1, 1)}, [3, 5])


@pytest.mark.parametrize(("cost", "terminated", "best"), [
    (lambda s, a: torch.where(s[:, 0].abs() <= 1, s[:, 0] ** 2, -1.0), None, -0.5),  # NaN <= 1 is False: cost -1
    (lambda s, a: -torch.nan_to_num(s[:, 0], nan=100.0), None, 0.5),  # NaN costs -100, finite at least -1
    (lambda s, a: -a[:, 0], lambda s: s[:, 0] > 5, 0.5),  # pushing hardest looks best, NaN never terminates
], ids=["threshold", "nan_to_num", "action_only"])
def test_cem_plans_from_the_rollouts_whose_states_stay_finite(cost, terminated, best):
    """Starting at 0.5, actions above 0.5 send the state to NaN at step 0. The cost rates those rollouts best, but
    the plan is the best of the finite ones (a <= 0.5)."""
    solver = CEMSolver(nan_past_one, cost, horizon=1, action_dim=1, num_samples=64, num_elites=8, iterations=4,
                       terminated=terminated)
    plan = solver({"observation": torch.full((2, 1, 1), 0.5)}, [0, 1])
    assert plan.isfinite().all() and bool((plan <= 0.5).all())
    torch.testing.assert_close(plan, torch.full((2, 1, 1), best), atol=0.1, rtol=0)


def test_a_nan_state_after_termination_is_not_counted():
    """A rollout terminated at step 0 may go NaN afterwards: its states are never used, so it is planned with."""
    dynamics = lambda s, a: torch.where(s > 0, float("nan"), s + 1)  # 0 -> 1 (terminal) -> NaN
    solver = CEMSolver(dynamics, lambda s, a: a[:, 0] ** 2, horizon=3, action_dim=1, num_samples=16, num_elites=4,
                       terminated=lambda s: s[:, 0] > 0.5)
    assert solver({"observation": torch.zeros(2, 1, 1)}, [0, 1]).isfinite().all()


def test_a_nan_terminal_state_is_counted():
    """The step into a terminal state is part of the rollout: a NaN there counts, even if terminated says True."""
    solver = CEMSolver(lambda s, a: s * float("nan"), lambda s, a: a[:, 0] ** 2, horizon=2, action_dim=1,
                       num_samples=16, num_elites=4, terminated=lambda s: s[:, 0].isnan())
    with pytest.raises(ValueError, match=r"dynamics: expected finite values, got NaN/inf in the next state at step 0"):
        solver({"observation": torch.zeros(2, 1, 1)}, [0, 1])


def test_a_planner_fetches_only_the_keys_its_solver_reads(device):
    solver = RecordingSolver(4, 1)
    solver.history_keys = ("observation",)
    planner = Planner(PlanConfig(horizon=4, receding_horizon=2, history_len=3), solver, n_envs=2, action_dim=1,
                      device=device)
    for t in range(3):
        planner.act({**info(2, t), "extra": torch.zeros(2, 1, 5)})
    assert all(set(shapes) == {"observation"} for _, shapes in solver.calls)
    cem = CEMSolver(cartpole_dynamics, cartpole_cost, state_key="observation")
    assert cem.history_keys == ("observation",)
    assert CEMSolver(cartpole_dynamics, cartpole_cost, encode=lambda h: h["x"][:, -1]).history_keys is None
