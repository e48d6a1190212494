"""What ``gpubuf demo`` runs and reports: a learning run (or a pixel timing run), timed, as a table and a plot.

Tasks with vector observations and discrete actions (``CartPole-v1``, the default) run an
:class:`~gpubuf.apps.mbrl.MBRLAgent`: a dynamics ensemble learned from prioritized replay windows, planned through with
CEM from per-env histories. Other tasks (pixel tasks such as ``Pong-v5``) run :class:`RandomPlanRun`, the timing
variant: uniform random plans from per-env histories, a PER buffer and a linear TD(0) value learner whose TD errors
become priorities; it times the buffers and does not learn to act. Either way every buffer call is timed with a
:class:`Timer` and episode returns are logged against env steps."""

import importlib
import time
from collections import defaultdict

import numpy as np
import torch

from gpubuf import ops
from gpubuf.apps.benchmarking.timing import wall_clock
from gpubuf.apps.mbrl import EnvLoop, EpisodeLog, MBRLAgent, MBRLConfig
from gpubuf.planning import PlanConfig, Planner, cartpole_cost
from gpubuf.replay.prioritized import PrioritizedTransitionBuffer
from gpubuf.replay.sampling.units import Unit
from gpubuf.sources.envpool import EnvPoolSource

# known task costs the learning run plans with (as PETS does)
TASK_COSTS = {"CartPole-v1": cartpole_cost}
EXTRA = "apps"  # the extra that brings the demo's optional dependencies: pip install "gpubuf[apps]"


def require(module: str, use: str):
    """Import ``module``, an optional dependency of the apps (tqdm, matplotlib), or raise an ImportError that names the
    extra to install; ``use`` says what needs it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f"{use} needs {module}, which is not installed: pip install \"gpubuf[{EXTRA}]\" "
                          f"(or pip install {module})") from err


class Timer:
    """Wraps callables to record their wall time (device-synchronised on CUDA) under a name: every call is one sample of
    :func:`gpubuf.apps.benchmarking.timing.wall_clock` (what the benchmarks time with)."""

    def __init__(self, device: torch.device):
        self.samples: dict[str, list[float]] = defaultdict(list)  # seconds per call
        self._clock = wall_clock(device)

    def wrap(self, fn, name: str):
        def timed(*args, **kwargs):
            stop = self._clock()
            out = fn(*args, **kwargs)
            self.samples[name].append(stop() / 1e6)
            return out

        return timed

    def instrument(self, obj, methods: dict[str, str]) -> None:
        """Time ``obj``'s public methods ``{method: name}`` from now on (instance attributes shadow them)."""
        for method, name in methods.items():
            setattr(obj, method, self.wrap(getattr(obj, method), name))

    def median_us(self, name: str) -> float:
        return float(np.median(self.samples[name]) * 1e6) if self.samples[name] else 0.0

    def total_s(self, name: str) -> float:
        return float(np.sum(self.samples[name]))


class TimedEnv:
    """An envpool env whose ``reset``/``send``/``recv`` are timed as ``env``; everything else passes through."""

    def __init__(self, env, timer: Timer):
        self._env = env
        self.config = env.config
        for name in ("reset", "async_reset", "send", "recv"):
            setattr(self, name, timer.wrap(getattr(env, name), "env"))

    def __getattr__(self, name):
        return getattr(self._env, name)


def random_plans(space, horizon: int, seed: int):
    """``(solver, action_dim, to_env)``: uniform random plans in ``[0, 1)`` and their mapping onto ``space`` (discrete:
    ``n`` equal bins; continuous: ``low + plan * (high - low)``)."""
    discrete = hasattr(space, "n")
    dim = 1 if discrete else int(np.prod(space.shape))
    gen = torch.Generator().manual_seed(seed)
    solver = lambda history, ids: torch.rand(len(ids), horizon, dim, generator=gen)
    if discrete:
        return solver, dim, lambda a: np.minimum(a[:, 0].cpu().numpy() * space.n, space.n - 1).astype(np.int32)
    return solver, dim, lambda a: space.low + a.cpu().numpy().reshape(-1, *space.shape) * (space.high - space.low)


class ValueLearner:
    """A linear state-value function trained by TD(0) on PER batches; the TD errors become priorities."""

    def __init__(self, obs_size: int, device: torch.device, lr: float = 0.1, gamma: float = 0.99):
        self.w = torch.zeros(obs_size, device=device)
        self._batch = None
        self.lr, self.gamma = lr / obs_size, gamma

    def update(self, per: PrioritizedTransitionBuffer, with_next_obs: bool) -> None:
        batch = per.sample(unit=Unit.transition() if with_next_obs else Unit.window(), out=self._batch)
        self._batch = batch  # the next sample writes into the same tensors (no allocation)
        idx = batch.indices
        B = batch.reward.shape[0]
        scale = 1 / 255 if batch.observation.dtype == torch.uint8 else 1.0
        x = batch.observation.reshape(B, -1).float() * scale  # (B, obs)
        x_next = batch.next_observation.reshape(B, -1).float() * scale
        target = batch.reward.float() + self.gamma * (x_next @ self.w) * (~batch.terminated.bool())
        td = target - x @ self.w  # (B,)
        self.w += self.lr * (batch.PER_weights.float() * td) @ x
        per.update_priorities(idx, td)


