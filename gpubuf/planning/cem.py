"""The cross-entropy-method solver the :class:`~gpubuf.planning.planner.Planner` plans with: sample action
sequences through user dynamics, cost and termination functions, keep the elites, refit, repeat."""

from collections.abc import Callable

import numpy as np
import torch

from gpubuf._core.inputs import as_tensor, finite_float, positive_int


class CEMSolver:
    """Cross-entropy method over a user model: sample action sequences, keep the elites, refit, repeat.

    Args:
        dynamics: ``dynamics(state (N, ...), action (N, action_dim)) -> next state (N, ...)``.
        cost: ``cost(next_state (N, ...), action (N, action_dim)) -> (N,)``: the cost of taking
            ``action``, evaluated on the state **after** the step. A rollout's return is ``sum_t
            discount**t * cost_t`` over the horizon, minimised.
        horizon, action_dim: the plan's shape per env (``action_dim`` includes any action block).
            Leave them ``None`` under a :class:`Planner`, which hands them over through ``init``;
            they are needed only to call the solver without ``init``.
        terminated: ``terminated(next_state (N, ...)) -> (N,) bool``, or ``None`` (nothing terminates). The step into a
            terminal state still pays its cost; nothing after it does (the return is frozen).
        terminal_cost: ``terminal_cost(last_state (N, ...)) -> (N,)``, or ``None``: the cost of where a rollout ends
            (e.g. minus a learned value), added with weight ``discount**horizon`` to rollouts that did not terminate.
        discount: factor in ``(0, 1]`` on each later step's cost.
        encode: ``encode(history) -> state (R, ...)``; default: the last frame of ``history[state_key]``.
        num_samples, num_elites, iterations: CEM sizes.
        init_std, low, high: initial spread and action bounds; the default mean is ``(low + high) / 2``.
        seed: seed of the solver's generator (an int in ``[0, 2**64)``); one generator per device, created on first use.
            Its draws are not rolled back when a model call raises: a retried solve samples anew.

    ``solver(history, env_ids, init=None) -> (R, horizon, action_dim)``: the elites' mean after the last iteration.
    ``init (R, horizon, action_dim)`` is the first iteration's mean (warm start), NaN entries taking the default mean;
    the spread always starts at ``init_std``. All envs and samples are rolled out together, one batched model call per
    horizon step, under ``torch.no_grad()``.

    Non-finite rollouts rank last. A rollout is non-finite when its return is (NaN or inf, from the model or from an
    overflowing sum) or when any of its model states is: the encoded state, or a ``dynamics`` output up to and including
    the step into a terminal state (states after termination are never used), even if the cost maps that state to a
    finite number (a threshold, ``nan_to_num``, an action-only cost). An env's elites are its ``num_elites`` lowest
    finite rollouts, or all of its finite ones when fewer are finite. When every candidate of an env is non-finite in
    some iteration, the call raises ``ValueError`` naming those envs and the model output that first went non-finite
    (``encode``, ``dynamics``, ``cost``, ``terminal_cost``): nothing is planned through NaN. The states are checked on
    the device into a per-rollout flag (per step: ``isfinite`` over the state, a per-row ``all``, one ``(N,)`` AND, plus
    a NOT and an OR with ``terminated``), folded into the returns, so the call still reads back one ``(R,)`` flag."""

    def __init__(self, dynamics: Callable, cost: Callable, horizon: int | None = None, action_dim: int | None = None, *,
                 terminated: Callable | None = None, terminal_cost: Callable | None = None, discount: float = 1.0,
                 encode: Callable | None = None, state_key: str = "observation", num_samples: int = 64,
                 num_elites: int = 8, iterations: int = 3, init_std: float = 1.0, low: float = -1.0, high: float = 1.0,
                 seed: int = 0):
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
            raise ValueError(f"num_elites: expected <= num_samples ({self.num_samples}), got {self.num_elites}")
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
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**64:
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
            total = self._returns(state.repeat_interleave(N, dim=0), actions.view(R * N, H, A)).view(R, N)
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

    def _non_finite_message(self, state: torch.Tensor, actions: torch.Tensor, failed: torch.Tensor, env_ids) -> str:
        """Names the model output that first went non-finite for the envs with no finite return: their last iteration's
        candidates ``actions (R, N, H, A)`` are rolled out again from ``state (R, ...)``, checking each output."""
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
            return (f"cost: expected a finite return for at least one of the {N} candidates of every env, got only "
                    f"NaN/inf returns for envs {envs} (each output was finite when rolled out again: the discounted "
                    "sum overflows, or the model is random)")
        name, fn, what = where
        return (f"{name}: expected finite values, got NaN/inf in {what} from {_name(fn)}, so every one of the {N} "
                f"candidate returns of envs {envs} is non-finite; nothing to plan with")

    def _initial_mean(self, R: int, init, device) -> torch.Tensor:
        """``(R, H, A)``: ``init`` with NaN replaced by the default mean, or the default mean everywhere."""
        middle = (self.low + self.high) / 2
        if init is None:
            if self.horizon is None or self.action_dim is None:
                raise ValueError("horizon: a CEMSolver called without init (outside a Planner) needs horizon= and "
                                 "action_dim=")
            return torch.full((R, self.horizon, self.action_dim), middle, device=device)
        init = as_tensor(init, "init")
        if init.dim() != 3 or init.shape[0] != R or not init.dtype.is_floating_point:
            raise ValueError(f"init: expected float (R={R}, horizon, action_dim), got {init.dtype} {tuple(init.shape)}")
        for name, got in (("horizon", init.shape[1]), ("action_dim", init.shape[2])):
            if getattr(self, name) not in (None, got):
                raise ValueError(f"init: expected {name} {getattr(self, name)} (the solver's), got {got}")
        init = init.to(device, torch.float32)
        return torch.where(init.isnan(), middle, init)

    @staticmethod
    def _checked(cost: torch.Tensor, name: str, N: int) -> torch.Tensor:
        if tuple(cost.shape) != (N,):
            raise ValueError(f"{name}: expected shape ({N},), got {tuple(cost.shape)}")
        return cost

    def _returns(self, s: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """``(N,)`` discounted cost of each rollout of ``actions (N, H, A)`` from ``s (N, ...)``, frozen at termination,
        plus the discounted terminal cost of the rollouts still alive at the end."""
        N, H = actions.shape[:2]
        total = torch.zeros(N, device=s.device)
        alive = None if self.terminated is None else torch.ones(N, dtype=torch.bool, device=s.device)
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
                    raise ValueError(f"terminated: expected a bool tensor of shape ({N},), got {done.dtype} "
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
