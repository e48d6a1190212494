"""Receding-horizon control for batched MPC: per-env action queues on the device, re-planned per
env.

:class:`Planner` reads per-env histories from a :class:`~gpubuf.HistoryBuffer`
(its own, or one it is given) and keeps, for every env, a queue of env actions and its last plan.
Each :meth:`Planner.act` flushes the queues (and an owned history) of envs on a reset frame, appends
the step to an owned history, asks the solver for a new plan only for the envs whose queue ran
empty, and pops one action per env. Solvers that take an ``init`` argument are warm-started from
each env's previous plan shifted by the executed steps. :class:`CEMSolver` is a cross-entropy-method
solver over user dynamics, cost and termination functions; :func:`cartpole_dynamics` and
:func:`cartpole_cost` are CartPole-v1's own equations, for tests and examples.
"""

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from gpubuf import ops
from gpubuf._core.inputs import as_flags, as_tensor, env_ids_or_all, finite_float, positive_int
from gpubuf._core.staging import Staging
from gpubuf.history.buffer import HistoryBuffer


@dataclass(frozen=True)
class PlanConfig:
    """Planning cadence, as in stable-worldmodel's ``PlanConfig``: the one place the horizon is
    stated.

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
            raise ValueError(f"receding_horizon: expected <= horizon ({self.horizon}), got "
                             f"{self.receding_horizon}")

    @property
    def history_steps(self) -> int:
        """Env steps a history must hold to give ``history_len`` strided frames."""
        return (self.history_len - 1) * self.action_block + 1


def takes_init(solver: Callable) -> bool:
    """Whether ``solver`` accepts an ``init`` keyword (then :class:`Planner` warm-starts it)."""
    try:
        params = inspect.signature(solver).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature
        return False
    return any(p.name == "init" or p.kind == p.VAR_KEYWORD for p in params)


class Planner:
    """Batched receding-horizon controller over ``n_envs`` envs.

    Args:
        config: a :class:`PlanConfig` (the horizon is stated there only).
        solver: ``solver(history, env_ids[, init]) -> actions (R, horizon, action_block *
            action_dim)``, ``R = len(env_ids)``; ``history`` is :meth:`HistoryBuffer.get`'s dict for
            those envs with ``n = min(history_len, max(num_strided(env_ids)))`` frames. Its tensors
            are reused by the next re-plan of the same shape (zero allocation): copy what the solver
            keeps beyond its call. A solver whose call takes an ``init`` keyword (or ``**kwargs``)
            gets the warm start ``init (R, horizon, action_block * action_dim)`` float32: each env's
            previous plan shifted by the ``receding_horizon`` steps it executed since, NaN where
            there is nothing to shift in (the tail, and every step of an env that was reset or never
            planned): the solver puts its default there. A solver with a ``horizon`` or
            ``action_dim`` attribute (not ``None``) must agree with ``config`` and ``action_dim``. A
            solver with a ``history_keys`` attribute (key names, not ``None``) gets only those keys
            of the history: the planner gathers nothing else (a :class:`CEMSolver` with the default
            ``encode`` reads ``state_key`` only).
        n_envs: number of envs.
        action_dim: size of one env action (``1`` for a discrete or scalar action).
        device: device of the queues (and of an owned history); ``None`` -> the history's device
            when ``history`` is given, else ``cuda`` when available, else ``cpu``.
        history: an existing :class:`HistoryBuffer` to read, e.g. the one an
            :class:`~gpubuf.EnvPoolSource` appends every step to. Its owner appends and flushes it:
            the planner only reads it (:meth:`act` then takes ``info=None``). It must have
            ``n_envs`` envs, stride ``config.action_block``, and hold at least
            ``config.history_steps`` entries per env. ``None``: the planner builds and appends its
            own.

    Queues are ``(n_envs, receding_horizon * action_block, action_dim)`` on the device; how many
    actions each env has left lives on the host, so choosing who re-plans never reads the device.
    """

    def __init__(self, config: PlanConfig, solver: Callable, n_envs: int, action_dim: int, *,
                 device=None,
                 history: HistoryBuffer | None = None):
        if not isinstance(config, PlanConfig):
            raise TypeError(f"config: expected a PlanConfig, got {type(config).__name__}")
        if not callable(solver):
            raise TypeError("solver: expected a callable solver(history, env_ids), got "
                            f"{type(solver).__name__}")
        self.config, self.solver = config, solver
        self.n_envs = positive_int("n_envs", n_envs)
        self.action_dim = positive_int("action_dim", action_dim)
        ab = config.action_block
        width = ab * self.action_dim
        for name, want in (("horizon", config.horizon), ("action_dim", width)):
            got = getattr(solver, name, None)
            if got is not None and got != want:
                source = "config.horizon" if name == "horizon" else "action_block * action_dim"
                raise ValueError(f"solver: its {name} ({got}) differs from {source} ({want}); "
                                 "state it once, in the "
                                 f"PlanConfig and the Planner (leave the solver's {name} unset)")
        self.owns_history = history is None
        if history is None:
            # one slot more than the solver ever reads: an act() that fails can undo its append
            # exactly
            history = HistoryBuffer(self.n_envs, config.history_steps + 1, ab, ("action",),
                                    device=device)
        else:
            check_history(history, config, self.n_envs, device)
        self.history = history
        self.device = history.device
        self.queue_len = config.receding_horizon * ab
        self._queue = torch.zeros(self.n_envs, self.queue_len, self.action_dim, device=self.device)
        self._left = np.zeros(self.n_envs, dtype=np.int64)  # actions left per env (host mirror)
        self._warm = takes_init(solver)
        # last plan per env
        self._plans = torch.zeros(self.n_envs, config.horizon, width, device=self.device)
        # host: whether _plans holds a plan to shift
        self._has_plan = np.zeros(self.n_envs, dtype=bool)
        self._all_ids = np.arange(self.n_envs, dtype=np.int64)
        self._staging = Staging(self.device)
        # envs re-planned by the last act()
        self.replanned: np.ndarray = np.zeros(0, dtype=np.int64)
        # ((n, rows), tensors) reused by get(out=) while the key holds
        self._history_out: tuple = (None, None)

    def reset(self, env_ids=None) -> None:
        """Forget the listed envs' plans (and their histories, if owned; all envs if ``None``)."""
        ids = env_ids_or_all(env_ids, self._all_ids)
        if self.owns_history:
            self.history.reset(ids)
        self._left[ids] = 0
        self._has_plan[ids] = False

    def act(self, info: dict | None = None, env_ids=None, first=None) -> torch.Tensor:
        """One action per listed env: ``(R, action_dim)`` on the device.

        ``info`` is one step in the stacked layout
        (``(R, 1, ...)`` values, ``action`` echo included), appended to the planner's own history;
        ``None`` when the planner reads a given ``history`` (its owner appends). ``env_ids``
        ``(R,)`` distinct host ints (all envs if ``None``), ``first`` ``(R,)`` host bools marking
        reset frames: those envs' queues and plans (and owned histories) are flushed first. Planned
        actions are queued as ``float32`` (a ``float64`` plan is rounded to it) and must be finite
        there. If anything fails (bad input, the solver raising or returning a wrong shape or
        non-finite actions), the planner and its owned history are left exactly as they were before
        the call (a failed first call fixes no key, shape or dtype of the history), so the same
        step, or another one, can be retried.
        """
        if self.owns_history and info is None:
            raise ValueError("info: expected the step's info dict (this planner appends each step "
                             "to its own "
                             "history), got None")
        if not self.owns_history and info is not None:
            raise ValueError("info: expected None: this planner reads the history it was given "
                             "(history=), which its owner appends to; appending here too would "
                             "store every step twice")
        ids = env_ids_or_all(env_ids, self._all_ids)
        if env_ids is not None and len(np.unique(ids)) != len(ids):
            raise ValueError("env_ids: expected distinct envs (one action each), got "
                             f"{ids.tolist()}")
        if first is not None:
            first = as_flags(first, "first", ids.shape)
        mark = self.history.mark() if self.owns_history else None
        left, has_plan, history_out = self._left.copy(), self._has_plan.copy(), self._history_out
        try:
            if first is not None and first.any():
                self.reset(ids[first])
            if self.owns_history:
                self.history.append(info, env_ids=ids)
            empty = ids[self._left[ids] == 0]
            if len(empty):
                self._replan(empty)
        except BaseException:
            if mark is not None:
                self.history.rollback(mark)
            self._left, self._has_plan, self._history_out = left, has_plan, history_out
            raise
        self.replanned = empty
        pos = self.queue_len - self._left[ids]
        index = self._staging.to_device(torch.from_numpy(np.stack([ids, pos])), "__pop__")
        self._left[ids] -= 1
        return self._queue[index[0], index[1]]

    def _replan(self, ids: np.ndarray) -> None:
        cfg = self.config
        strided = self.history.num_strided(ids)
        if min(strided) == 0:
            raise ValueError(f"history: envs {ids[np.asarray(strided) == 0][:5].tolist()} hold no "
                             "entry; the "
                             "history's owner must append the step before act()")
        n = min(cfg.history_len, max(strided))
        key, out = self._history_out
        history = self.history.get(n, ids, out=out if key == (n, len(ids)) else None,
                                   keys=getattr(self.solver, "history_keys", None))
        # lockstep envs re-plan with the same shapes: no allocation
        self._history_out = ((n, len(ids)), history)
        rows = self._staging.to_device(torch.from_numpy(ids), "__replan__")
        if self._warm:
            plan = self.solver(history, ids, init=self._warm_start(ids, rows))
        else:
            plan = self.solver(history, ids)
        plan = as_tensor(plan, "solver")
        want = (len(ids), cfg.horizon, cfg.action_block * self.action_dim)
        if tuple(plan.shape) != want or not plan.dtype.is_floating_point:
            raise ValueError(f"solver: expected float actions of shape {want}, got {plan.dtype} "
                             f"{tuple(plan.shape)}")
        plan = plan.to(self.device, self._queue.dtype)
        steps = plan[:, : cfg.receding_horizon].reshape(len(ids), self.queue_len, self.action_dim)
        # one read-back per re-plan: the env needs the actions anyway
        if not bool(torch.isfinite(steps).all()):
            raise ValueError(f"solver: planned actions must be finite in {self._queue.dtype}, got "
                             f"{steps[~torch.isfinite(steps)][:5].tolist()} (NaN, or beyond its "
                             "range)")
        self._queue.index_copy_(0, rows, steps)
        self._plans.index_copy_(0, rows, plan)
        self._left[ids] = self.queue_len
        self._has_plan[ids] = True

    def _warm_start(self, ids: np.ndarray, rows: torch.Tensor) -> torch.Tensor:
        """``(R, horizon, width)``: the previous plans shifted by ``receding_horizon`` steps, NaN
        elsewhere."""
        rh = self.config.receding_horizon
        init = torch.full((len(ids), *self._plans.shape[1:]), float("nan"), device=self.device)
        warm = np.flatnonzero(self._has_plan[ids])
        if len(warm) and rh < self.config.horizon:
            if len(warm) == len(ids):
                init[:, :-rh] = self._plans[rows, rh:]
            else:
                sel = self._staging.to_device(torch.from_numpy(warm), "__warm__")
                init[sel, :-rh] = self._plans[rows[sel], rh:]
        return init