class RandomPlanRun(EnvLoop):
    """The timing variant of the demo, for any EnvPool task (pixels included), sync or async.

    A :class:`~gpubuf.Planner` with its own history re-plans uniform random actions every 4 steps from 4-frame
    histories; every step goes into a :class:`~gpubuf.PrioritizedTransitionBuffer` (``num_envs * 64`` transitions) that
    a :class:`ValueLearner` samples 32 transitions from per step."""

    def __init__(self, env, *, device=None, seed: int = 0):
        n_envs = int(env.config["num_envs"])
        obs_shape = env.observation_space.shape
        self.source = EnvPoolSource(env, obs_key="pixels" if len(obs_shape) >= 3 else "observation", device=device)
        self.plan = PlanConfig(horizon=8, receding_horizon=4, history_len=4)
        solver, action_dim, self.to_env = random_plans(env.action_space, self.plan.horizon, seed)
        self.planner = Planner(self.plan, solver, n_envs, action_dim, device=self.source.device)
        # async rows are single transitions with their next observation
        vectorized = not self.source.is_async
        self.buffer = PrioritizedTransitionBuffer(n_envs * 64, 32, self.source.transition_sample(vectorized),
                                                  vectorized_env=vectorized, device=self.source.device, seed=seed)
        self.source.transitions = self.buffer
        self.learner = ValueLearner(int(np.prod(obs_shape)), self.source.device)
        self.log = EpisodeLog(n_envs)

    def act(self, step):
        """The env actions of the planner's queues for the envs of ``step``."""
        return self.to_env(self.planner.act(step.info, step.env_ids, step.first))

    def train(self) -> None:
        """One learner update."""
        self.learner.update(self.buffer, with_next_obs=True)


def learns(env) -> bool:
    """Whether the demo runs the learning agent on ``env`` (vector observations, discrete actions, sync)."""
    sync = env.config["batch_size"] == env.config["num_envs"]
    return sync and hasattr(env.action_space, "n") and len(env.observation_space.shape) == 1


def run(env, env_steps: int, *, device=None, seed: int = 0, progress=None, config: MBRLConfig | None = None,
        task_cost=None) -> dict:
    """Run the demo on an EnvPool ``env`` for ``env_steps`` env steps; returns the numbers of the report.

    ``progress(log)`` is called after every env batch with the :class:`~gpubuf.apps.mbrl.EpisodeLog`; ``config`` sizes
    the learning agent (``None``: :class:`~gpubuf.apps.mbrl.MBRLConfig`'s defaults) and ``task_cost`` is its known task
    cost (see :class:`~gpubuf.apps.mbrl.EnsembleDynamics`; :data:`TASK_COSTS` lists the demo's)."""
    timer = Timer(ops.resolve_device(device))
    timed = TimedEnv(env, timer)
    if learns(env):
        loop = MBRLAgent(timed, config or MBRLConfig(), task_cost=task_cost, device=device, seed=seed)
        timer.instrument(loop, {"train": "train"})
        history, mode = loop.history, "learned model + CEM planning"
    else:
        loop = RandomPlanRun(timed, device=device, seed=seed)
        timer.instrument(loop.learner, {"update": "train"})
        history, mode = loop.planner.history, "random plans + linear value learner (timing only)"
    timer.instrument(loop.planner, {"act": "plan"})
    timer.instrument(loop.source, {"step": "source step"})
    timer.instrument(history, {"append": "append", "get": "get"})
    timer.instrument(loop.buffer, {"insert": "insert", "sample": "sample", "update_priorities": "update"})
    t0 = time.perf_counter()
    log = loop.run(env_steps, progress)
    wall = time.perf_counter() - t0
    names = ("env", "source step", "append", "insert", "get", "sample", "update", "train", "plan")
    buffers = sum(timer.total_s(k) for k in ("append", "insert", "get", "sample", "update"))
    return {"mode": mode, "device": str(loop.source.device), "num_envs": loop.source.n_envs,
            "async": loop.source.is_async, "env_steps": log.env_steps, "wall_s": wall,
            "env_steps_per_s": log.env_steps / wall, "episodes": log.episodes,
            "last10_mean": log.last_mean(10), "reward_threshold": env.spec.reward_threshold,
            "solved_at": None if env.spec.reward_threshold is None else log.solved_at(env.spec.reward_threshold),
            "median_us": {k: timer.median_us(k) for k in names}, "total_s": {k: timer.total_s(k) for k in names},
            "buffers_over_env": buffers / max(timer.total_s("env"), 1e-12),
            "sizes": {"obs_shape": list(env.observation_space.shape), "history_bytes": history.nbytes,
                      "replay_capacity": loop.buffer.max_size, "replay_bytes": loop.buffer.nbytes,
                      "batch_size": loop.buffer.sample_batch_size, "n_steps": loop.buffer.n_steps}}


