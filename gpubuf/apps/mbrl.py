"""Model-based RL on gpubuf: a learned dynamics ensemble trained from replay windows, planned through with CEM.

The loop of :class:`MBRLAgent` (PETS-style): EnvPool envs step through an :class:`~gpubuf.EnvPoolSource`, which appends
every step to a shared :class:`~gpubuf.HistoryBuffer` and inserts it into a replay buffer; an :class:`EnsembleDynamics`
(``members`` small MLPs) is trained by :func:`train_step` on ``n_steps`` windows sampled from that buffer; a
:class:`~gpubuf.Planner` re-plans each env from its history with a :class:`~gpubuf.CEMSolver` rolled out through the
learned model (:meth:`EnsembleDynamics.solver`).

The model predicts the next observation from (observation, action), and the reward and termination from the next
observation; the task's equations are never used. Planning minimises minus the predicted reward plus, where the task has
one, a known cost (PETS assumes the task's cost is known; for CartPole-v1,
:func:`gpubuf.planning.cartpole.cartpole_cost`): with the reward alone, a planner that sees a few tenths of a second
ahead balances the pole but lets the cart drift off the track."""

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from gpubuf._core.inputs import finite_float, positive_int
from gpubuf.history.buffer import HistoryBuffer
from gpubuf.planning import CEMSolver, PlanConfig, Planner
from gpubuf.replay.buffer import TransitionBuffer
from gpubuf.replay.prioritized import PrioritizedTransitionBuffer
from gpubuf.replay.sampling.units import Unit
from gpubuf.sources.envpool import EnvPoolSource


