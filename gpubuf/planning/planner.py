"""Receding-horizon control for batched MPC: per-env action queues on the device, re-planned per env.

:class:`Planner` reads per-env histories from a :class:`~gpubuf.HistoryBuffer` (its own, or one it is given) and keeps,
for every env, a queue of env actions and its last plan. Each :meth:`Planner.act` flushes the queues (and an owned
history) of envs on a reset frame, appends the step to an owned history, asks the solver for a new plan only for the
envs whose queue ran empty, and pops one action per env. Solvers that take an ``init`` argument are warm-started from
each env's previous plan shifted by the executed steps (:class:`~gpubuf.planning.cem.CEMSolver` is one such solver)."""

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from gpubuf import ops
from gpubuf._core.inputs import as_flags, as_tensor, env_ids_or_all, positive_int
from gpubuf._core.staging import Staging
from gpubuf.history.buffer import HistoryBuffer


@dataclass(frozen=True)
class PlanConfig:
    """Planning cadence, as in stable-worldmodel's ``PlanConfig``: the one place the horizon is stated.

    horizon: planned steps per solve; each step is a macro-action of ``action_block`` env actions.
    receding_horizon: planned steps executed before re-planning (``<= horizon``).
    action_block: env steps per planned step (the history's stride).
    history_len: strided frames of history handed to the solver."""

    horizon: int
    receding_horizon: int
    action_block: int = 1
    history_len: int = 1

    def __post_init__(self):
        for name in ("horizon", "receding_horizon", "action_block", "history_len"):
            positive_int(name, getattr(self, name))
        if self.receding_horizon > self.horizon:
            raise ValueError(f"receding_horizon: expected <= horizon ({self.horizon}), got {self.receding_horizon}")

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
        solver: ``solver(history, env_ids[, init]) -> actions (R, horizon, action_block * action_dim)``,
            ``R = len(env_ids)``; ``history`` is :meth:`HistoryBuffer.get`'s dict for those envs with
            ``n = min(history_len, max(num_strided(env_ids)))`` frames. Its tensors are reused by the next re-plan of
            the same shape (zero allocation): copy what the solver keeps beyond its call. A solver whose call takes an
            ``init`` keyword (or ``**kwargs``) gets the warm start ``init (R, horizon, action_block * action_dim)``
            float32: each env's previous plan shifted by the ``receding_horizon`` steps it executed since, NaN where
            there is nothing to shift in (the tail, and every step of an env that was reset or never planned): the
            solver puts its default there. A solver with a ``horizon`` or ``action_dim`` attribute (not ``None``)
            must agree with ``config`` and ``action_dim``. A solver with a ``history_keys`` attribute (key names, not
            ``None``) gets only those keys of the history: the planner gathers nothing else (a :class:`CEMSolver`
            with the default ``encode`` reads ``state_key`` only).
        n_envs: number of envs.
        action_dim: size of one env action (``1`` for a discrete or scalar action).
        device: device of the queues (and of an owned history); ``None`` -> the history's device when ``history``
            is given, else ``cuda`` when available, else ``cpu``.
        history: an existing :class:`HistoryBuffer` to read, e.g. the one an :class:`~gpubuf.EnvPoolSource` appends
            every step to. Its owner appends and flushes it: the planner only reads it (:meth:`act` then takes
            ``info=None``). It must have ``n_envs`` envs, stride ``config.action_block``, and hold at least
            ``config.history_steps`` entries per env. ``None``: the planner builds and appends its own.

    Queues are ``(n_envs, receding_horizon * action_block, action_dim)`` on the device; how many actions each env has
    left lives on the host, so choosing who re-plans never reads the device."""

    def __init__(self, config: PlanConfig, solver: Callable, n_envs: int, action_dim: int, *, device=None,
                 history: HistoryBuffer | None = None):
        if not isinstance(config, PlanConfig):
            raise TypeError(f"config: expected a PlanConfig, got {type(config).__name__}")
        if not callable(solver):
            raise TypeError(f"solver: expected a callable solver(history, env_ids), got {type(solver).__name__}")
        self.config, self.solver = config, solver
        self.n_envs = positive_int("n_envs", n_envs)
        self.action_dim = positive_int("action_dim", action_dim)
        ab = config.action_block
        width = ab * self.action_dim
        for name, want in (("horizon", config.horizon), ("action_dim", width)):
            got = getattr(solver, name, None)
            if got is not None and got != want:
                source = "config.horizon" if name == "horizon" else "action_block * action_dim"
                raise ValueError(f"solver: its {name} ({got}) differs from {source} ({want}); state it once, in "
                                 f"the PlanConfig and the Planner (leave the solver's {name} unset)")
        self.owns_history = history is None
        if history is None:
            # one slot more than the solver ever reads: an act() that fails can undo its append exactly
            history = HistoryBuffer(self.n_envs, config.history_steps + 1, ab, ("action",), device=device)
        else:
            check_history(history, config, self.n_envs, device)
        self.history = history
        self.device = history.device
        self.queue_len = config.receding_horizon * ab
        self._queue = torch.zeros(self.n_envs, self.queue_len, self.action_dim, device=self.device)
        self._left = np.zeros(self.n_envs, dtype=np.int64)  # actions left per env (host mirror)
        self._warm = takes_init(solver)
        self._plans = torch.zeros(self.n_envs, config.horizon, width, device=self.device)  # last plan per env
        self._has_plan = np.zeros(self.n_envs, dtype=bool)  # host: whether _plans holds a plan to shift
        self._all_ids = np.arange(self.n_envs, dtype=np.int64)
        self._staging = Staging(self.device)
        self.replanned: np.ndarray = np.zeros(0, dtype=np.int64)  # envs re-planned by the last act()
        self._history_out: tuple = (None, None)  # ((n, rows), tensors) reused by get(out=) while the key holds

    def reset(self, env_ids=None) -> None:
        """Forget the listed envs' plans (and their histories, if owned; all envs if ``None``)."""
        ids = env_ids_or_all(env_ids, self._all_ids)
        if self.owns_history:
            self.history.reset(ids)
        self._left[ids] = 0
        self._has_plan[ids] = False

    def act(self, info: dict | None = None, env_ids=None, first=None) -> torch.Tensor:
        """One action per listed env: ``(R, action_dim)`` on the device.

        ``info`` is one step in the stacked layout (``(R, 1, ...)`` values, ``action`` echo included), appended to
        the planner's own history; ``None`` when the planner reads a given ``history`` (its owner appends).
        ``env_ids`` ``(R,)`` distinct host ints (all envs if ``None``), ``first`` ``(R,)`` host bools marking reset
        frames: those envs' queues and plans (and owned histories) are flushed first. Planned actions are queued as
        ``float32`` (a ``float64`` plan is rounded to it) and must be finite there. If anything fails (bad input, the
        solver raising or returning a wrong shape or non-finite actions), the planner and its owned history are left
        exactly as they were before the call (a failed first call fixes no key, shape or dtype of the history), so the
        same step, or another one, can be retried."""
        if self.owns_history and info is None:
            raise ValueError("info: expected the step's info dict (this planner appends each step to its own "
                             "history), got None")
        if not self.owns_history and info is not None:
            raise ValueError("info: expected None: this planner reads the history it was given (history=), which "
                             "its owner appends to; appending here too would store every step twice")
        ids = env_ids_or_all(env_ids, self._all_ids)
        if env_ids is not None and len(np.unique(ids)) != len(ids):
            raise ValueError(f"env_ids: expected distinct envs (one action each), got {ids.tolist()}")
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
            raise ValueError(f"history: envs {ids[np.asarray(strided) == 0][:5].tolist()} hold no entry; the "
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
            raise ValueError(f"solver: expected float actions of shape {want}, got {plan.dtype} {tuple(plan.shape)}")
        plan = plan.to(self.device, self._queue.dtype)
        steps = plan[:, : cfg.receding_horizon].reshape(len(ids), self.queue_len, self.action_dim)
        # one read-back per re-plan: the env needs the actions anyway
        if not bool(torch.isfinite(steps).all()):
            raise ValueError(f"solver: planned actions must be finite in {self._queue.dtype}, got "
                             f"{steps[~torch.isfinite(steps)][:5].tolist()} (NaN, or beyond its range)")
        self._queue.index_copy_(0, rows, steps)
        self._plans.index_copy_(0, rows, plan)
        self._left[ids] = self.queue_len
        self._has_plan[ids] = True

    def _warm_start(self, ids: np.ndarray, rows: torch.Tensor) -> torch.Tensor:
        """``(R, horizon, width)``: the previous plans shifted by ``receding_horizon`` steps, NaN elsewhere."""
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
    """Raise unless ``history`` can serve a :class:`Planner` of ``config`` over ``n_envs`` envs on ``device``."""
    if not isinstance(history, HistoryBuffer):
        raise TypeError(f"history: expected a gpubuf.HistoryBuffer, got {type(history).__name__}")
    if history.n_envs != n_envs:
        raise ValueError(f"history: expected n_envs={n_envs} (the planner's), got a HistoryBuffer with "
                         f"n_envs={history.n_envs}")
    if history.action_block != config.action_block:
        raise ValueError(f"history: expected action_block={config.action_block} (config.action_block), got a "
                         f"HistoryBuffer with action_block={history.action_block}")
    if history.max_len < config.history_steps:
        raise ValueError(f"history: expected max_len >= {config.history_steps} ((history_len - 1) * action_block "
                         f"+ 1 env steps), got a HistoryBuffer with max_len={history.max_len}")
    if device is None:
        return
    try:
        same = ops.resolve_device(device) == history.device
    except ValueError:  # names no usable device
        same = False
    if not same:
        raise ValueError(f"device: expected the history's device ({history.device}) or None, got {device!r}")