# ------------------------------------------------------------------ report


def curve_rows(result: dict, bins: int = 10) -> list[tuple[int, int, float, float]]:
    """``(env steps, episodes ended, their mean return, last-10 mean)`` at ``bins`` even points of the run."""
    episodes, rows = result["episodes"], []
    for k in range(1, bins + 1):
        end, start = result["env_steps"] * k // bins, result["env_steps"] * (k - 1) // bins
        inside = [r for s, r in episodes if start < s <= end]
        upto = [r for s, r in episodes if s <= end][-10:]
        rows.append((end, len(inside), float(np.mean(inside)) if inside else float("nan"),
                     float(np.mean(upto)) if upto else float("nan")))
    return rows


def summary_table(r: dict, env_id: str) -> str:
    """The report printed by ``gpubuf demo``: learning, timings, sizes, then the learning curve."""
    m, sizes = r["median_us"], r["sizes"]
    solved = "not reached" if r["solved_at"] is None else f"first at {r['solved_at']:,} env steps"
    threshold = "" if r["reward_threshold"] is None else f"; >= {r['reward_threshold']:g}: {solved}"
    rows = [
        ("task", f"{env_id} x {r['num_envs']} envs ({'async' if r['async'] else 'sync'}), {r['env_steps']} env steps"),
        ("mode", r["mode"]),
        ("device", r["device"]),
        ("env steps/s", f"{r['env_steps_per_s']:,.0f}  ({r['env_steps']} env steps in {r['wall_s']:.1f} s)"),
        ("return, last 10 episodes", f"{r['last10_mean']:.1f} ({len(r['episodes'])} episodes{threshold})"
         if r["episodes"] else "no episode ended"),
        ("env step (send+recv) median us", f"{m['env']:.0f}"),
        ("EnvPoolSource.step median us", f"{m['source step']:.0f}  (env + staging + history append + insert)"),
        *((f"{call} median us", f"{m[key]:.0f}") for call, key in (
            ("history append", "append"), ("replay insert", "insert"), ("history get", "get"),
            ("replay sample", "sample"), ("priority update", "update"), ("learner update", "train"),
            ("Planner.act", "plan"))),
        ("buffers / env time", f"{100 * r['buffers_over_env']:.1f} %"),
        ("sizes", f"obs {tuple(sizes['obs_shape'])}, history {sizes['history_bytes']:,} B, replay "
                  f"{sizes['replay_capacity']} transitions {sizes['replay_bytes']:,} B, batch {sizes['batch_size']} "
                  f"x {sizes['n_steps']} steps")]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines += ["", "learning curve:  env steps  episodes ended  their mean return  last-10 mean"]
    # "-": no episode ended yet
    number = lambda x, width: f"{'-' if np.isnan(x) else f'{x:.1f}':>{width}}"
    lines += [f"{'':16} {s:>10,} {n:>15} {number(mean, 18)} {number(last, 13)}" for s, n, mean, last in curve_rows(r)]
    return "\n".join(lines)


def write_plot(r: dict, env_id: str, path: str) -> None:
    """A PNG: episode returns against env steps (with the last-10 mean and the task's threshold) next to the median time
    of every timed call."""
    require("matplotlib", "the demo's plot").use("Agg")
    import matplotlib.pyplot as plt

    fig, (curve, bars) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    if r["episodes"]:
        steps, returns = np.array(r["episodes"]).T
        last10 = [returns[max(0, i - 9): i + 1].mean() for i in range(len(returns))]
        curve.scatter(steps, returns, s=6, alpha=0.35, label="episode return")
        curve.plot(steps, last10, color="C1", label="mean of the last 10 episodes")
    if r["reward_threshold"] is not None:
        curve.axhline(r["reward_threshold"], color="grey", ls="--", lw=1, label=f"threshold {r['reward_threshold']:g}")
    curve.set(xlabel="env steps", ylabel="return", title=f"{env_id} x {r['num_envs']} envs: {r['mode']}")
    curve.legend(loc="upper left", fontsize=8)
    names = list(r["median_us"])
    bars.barh(names, [r["median_us"][k] for k in names], color="C2")
    bars.invert_yaxis()
    bars.set_xscale("log")
    bars.set(xlabel="median microseconds per call (log scale)",
             title=f"timings on {r['device']} ({r['wall_s']:.0f} s wall)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