class EnsembleMLP(nn.Module):
    """``members`` independent MLPs evaluated together: ``x (members, ..., sizes[0]) -> (members, ..., sizes[-1])``.

    One batched matmul per layer, SiLU between layers; each member is initialised as ``nn.Linear`` would be."""

    def __init__(self, members: int, sizes: list[int]):
        super().__init__()
        self.weights, self.biases = nn.ParameterList(), nn.ParameterList()
        for fan_in, fan_out in zip(sizes[:-1], sizes[1:], strict=False):
            bound = 1 / math.sqrt(fan_in)
            self.weights.append(nn.Parameter(torch.empty(members, fan_in, fan_out).uniform_(-bound, bound)))
            self.biases.append(nn.Parameter(torch.empty(members, 1, fan_out).uniform_(-bound, bound)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, last = x.shape[:-1], len(self.weights) - 1
        x = x.reshape(x.shape[0], -1, x.shape[-1])
        for i, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            x = torch.baddbmm(b, x, w)
            if i < last:
                x = nn.functional.silu(x)
        return x.view(*lead, x.shape[-1])


class EnsembleDynamics(nn.Module):
    """An ensemble of ``members`` learned models of a task with vector observations and discrete actions.

    Args:
        obs_dim: size of an observation.
        n_actions: number of discrete actions.
        members: ensemble size; each member is trained on its own batches and, in planning, rolls out its own share of
            the candidate action sequences (trajectory sampling).
        hidden: width of the two hidden layers of every network.
        task_cost: ``task_cost(next_obs (N, obs_dim), action (N, 1)) -> (N,)``, a known cost of the task added to the
            planning cost (PETS assumes the task's cost is known), or ``None``: plan on the learned reward only.

    Per member, two MLPs: ``step`` maps (normalised observation, one-hot action) to the normalised change of the
    observation; ``outcome`` maps a next observation to the reward and a termination logit. Normalisation statistics are
    running averages over the training batches (:meth:`observe`)."""

    def __init__(self, obs_dim: int, n_actions: int, members: int = 3, hidden: int = 32,
                 task_cost: Callable | None = None):
        super().__init__()
        self.obs_dim = positive_int("obs_dim", obs_dim)
        self.n_actions = positive_int("n_actions", n_actions)
        self.members = positive_int("members", members)
        hidden = positive_int("hidden", hidden)
        if task_cost is not None and not callable(task_cost):
            raise TypeError(f"task_cost: expected a callable or None, got {type(task_cost).__name__}")
        self.task_cost = task_cost
        self.step_net = EnsembleMLP(members, [obs_dim + n_actions, hidden, hidden, obs_dim])
        self.outcome_net = EnsembleMLP(members, [obs_dim, hidden, hidden, 2])
        for name, size in (("obs_mean", obs_dim), ("delta_mean", obs_dim), ("reward_mean", 1)):
            self.register_buffer(name, torch.zeros(size))
        for name, size in (("obs_std", obs_dim), ("delta_std", obs_dim), ("reward_std", 1)):
            self.register_buffer(name, torch.ones(size))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    @torch.no_grad()
    def observe(self, obs: torch.Tensor, next_obs: torch.Tensor, reward: torch.Tensor, momentum: float = 0.01) -> None:
        """Move the normalisation statistics towards those of ``obs``/``next_obs`` ``(..., obs_dim)`` and
        ``reward (...)`` (the first call sets them). A constant reward gets a std of ``1e-6``: predicted exactly."""
        delta = (next_obs - obs).reshape(-1, self.obs_dim)
        obs, reward = obs.reshape(-1, self.obs_dim), reward.reshape(-1, 1)
        m = 1.0 if int(self.seen) == 0 else momentum
        for stat, value in ((self.obs_mean, obs.mean(0)), (self.obs_std, obs.std(0, correction=0) + 1e-6),
                            (self.delta_mean, delta.mean(0)), (self.delta_std, delta.std(0, correction=0) + 1e-6),
                            (self.reward_mean, reward.mean(0)), (self.reward_std, reward.std(0, correction=0) + 1e-6)):
            stat.lerp_(value, m)
        self.seen += 1

    def one_hot(self, action: torch.Tensor) -> torch.Tensor:
        """Integer actions ``(...)`` -> float one-hot ``(..., n_actions)``."""
        return nn.functional.one_hot(action.long(), self.n_actions).float()

    def next_obs(self, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        """``obs (members, ..., obs_dim)``, one-hot ``action (members, ..., n_actions)`` -> next obs, like ``obs``."""
        x = torch.cat([(obs - self.obs_mean) / self.obs_std, action], -1)
        return obs + self.delta_mean + self.delta_std * self.step_net(x)

    def outcome(self, next_obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``next_obs (members, ..., obs_dim)`` -> reward, termination logit: ``(members, ...)`` each."""
        out = self.outcome_net((next_obs - self.obs_mean) / self.obs_std)
        return self.reward_mean + self.reward_std * out[..., 0], out[..., 1]

    # ------------------------------------------------------------------ planning: the CEMSolver's functions

    def plan_step(self, state: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        """The planning dynamics: ``state (N, obs_dim + 2)`` = (observation, reward, termination logit),
        ``action (N, 1)`` planner values in ``[-1, 1]`` (:func:`to_discrete`) -> the next state, same shape. Row ``i``
        is rolled out by member ``i % members``."""
        N, K = state.shape[0], self.members
        pad = -N % K
        act = self.one_hot(to_discrete(action[:, 0], self.n_actions))
        obs, act = (nn.functional.pad(t, (0, 0, 0, pad)).view(-1, K, t.shape[-1]).transpose(0, 1)
                    # (K, (N + pad) / K, .): row i on member i % K
                    for t in (state[:, : self.obs_dim], act))
        nxt = self.next_obs(obs, act)
        reward, logit = self.outcome(nxt)
        out = torch.cat([nxt, reward[..., None], logit[..., None]], -1)
        return out.transpose(0, 1).reshape(N + pad, -1)[:N]

    def plan_cost(self, state: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        """``(N,)``: minus the predicted reward of reaching ``state``, plus ``task_cost`` of its observation."""
        cost = -state[:, self.obs_dim]
        if self.task_cost is None:
            return cost
        return cost + self.task_cost(state[:, : self.obs_dim], action)

    def plan_terminated(self, state: torch.Tensor) -> torch.Tensor:
        """``(N,)`` bool: the predicted termination probability of ``state`` is above 1/2."""
        return state[:, self.obs_dim + 1] > 0

    def plan_encode(self, history: dict) -> torch.Tensor:
        """The planning state ``(R, obs_dim + 2)`` of each env's last observation in ``history``."""
        return nn.functional.pad(history["observation"][:, -1].float(), (0, 2))

    def solver(self, **cem) -> CEMSolver:
        """A :class:`~gpubuf.CEMSolver` through this model (the ``plan_*`` methods). ``cem``: CEMSolver's other keyword
        arguments (sizes, seed, discount)."""
        return CEMSolver(self.plan_step, self.plan_cost, terminated=self.plan_terminated, encode=self.plan_encode,
                         **cem)


def to_discrete(plan: torch.Tensor, n: int) -> torch.Tensor:
    """Planner values in ``[-1, 1]`` -> actions in ``[0, n)``: ``[-1, 1]`` is cut into ``n`` equal bins (for ``n = 2``:
    negative -> 0, else 1)."""
    return ((plan + 1) * (n / 2)).floor().clamp(0, n - 1).long()


def train_step(buffer: TransitionBuffer, model: EnsembleDynamics, optimizer: torch.optim.Optimizer,
               batch_size: int = 64) -> float:
    """One gradient step of ``model`` on ``members * batch_size`` windows from ``buffer``; returns the loss.

    ``buffer`` holds ``observation (obs_dim,)``, integer ``action``, ``reward``, ``terminated`` per row and samples
    ``n_steps`` windows with inferred next observations. Each member gets its own ``batch_size`` windows. Over the rows
    up to a window's first termination, the loss sums: the squared normalised error of each next observation predicted
    open-loop from the window's first observation through its actions; the reward's squared error and the termination's
    cross-entropy, predicted from the true next observations. A prioritized buffer weighs each window by its
    ``PER_weights`` and gets the window's error back as its priority."""
    if not isinstance(buffer, TransitionBuffer):
        raise TypeError(f"buffer: expected a gpubuf TransitionBuffer, got {type(buffer).__name__}")
    if not isinstance(model, EnsembleDynamics):
        raise TypeError(f"model: expected an EnsembleDynamics, got {type(model).__name__}")
    batch_size = positive_int("batch_size", batch_size)
    K, n = model.members, buffer.n_steps
    batch = buffer.sample(batch_size=K * batch_size, unit=Unit.transition())
    idx = batch.indices if isinstance(buffer, PrioritizedTransitionBuffer) else None

    # (K * B, n, ...) or (K * B, ...) -> (K, B, n, ...)
    def per_member(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(K, batch_size, n, *t.shape[1 + (n > 1):])

    obs, nxt = per_member(batch.observation.float()), per_member(batch.next_observation.float())
    act = model.one_hot(per_member(batch.action).reshape(K, batch_size, n))
    reward, done = per_member(batch.reward.float()), per_member(batch.terminated).float()
    model.observe(obs, nxt, reward)
    alive = (done.cumsum(-1) - done) == 0  # rows up to and including the first termination
    s, errors = obs[:, :, 0], []
    for t in range(n):
        s = model.next_obs(s, act[:, :, t])
        errors.append((((s - nxt[:, :, t]) / model.delta_std) ** 2).mean(-1))
    r_pred, logit = model.outcome(nxt)
    per_row = (torch.stack(errors, -1) + ((r_pred - reward) / model.reward_std) ** 2
               + nn.functional.binary_cross_entropy_with_logits(logit, done, reduction="none"))
    per_window = (per_row * alive).sum(-1) / alive.sum(-1)  # (K, B)
    weights = 1.0 if idx is None else batch.PER_weights.view(K, batch_size)
    loss = (weights * per_window).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    if idx is not None:
        buffer.update_priorities(idx, per_window.detach().sqrt().flatten())
    return float(loss.detach())


# the prioritized buffer's eps (added to |td|): alpha must keep eps**alpha above float64's tiny
PER_EPS = 1e-6
_LOG_TINY = math.log(torch.finfo(torch.float64).tiny)
MAX_ALPHA = _LOG_TINY / math.log(float(np.float32(PER_EPS)))  # about 51


@dataclass(frozen=True)
class MBRLConfig:
    """Sizes of an :class:`MBRLAgent`, each checked here (a bad one raises ``ValueError`` naming the field).

    Replay: ``capacity`` transitions, ``n_steps`` windows, prioritized with ``alpha``/``beta`` (``alpha=0``: a uniform
    :class:`~gpubuf.TransitionBuffer`). Model: ``members`` MLPs of width ``hidden``, Adam at ``lr``, ``updates``
    gradient steps of ``batch_size`` windows per member after every env batch. Planning: CEM over ``horizon`` steps,
    re-planned every ``receding_horizon`` steps, ``num_samples`` candidates per env (split among the members),
    ``num_elites``, ``iterations``, warm-started from the previous plan.

    Sizes are positive ints; ``alpha`` in ``[0, MAX_ALPHA]`` (about 51: beyond, ``eps**alpha`` underflows),
    ``beta >= 0``, ``lr > 0``, all finite; ``receding_horizon <= horizon``, ``num_elites <= num_samples``, and
    ``capacity >= members * batch_size + n_steps - 1`` (one sampled batch of windows, with one env; an
    :class:`MBRLAgent` over ``E`` envs needs ``capacity >= E * (ceil(members * batch_size / E) + n_steps - 1)``)."""

    # the fields, one a line as a dataclass declares them (alike in shape on purpose)
    # replay
    capacity: int = 20_000
    n_steps: int = 4
    alpha: float = 0.6
    beta: float = 0.4
    # model
    members: int = 3
    hidden: int = 32
    lr: float = 2e-3
    batch_size: int = 64
    updates: int = 4
    # planning
    horizon: int = 15
    receding_horizon: int = 1
    num_samples: int = 64
    num_elites: int = 8
    iterations: int = 2

    def __post_init__(self):
        for name in ("capacity", "n_steps", "members", "hidden", "batch_size", "updates", "horizon",
                     "receding_horizon", "num_samples", "num_elites", "iterations"):
            positive_int(name, getattr(self, name))
        for name in ("alpha", "beta"):
            finite_float(name, getattr(self, name), 0.0)
        # exactly the buffer's own check
        if self.alpha * math.log(float(np.float32(PER_EPS))) < _LOG_TINY:
            raise ValueError(f"alpha: expected at most {MAX_ALPHA:.4g} (eps**alpha with the buffer's eps {PER_EPS:g} "
                             f"must not underflow), got {self.alpha!r}")
        finite_float("lr", self.lr, 0.0, low_open=True)
        if self.receding_horizon > self.horizon:
            raise ValueError(f"receding_horizon: expected <= horizon ({self.horizon}), got {self.receding_horizon}")
        if self.num_elites > self.num_samples:
            raise ValueError(f"num_elites: expected <= num_samples ({self.num_samples}), got {self.num_elites}")
        self.check_capacity(1)

    def check_capacity(self, n_envs: int) -> None:
        """Raise ``ValueError`` naming ``capacity`` unless the replay of ``n_envs`` envs (``capacity // n_envs`` rows
        each) holds one sampled batch: ``members * batch_size`` distinct-start windows of ``n_steps`` rows."""
        need = self.min_capacity(n_envs)
        if self.capacity < need:
            per_env = "" if n_envs == 1 else f" over {n_envs} envs ({need // n_envs} rows each)"
            raise ValueError(f"capacity: expected at least {need} for members * batch_size = "
                             f"{self.members * self.batch_size} windows of n_steps = {self.n_steps} rows{per_env}, "
                             f"got {self.capacity}")

    def min_capacity(self, n_envs: int) -> int:
        """The smallest ``capacity`` a replay over ``n_envs`` envs can sample a batch from."""
        return n_envs * (-(-self.members * self.batch_size // n_envs) + self.n_steps - 1)


class EpisodeLog:
    """Episode returns of ``n_envs`` envs, from each received :class:`~gpubuf.Step`.

    ``episodes``: ``[env steps when it ended, return]`` per finished episode (terminated or truncated), in order."""

    def __init__(self, n_envs: int):
        self.episodes: list[list] = []
        self.env_steps = 0
        self._returns = np.zeros(n_envs)

    def record(self, step) -> None:
        """Count ``step``'s rows as env steps and add their rewards; close the episodes that ended."""
        self.env_steps += len(step.env_ids)
        info = step.info
        # the env's rows are on the host anyway
        self._returns[step.env_ids] += info["reward"][:, 0].cpu().numpy()
        ended = step.env_ids[(info["terminated"] | info["truncated"])[:, 0].cpu().numpy()]
        self.episodes.extend([self.env_steps, float(self._returns[e])] for e in ended)
        self._returns[ended] = 0

    def last_mean(self, window: int = 10) -> float:
        """Mean return of the last ``window`` episodes (NaN before the first one ends)."""
        last = [r for _, r in self.episodes[-window:]]
        return float(np.mean(last)) if last else float("nan")

    def solved_at(self, threshold: float, window: int = 10) -> int | None:
        """Env steps at which the mean return of the last ``window`` episodes first reached ``threshold``."""
        returns = np.array([r for _, r in self.episodes])
        if len(returns) < window:
            return None
        # means[i]: episodes i..i+window-1
        means = np.convolve(returns, np.ones(window) / window, mode="valid")
        hit = np.flatnonzero(means >= threshold)
        return int(self.episodes[hit[0] + window - 1][0]) if len(hit) else None


class EnvLoop:
    """A loop that steps an env batch by batch: each batch acts on the last received step, steps ``source``, records the
    rows in ``log`` and trains once ``buffer`` holds a batch of windows with next observations. Subclasses set
    ``source`` (an :class:`~gpubuf.EnvPoolSource`), ``buffer`` and ``log`` and define :meth:`act` and :meth:`train`."""

    source: EnvPoolSource
    buffer: TransitionBuffer
    log: EpisodeLog
    _step = None  # the last received step (None before the first reset)

    def act(self, step) -> object:
        """The actions to send to ``step.env_ids``, from the last received :class:`~gpubuf.Step`."""
        raise NotImplementedError

    def train(self) -> None:
        """One round of learning from ``buffer``."""
        raise NotImplementedError

    def step(self) -> None:
        """One env batch: act, step, record, then train once the buffer holds a batch."""
        if self._step is None:
            self._step = self.source.reset()
        step = self._step
        self._step = self.source.step(self.act(step), step.env_ids)
        self.log.record(self._step)
        if self.buffer.num_valid(with_next_obs=True) >= self.buffer.sample_batch_size:
            self.train()

    def run(self, env_steps: int, progress: Callable | None = None) -> EpisodeLog:
        """Step until ``env_steps`` more env steps are done (whole batches); ``progress(log)`` after each batch."""
        stop = self.log.env_steps + positive_int("env_steps", env_steps)
        while self.log.env_steps < stop:
            self.step()
            if progress is not None:
                progress(self.log)
        return self.log


class MBRLAgent(EnvLoop):
    """Learns to act in a sync EnvPool env with vector observations and discrete actions, from its own replay.

    Args:
        env: an ``envpool.make(..., env_type="gymnasium")`` env with ``batch_size == num_envs``.
        config: an :class:`MBRLConfig`.
        task_cost: a known cost of the task for planning (see :class:`EnsembleDynamics`), or ``None``.
        device: where buffers, model and planning live; ``None`` -> ``cuda`` when available, else ``cpu``.
        seed: seeds torch, the replay sampler and CEM.

    Parts, all public: ``history`` (the last observation per env, appended by ``source``), ``source`` (an
    :class:`~gpubuf.EnvPoolSource` that inserts every step into ``buffer``), ``buffer``, ``model``
    (:class:`EnsembleDynamics`), ``optimizer``, ``planner`` (a :class:`~gpubuf.Planner` reading ``history``, with CEM
    through ``model``) and ``log`` (:class:`EpisodeLog`). Planner values in ``[-1, 1]`` become env actions through
    :func:`to_discrete`."""

    def __init__(self, env, config: MBRLConfig = MBRLConfig(), *, task_cost: Callable | None = None, device=None,
                 seed: int = 0):
        if not isinstance(config, MBRLConfig):
            raise TypeError(f"config: expected an MBRLConfig, got {type(config).__name__}")
        self.n_actions = getattr(env.action_space, "n", None)
        obs_shape = env.observation_space.shape
        if self.n_actions is None or len(obs_shape) != 1:
            raise ValueError("env: expected vector observations and discrete actions, got observations "
                             f"{obs_shape} and actions {env.action_space}")
        self.config = config
        torch.manual_seed(seed)
        n_envs = int(env.config["num_envs"])
        config.check_capacity(n_envs)
        plan = PlanConfig(config.horizon, config.receding_horizon)
        self.history = HistoryBuffer(n_envs, plan.history_steps, device=device)
        self.source = EnvPoolSource(env, device=device, history=self.history)
        if self.source.is_async:
            raise ValueError("env: expected a sync env (batch_size == num_envs): the model trains on per-env windows "
                             "of consecutive steps")
        cls, extra = TransitionBuffer, {}
        if config.alpha > 0:
            cls, extra = PrioritizedTransitionBuffer, {"alpha": config.alpha, "beta": config.beta, "eps": PER_EPS}
        self.buffer = cls(config.capacity, config.batch_size * config.members, self.source.transition_sample(),
                          n_steps=config.n_steps, device=self.source.device, seed=seed, **extra)
        self.source.transitions = self.buffer
        self.model = EnsembleDynamics(obs_shape[0], self.n_actions, config.members, config.hidden, task_cost)
        self.model.to(self.source.device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=config.lr)
        solver = self.model.solver(num_samples=config.num_samples, num_elites=config.num_elites,
                                   iterations=config.iterations, seed=seed)
        self.planner = Planner(plan, solver, n_envs, 1, history=self.history)
        self.log = EpisodeLog(n_envs)
        self.loss = float("nan")

    def act(self, step) -> torch.Tensor:
        """Plan every env of ``step`` (from ``history``): its next discrete actions ``(R,)``."""
        actions = self.planner.act(None, step.env_ids, step.first)
        return to_discrete(actions[:, 0], self.n_actions)

    def train(self) -> None:
        """``config.updates`` gradient steps of :func:`train_step`; the last loss is kept in ``loss``."""
        for _ in range(self.config.updates):
            self.loss = train_step(self.buffer, self.model, self.optimizer, self.config.batch_size)