def check_history(history, config: PlanConfig, n_envs: int, device) -> None:
    """Raise unless ``history`` can serve a :class:`Planner` of ``config`` over ``n_envs`` envs on
    ``device``."""
    if not isinstance(history, HistoryBuffer):
        raise TypeError(f"history: expected a gpubuf.HistoryBuffer, got {type(history).__name__}")
    if history.n_envs != n_envs:
        raise ValueError(f"history: expected n_envs={n_envs} (the planner's), got a HistoryBuffer "
                         "with "
                         f"n_envs={history.n_envs}")
    if history.action_block != config.action_block:
        raise ValueError(f"history: expected action_block={config.action_block} "
                         "(config.action_block), got a "
                         f"HistoryBuffer with action_block={history.action_block}")
    if history.max_len < config.history_steps:
        raise ValueError(f"history: expected max_len >= {config.history_steps} ((history_len - 1) "
                         "* action_block "
                         f"+ 1 env steps), got a HistoryBuffer with max_len={history.max_len}")
    if device is None:
        return
    try:
        same = ops.resolve_device(device) == history.device
    except ValueError:  # names no usable device
        same = False
    if not same:
        raise ValueError(f"device: expected the history's device ({history.device}) or None, got "
                         f"{device!r}")


class CEMSolver:
    """Cross-entropy method over a user model: sample action sequences, keep the elites, refit,
    repeat.

    Args:
        dynamics: ``dynamics(state (N, ...), action (N, action_dim)) -> next state (N, ...)``.
        cost: ``cost(next_state (N, ...), action (N, action_dim)) -> (N,)``: the cost of taking
            ``action``, evaluated on the state **after** the step. A rollout's return is ``sum_t
            discount**t * cost_t`` over the horizon, minimised.
        horizon, action_dim: the plan's shape per env (``action_dim`` includes any action block).
            Leave them ``None`` under a :class:`Planner`, which hands them over through ``init``;
            they are needed only to call the solver without ``init``.
        terminated: ``terminated(next_state (N, ...)) -> (N,) bool``, or ``None`` (nothing
            terminates). The step into a terminal state still pays its cost; nothing after it does
            (the return is frozen).
        terminal_cost: ``terminal_cost(last_state (N, ...)) -> (N,)``, or ``None``: the cost of
            where a rollout ends (e.g. minus a learned value), added with weight
            ``discount**horizon`` to rollouts that did not terminate.
        discount: factor in ``(0, 1]`` on each later step's cost.
        encode: ``encode(history) -> state (R, ...)``; default: the last frame of
            ``history[state_key]``.
        num_samples, num_elites, iterations: CEM sizes.
        init_std, low, high: initial spread and action bounds; the default mean is
            ``(low + high) / 2``.
        seed: seed of the solver's generator (an int in ``[0, 2**64)``); one generator per device,
            created on first use. Its draws are not rolled back when a model call raises: a retried
            solve samples anew.

    ``solver(history, env_ids, init=None) -> (R, horizon, action_dim)``: the elites' mean after the
    last iteration. ``init (R, horizon, action_dim)`` is the first iteration's mean (warm start),
    NaN entries taking the default mean; the spread always starts at ``init_std``. All envs and
    samples are rolled out together, one batched model call per horizon step, under
    ``torch.no_grad()``.

    Non-finite rollouts rank last. A rollout is non-finite when its return is
    (NaN or inf, from the model or from an overflowing sum) or when any of its model states is: the
    encoded state, or a ``dynamics`` output up to and including the step into a terminal state
    (states after termination are never used), even if the cost maps that state to a finite number
    (a threshold, ``nan_to_num``, an action-only cost). An env's elites are its ``num_elites``
    lowest finite rollouts, or all of its finite ones when fewer are finite. When every candidate of
    an env is non-finite in some iteration, the call raises ``ValueError`` naming those envs and the
    model output that first went non-finite (``encode``, ``dynamics``, ``cost``, ``terminal_cost``):
    nothing is planned through NaN. The states are checked on the device into a per-rollout flag
    (per step: ``isfinite`` over the state, a per-row ``all``, one ``(N,)`` AND, plus a NOT and an
    OR with ``terminated``), folded into the returns, so the call still reads back one ``(R,)``
    flag.
    """

    def __init__(self, dynamics: Callable, cost: Callable, horizon: int | None = None,
                 action_dim: int | None = None,
                 *, terminated: Callable | None = None, terminal_cost: Callable | None = None,
                 discount: float = 1.0,
                 encode: Callable | None = None,
                 state_key: str = "observation", num_samples: int = 64, num_elites: int = 8,
                 iterations: int = 3,
                 init_std: float = 1.0, low: float = -1.0, high: float = 1.0, seed: int = 0):
        for name, fn in (("dynamics", dynamics), ("cost", cost), ("terminated", terminated),
                         ("terminal_cost", terminal_cost), ("encode", encode)):
            required = name in ("dynamics", "cost")
            if (fn is not None or required) and not callable(fn):
                raise TypeError(f"{name}: expected a callable, got {type(fn).__name__}")
        self.dynamics, self.cost = dynamics, cost
        self.terminated, self.terminal_cost = terminated, terminal_cost
        self.horizon = None if horizon is None else positive_int("horizon", horizon)
        self.action_dim = None if action_dim is None else positive_int("action_dim", action_dim)
        self.num_samples = positive_int("num_samples", num_samples)
        self.num_elites = positive_int("num_elites", num_elites)
        self.iterations = positive_int("iterations", iterations)
        if self.num_elites > self.num_samples:
            raise ValueError(f"num_elites: expected <= num_samples ({self.num_samples}), got "
                             f"{self.num_elites}")
        self.discount = finite_float("discount", discount, 0.0, low_open=True)
        if self.discount > 1:
            raise ValueError(f"discount: expected a number in (0, 1], got {discount!r}")
        self.init_std = finite_float("init_std", init_std, 0.0, low_open=True)
        self.low, self.high = finite_float("low", low), finite_float("high", high)
        if not self.low < self.high:
            raise ValueError(f"low, high: expected low < high, got {low} and {high}")
        self.encode = encode or (lambda history: history[state_key][:, -1])
        # the history keys a solve reads (a Planner fetches only these); None: a custom encode
        self.history_keys = (state_key,) if encode is None else None
        if isinstance(seed, bool) or not isinstance(seed,
                                                    (int, np.integer)) or not 0 <= seed < 2**64:
            raise ValueError(f"seed: expected an int in [0, 2**64), got {seed!r}")
        self.seed = int(seed)
        self._gen: dict[torch.device, torch.Generator] = {}

    @torch.no_grad()
    def __call__(self, history: dict, env_ids, init: torch.Tensor | None = None) -> torch.Tensor:
        state = self.encode(history)
        R, N, K = state.shape[0], self.num_samples, self.num_elites
        mean = self._initial_mean(R, init, state.device)
        H, A = mean.shape[1:]
        gen = self._gen.get(state.device)
        if gen is None:
            gen = self._gen[state.device] = torch.Generator(state.device).manual_seed(self.seed)
        std = torch.full((R, H, A), self.init_std, device=state.device)
        # envs with no finite return, any iteration
        failed = torch.zeros(R, dtype=torch.bool, device=state.device)
        for _ in range(self.iterations):
            noise = torch.randn(R, N, H, A, generator=gen, device=state.device)
            # (R, N, H, A)
            actions = (mean[:, None] + std[:, None] * noise).clamp(self.low, self.high)
            total = self._returns(state.repeat_interleave(N, dim=0),
                                  actions.view(R * N, H, A)).view(R, N)
            finite = total.isfinite()
            # (R, K)
            elite = torch.where(finite, total, torch.inf).topk(K, dim=1, largest=False).indices
            elites = actions.gather(1, elite[:, :, None, None].expand(R, K, H, A))
            keep = finite.gather(1, elite)  # (R, K): elites with a finite return
            count = keep.sum(1)  # (R,)
            failed |= count == 0
            # (R, K, 1, 1): weight 1/count on finite elites
            w = (keep / count.clamp(min=1)[:, None])[:, :, None, None]
            new_mean = (w * elites).sum(1)
            new_std = (w * (elites - new_mean[:, None]) ** 2).sum(1).sqrt() + 1e-3
            # no finite elite: keep the old distribution (the call raises)
            stuck = (count == 0)[:, None, None]
            mean, std = torch.where(stuck, mean, new_mean), torch.where(stuck, std, new_std)
        if bool(failed.any()):  # the one read-back: never plan through NaN
            raise ValueError(self._non_finite_message(state, actions, failed, env_ids))
        return mean

    def _non_finite_message(self, state: torch.Tensor, actions: torch.Tensor, failed: torch.Tensor,
                            env_ids) -> str:
        """Names the model output that first went non-finite for the envs with no finite return:
        their last iteration's candidates ``actions (R, N, H, A)`` are rolled out again from
        ``state (R, ...)``, checking each output."""
        rows = torch.nonzero(failed).flatten()
        R, N, H, A = actions.shape
        ids = np.asarray(env_ids).reshape(-1)
        envs = (ids[rows.cpu().numpy()] if len(ids) == R else rows.cpu().numpy())[:5].tolist()
        s = state[rows].repeat_interleave(N, dim=0)
        a = actions[rows].reshape(-1, H, A)
        # outputs after termination don't count
        alive = torch.ones(len(a), dtype=torch.bool, device=a.device)
        where = None
        if not bool(_finite_rows(s).all()):
            where = "encode", self.encode, "the planning state encoded from the history"
        for t in range(H):
            if where is not None:
                break
            s = self.dynamics(s, a[:, t])
            if not bool((_finite_rows(s) | ~alive).all()):
                where = "dynamics", self.dynamics, f"the next state at step {t}"
            elif not bool((self.cost(s, a[:, t]).isfinite() | ~alive).all()):
                where = "cost", self.cost, f"the cost at step {t}"
            elif self.terminated is not None:
                alive = alive & ~self.terminated(s)
        if (where is None and self.terminal_cost is not None
                and not bool((self.terminal_cost(s).isfinite() | ~alive).all())):
            where = "terminal_cost", self.terminal_cost, "the cost of the last state"
        if where is None:
            return (f"cost: expected a finite return for at least one of the {N} candidates of "
                    "every env, got only "
                    f"NaN/inf returns for envs {envs} (each output was finite when rolled out "
                    "again: the discounted "
                    f"sum overflows, or the model is random)")
        name, fn, what = where
        return (f"{name}: expected finite values, got NaN/inf in {what} from {_name(fn)}, so every "
                f"one of the {N} "
                f"candidate returns of envs {envs} is non-finite; nothing to plan with")

    def _initial_mean(self, R: int, init, device) -> torch.Tensor:
        """``(R, H, A)``: ``init`` with NaN replaced by the default mean, or the default mean
        everywhere."""
        middle = (self.low + self.high) / 2
        if init is None:
            if self.horizon is None or self.action_dim is None:
                raise ValueError("horizon: a CEMSolver called without init (outside a Planner) "
                                 "needs horizon= and "
                                 "action_dim=")
            return torch.full((R, self.horizon, self.action_dim), middle, device=device)
        init = as_tensor(init, "init")
        if init.dim() != 3 or init.shape[0] != R or not init.dtype.is_floating_point:
            raise ValueError(f"init: expected float (R={R}, horizon, action_dim), got {init.dtype} "
                             f"{tuple(init.shape)}")
        for name, got in (("horizon", init.shape[1]), ("action_dim", init.shape[2])):
            if getattr(self, name) not in (None, got):
                raise ValueError(f"init: expected {name} {getattr(self, name)} (the solver's), got "
                                 f"{got}")
        init = init.to(device, torch.float32)
        return torch.where(init.isnan(), middle, init)

    @staticmethod
    def _checked(cost: torch.Tensor, name: str, N: int) -> torch.Tensor:
        if tuple(cost.shape) != (N,):
            raise ValueError(f"{name}: expected shape ({N},), got {tuple(cost.shape)}")
        return cost

    def _returns(self, s: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """``(N,)`` discounted cost of each rollout of ``actions (N, H, A)`` from ``s (N, ...)``,
        frozen at termination, plus the discounted terminal cost of the rollouts still alive at the
        end."""
        N, H = actions.shape[:2]
        total = torch.zeros(N, device=s.device)
        alive = None if self.terminated is None else torch.ones(N, dtype=torch.bool,
                                                                device=s.device)
        # (N,): every model state so far (up to termination) finite; no read-back here
        sane = _finite_rows(s)
        weight = 1.0
        for t in range(H):
            a = actions[:, t]
            s = self.dynamics(s, a)
            fine = _finite_rows(s)
            # a state past termination is never used
            sane &= fine if alive is None else fine | ~alive
            cost = self._checked(self.cost(s, a), "cost", N)
            total = total + weight * (cost if alive is None else torch.where(alive, cost, 0.0))
            if alive is not None:
                done = self.terminated(s)
                if tuple(done.shape) != (N,) or done.dtype != torch.bool:
                    raise ValueError(f"terminated: expected a bool tensor of shape ({N},), got "
                                     f"{done.dtype} "
                                     f"{tuple(done.shape)}")
                alive = alive & ~done
            weight *= self.discount
        if self.terminal_cost is not None:
            end = self._checked(self.terminal_cost(s), "terminal_cost", N)
            total = total + weight * (end if alive is None else torch.where(alive, end, 0.0))
        # a rollout through a non-finite state is a NaN return
        return torch.where(sane, total, torch.nan)


def _finite_rows(x: torch.Tensor) -> torch.Tensor:
    """``(N,)`` bool: whether every entry of each row of ``x (N, ...)`` is finite."""
    fine = x.isfinite()
    return fine.flatten(1).all(1) if fine.dim() > 1 else fine


def _name(fn) -> str:
    """A model function's qualified name (for messages)."""
    return getattr(fn, "__qualname__", None) or type(fn).__name__


# ---------------------------------------------------------------- a ready-made model for the CEM
# solver

CARTPOLE = dict(gravity=9.8, masscart=1.0, masspole=0.1, length=0.5, force_mag=10.0, tau=0.02)


def cartpole_dynamics(state: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    """CartPole-v1's Euler step: ``state (N, 4)``, ``action (N, 1)`` (push right when ``> 0``) ->
    ``(N, 4)``."""
    c = CARTPOLE
    x, x_dot, theta, theta_dot = state.unbind(-1)
    force = torch.where(action[:, 0] > 0, c["force_mag"], -c["force_mag"])
    total_mass, pml = c["masscart"] + c["masspole"], c["masspole"] * c["length"]
    cos, sin = torch.cos(theta), torch.sin(theta)
    temp = (force + pml * theta_dot**2 * sin) / total_mass
    theta_acc = (c["gravity"] * sin - cos * temp) / (
        c["length"] * (4.0 / 3.0 - c["masspole"] * cos**2 / total_mass))
    x_acc = temp - pml * theta_acc * cos / total_mass
    tau = c["tau"]
    return torch.stack([x + tau * x_dot, x_dot + tau * x_acc, theta + tau * theta_dot,
                        theta_dot + tau * theta_acc], -1)


def cartpole_cost(state: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    """Pole angle and cart offset, squared: ``(N,)`` (at most 0.1 before the episode ends)."""
    return state[:, 2] ** 2 + 0.01 * state[:, 0] ** 2
