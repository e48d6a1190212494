"""Receding-horizon control for batched MPC: per-env action queues on the device, re-planned per env.

:class:`Planner` keeps a :class:`~gpubuf.HistoryBuffer` and, for every env, a queue of env actions. Each
:meth:`Planner.act` flushes the histories (and queues) of envs on a reset frame, appends the step, asks
the solver for a new plan only for the envs whose queue ran empty, and pops one action per env.
:class:`CEMSolver` is a cross-entropy-method solver over user dynamics and cost functions;
:func:`cartpole_dynamics` and :func:`cartpole_cost` are CartPole-v1's own equations, for the demo and tests.
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from gpubuf.history import HistoryBuffer
from gpubuf.inputs import as_flags, as_index_array, as_tensor, finite_float, positive_int
from gpubuf.staging import Staging


@dataclass(frozen=True)
class PlanConfig:
    """Planning cadence, as in stable-worldmodel's ``PlanConfig``.

    horizon: planned steps per solve; each step is a macro-action of ``action_block`` env actions.
    receding_horizon: planned steps executed before re-planning (``<= horizon``).
    action_block: env steps per planned step (the history's stride).
    history_len: strided frames of history handed to the solver.
    """

    horizon: int
    receding_horizon: int
    action_block: int = 1
    history_len: int = 1

    def __post_init__(self):
        for name in ("horizon", "receding_horizon", "action_block", "history_len"):
            positive_int(name, getattr(self, name))
        if self.receding_horizon > self.horizon:
            raise ValueError(f"receding_horizon: expected <= horizon ({self.horizon}), got {self.receding_horizon}")


class Planner:
    """Batched receding-horizon controller over ``n_envs`` envs.

    Args:
        config: a :class:`PlanConfig`.
        solver: ``solver(history, env_ids) -> actions (len(env_ids), horizon, action_block * action_dim)``;
            ``history`` is :meth:`HistoryBuffer.get`'s dict for those envs (``action`` as blocks), with
            ``n = min(history_len, max(num_strided(env_ids)))`` frames. Its tensors are reused by the next
            re-plan of the same shape (zero allocation): copy what the solver keeps beyond its call.
        n_envs: number of envs.
        action_dim: size of one env action (``1`` for a discrete or scalar action).
        device: device of the queues and history; ``None`` -> ``cuda`` when available, else ``cpu``.

    Queues are ``(n_envs, receding_horizon * action_block, action_dim)`` on the device; how many actions
    each env has left lives on the host, so choosing who re-plans never reads the device.
    """

    def __init__(self, config: PlanConfig, solver: Callable, n_envs: int, action_dim: int, *, device=None):
        if not isinstance(config, PlanConfig):
            raise TypeError(f"config: expected a PlanConfig, got {type(config).__name__}")
        if not callable(solver):
            raise TypeError(f"solver: expected a callable solver(history, env_ids), got {type(solver).__name__}")
        self.config, self.solver = config, solver
        self.n_envs = positive_int("n_envs", n_envs)
        self.action_dim = positive_int("action_dim", action_dim)
        ab = config.action_block
        # one slot more than the solver ever reads: an act() that fails can undo its append exactly
        self.history = HistoryBuffer(self.n_envs, (config.history_len - 1) * ab + 2, ab, ("action",), device=device)
        self.device = self.history.device
        self.queue_len = config.receding_horizon * ab
        self._queue = torch.zeros(self.n_envs, self.queue_len, self.action_dim, device=self.device)
        self._left = np.zeros(self.n_envs, dtype=np.int64)  # actions left per env (host mirror)
        self._all_ids = np.arange(self.n_envs, dtype=np.int64)
        self._staging = Staging(self.device)
        self.replanned: np.ndarray = np.zeros(0, dtype=np.int64)  # envs re-planned by the last act()
        self._history_out: tuple = (None, None)  # ((n, rows), tensors) reused by get(out=) while the key holds

    def reset(self, env_ids=None) -> None:
        """Forget the listed envs' histories and plans (all envs if ``None``)."""
        ids = self._ids(env_ids)
        self.history.reset(ids)
        self._left[ids] = 0

    def act(self, info: dict, env_ids=None, first=None) -> torch.Tensor:
        """One action per listed env: ``(R, action_dim)`` on the device.

        ``info`` is one step in the stacked layout (``(R, 1, ...)`` values, ``action`` echo included),
        ``env_ids`` ``(R,)`` distinct host ints (all envs if ``None``), ``first`` ``(R,)`` host bools marking
        reset frames: those envs' histories and queues are flushed before the step is appended. Planned
        actions are queued as ``float32`` (a ``float64`` plan is rounded to it) and must be finite there.
        If anything fails (bad input, the solver raising or returning a wrong shape or non-finite actions),
        the planner is left exactly as it was before the call, so the same step can be retried.
        """
        ids = self._ids(env_ids)
        if env_ids is not None and len(np.unique(ids)) != len(ids):
            raise ValueError(f"env_ids: expected distinct envs (one action each), got {ids.tolist()}")
        if first is not None:
            first = as_flags(first, "first", ids.shape)
        mirror, left = self.history._mirror(), self._left.copy()
        try:
            if first is not None and first.any():
                self.reset(ids[first])
            self.history.append(info, env_ids=ids)
            empty = ids[self._left[ids] == 0]
            if len(empty):
                self._replan(empty)
        except BaseException:
            self.history._restore_mirror(mirror)
            self._left = left
            raise
        self.replanned = empty
        pos = self.queue_len - self._left[ids]
        index = self._staging.to_device(torch.from_numpy(np.stack([ids, pos])), "__pop__")
        self._left[ids] -= 1
        return self._queue[index[0], index[1]]

    def _replan(self, ids: np.ndarray) -> None:
        cfg = self.config
        n = min(cfg.history_len, max(self.history.num_strided(ids)))
        key, out = self._history_out
        history = self.history.get(n, ids, out=out if key == (n, len(ids)) else None)
        self._history_out = ((n, len(ids)), history)  # lockstep envs re-plan with the same shapes: no allocation
        plan = as_tensor(self.solver(history, ids), "solver")
        want = (len(ids), cfg.horizon, cfg.action_block * self.action_dim)
        if tuple(plan.shape) != want or not plan.dtype.is_floating_point:
            raise ValueError(f"solver: expected float actions of shape {want}, got {plan.dtype} {tuple(plan.shape)}")
        steps = plan[:, : cfg.receding_horizon].reshape(len(ids), self.queue_len, self.action_dim)
        steps = steps.to(self.device, self._queue.dtype)
        if not bool(torch.isfinite(steps).all()):  # one read-back per re-plan: the env needs the actions anyway
            raise ValueError(f"solver: planned actions must be finite in {self._queue.dtype}, got "
                             f"{steps[~torch.isfinite(steps)][:5].tolist()} (NaN, or beyond its range)")
        rows = self._staging.to_device(torch.from_numpy(ids), "__replan__")
        self._queue.index_copy_(0, rows, steps)
        self._left[ids] = self.queue_len

    def _ids(self, env_ids) -> np.ndarray:
        if env_ids is None:
            return self._all_ids
        return as_index_array(env_ids, "env_ids", self.n_envs)


class CEMSolver:
    """Cross-entropy method over a user model: sample action sequences, keep the elites, refit, repeat.

    Args:
        dynamics: ``dynamics(state (N, ...), action (N, action_dim)) -> next state (N, ...)``.
        cost: ``cost(state (N, ...), action (N, action_dim)) -> (N,)``, summed over the horizon.
        horizon, action_dim: the plan's shape per env (``action_dim`` includes any action block).
        encode: ``encode(history) -> state (R, ...)``; default: the last frame of ``history[state_key]``.
        num_samples, num_elites, iterations: CEM sizes.
        init_std, low, high: initial spread and action bounds.
        seed: seed of the solver's generator (an int in ``[0, 2**64)``); one generator per device, created on
            first use. Its draws are not rolled back when a model call raises: a retried solve samples anew.

    ``solver(history, env_ids) -> (len(env_ids), horizon, action_dim)``: the elites' mean after the last
    iteration. All envs and samples are rolled out together: one batched model call per horizon step.
    """

    def __init__(self, dynamics: Callable, cost: Callable, horizon: int, action_dim: int, *,
                 encode: Callable | None = None, state_key: str = "observation", num_samples: int = 64,
                 num_elites: int = 8, iterations: int = 3, init_std: float = 1.0, low: float = -1.0,
                 high: float = 1.0, seed: int = 0):
        self.dynamics, self.cost = dynamics, cost
        self.horizon = positive_int("horizon", horizon)
        self.action_dim = positive_int("action_dim", action_dim)
        self.num_samples = positive_int("num_samples", num_samples)
        self.num_elites = positive_int("num_elites", num_elites)
        self.iterations = positive_int("iterations", iterations)
        if self.num_elites > self.num_samples:
            raise ValueError(f"num_elites: expected <= num_samples ({self.num_samples}), got {self.num_elites}")
        self.init_std = finite_float("init_std", init_std, 0.0, low_open=True)
        self.low, self.high = finite_float("low", low), finite_float("high", high)
        if not self.low < self.high:
            raise ValueError(f"low, high: expected low < high, got {low} and {high}")
        self.encode = encode or (lambda history: history[state_key][:, -1])
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**64:
            raise ValueError(f"seed: expected an int in [0, 2**64), got {seed!r}")
        self.seed = int(seed)
        self._gen: dict[torch.device, torch.Generator] = {}

    def __call__(self, history: dict, env_ids) -> torch.Tensor:
        state = self.encode(history)
        R, N, K, H, A = state.shape[0], self.num_samples, self.num_elites, self.horizon, self.action_dim
        gen = self._gen.get(state.device)
        if gen is None:
            gen = self._gen[state.device] = torch.Generator(state.device).manual_seed(self.seed)
        mean = torch.zeros(R, H, A, device=state.device)
        std = torch.full((R, H, A), self.init_std, device=state.device)
        for _ in range(self.iterations):
            noise = torch.randn(R, N, H, A, generator=gen, device=state.device)
            actions = (mean[:, None] + std[:, None] * noise).clamp(self.low, self.high)  # (R, N, H, A)
            s = state.repeat_interleave(N, dim=0)  # (R*N, ...)
            total = torch.zeros(R * N, device=state.device)
            for t in range(H):
                a = actions[:, :, t].reshape(R * N, A)
                s = self.dynamics(s, a)
                total = total + self.cost(s, a)
            elite = total.view(R, N).topk(K, dim=1, largest=False).indices  # (R, K)
            elites = actions.gather(1, elite[:, :, None, None].expand(R, K, H, A))
            mean, std = elites.mean(1), elites.std(1, unbiased=False) + 1e-3
        return mean


# ---------------------------------------------------------------- a ready-made model for the CEM solver

CARTPOLE = dict(gravity=9.8, masscart=1.0, masspole=0.1, length=0.5, force_mag=10.0, tau=0.02)


def cartpole_dynamics(state: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    """CartPole-v1's Euler step: ``state (N, 4)``, ``action (N, 1)`` (push right when ``> 0``) -> ``(N, 4)``."""
    c = CARTPOLE
    x, x_dot, theta, theta_dot = state.unbind(-1)
    force = torch.where(action[:, 0] > 0, c["force_mag"], -c["force_mag"])
    total_mass, pml = c["masscart"] + c["masspole"], c["masspole"] * c["length"]
    cos, sin = torch.cos(theta), torch.sin(theta)
    temp = (force + pml * theta_dot**2 * sin) / total_mass
    theta_acc = (c["gravity"] * sin - cos * temp) / (c["length"] * (4.0 / 3.0 - c["masspole"] * cos**2 / total_mass))
    x_acc = temp - pml * theta_acc * cos / total_mass
    tau = c["tau"]
    return torch.stack([x + tau * x_dot, x_dot + tau * x_acc, theta + tau * theta_dot, theta_dot + tau * theta_acc], -1)


def cartpole_cost(state: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    """Pole angle and cart offset, squared: ``(N,)``."""
    return state[:, 2] ** 2 + 0.01 * state[:, 0] ** 2
