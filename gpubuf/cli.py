"""The ``gpubuf`` command. ``gpubuf demo``: EnvPool envs -> planner histories -> PER learner, timed.

Every env step goes through :class:`~gpubuf.envpool.EnvPoolSource` into a prioritized replay
buffer; a :class:`~gpubuf.planning.Planner` picks the actions from per-env histories (CEM over CartPole's
own equations for ``CartPole-v1``, uniform random plans for other tasks); a linear Q-learner samples PER
batches and updates their priorities. Prints a summary table and writes the numbers as JSON.
"""

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
import warnings
from collections import defaultdict

import numpy as np
import torch


class OneLineParser(argparse.ArgumentParser):
    """Errors are one line on stderr and exit code 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


class Timer:
    """Wraps callables to record their wall time (device-synchronised on CUDA) under a name."""

    def __init__(self, device: torch.device):
        self.samples: dict[str, list[float]] = defaultdict(list)
        self._sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def wrap(self, fn, name: str):
        def timed(*args, **kwargs):
            self._sync()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self._sync()
            self.samples[name].append(time.perf_counter() - t0)
            return out

        return timed

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


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="gpubuf", description="GPU-resident history and replay buffers for RL.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    demo = commands.add_parser("demo", help="EnvPool envs -> planner histories -> PER learner, timed")
    demo.add_argument("--env", default="CartPole-v1", help="EnvPool task id (default: CartPole-v1)")
    demo.add_argument("--num-envs", type=int, default=16, help="parallel envs (default: 16)")
    demo.add_argument("--steps", type=int, default=500, help="env batches to step (default: 500)")
    demo.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    demo.add_argument("--async", dest="async_", action="store_true", help="async EnvPool: batch_size = num_envs/2")
    demo.add_argument("--out", default="gpubuf_demo.json", help="JSON file for the numbers")
    demo.add_argument("--seed", type=int, default=0)
    parser.demo = demo  # check_args reports through it
    return parser


def check_args(parser, args) -> torch.device:
    """Validate what argparse cannot, before any work; returns the device."""
    try:
        import envpool
    except ImportError as err:
        parser.demo.error(f"the demo steps EnvPool envs: pip install envpool ({err})")

    parser = parser.demo

    if args.env not in envpool.list_all_envs():
        parser.error(f"--env: unknown EnvPool task {args.env!r} (envpool.list_all_envs() lists them)")
    if args.num_envs < 1 or (args.async_ and args.num_envs < 2):
        parser.error(f"--num-envs: expected at least {2 if args.async_ else 1}, got {args.num_envs}")
    if args.steps < 1:
        parser.error(f"--steps: expected a positive int, got {args.steps}")
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError) as err:
        parser.error(f"--device: cannot use {args.device!r} ({str(err).splitlines()[0]})")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir) or not os.access(out_dir, os.W_OK):
        parser.error(f"--out: cannot write {args.out!r} (no writable directory {out_dir!r})")
    return device


def progress(done: int, total: int, env_steps: int, elapsed: float) -> None:
    """A progress bar redrawn in place on a terminal; in a log (stderr not a terminal), one plain line at
    the end only."""
    rate = env_steps / max(elapsed, 1e-9)
    if not sys.stderr.isatty():
        if done == total:
            sys.stderr.write(f"{done}/{total} steps  {rate:,.0f} env steps/s\n")
        return
    width = 30
    filled = width * done // total
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} steps  {rate:,.0f} env steps/s")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def make_policy(task: str, space, horizon: int, seed: int):
    """``(solver, action_dim, to_env)``: CEM over CartPole's own equations for ``CartPole-v1``, else uniform
    random plans in ``[0, 1)`` mapped onto the action space; ``to_env`` turns planner actions into env actions."""
    from gpubuf.planning import CEMSolver, cartpole_cost, cartpole_dynamics

    if task == "CartPole-v1":
        solver = CEMSolver(cartpole_dynamics, cartpole_cost, horizon, 1, num_samples=64, num_elites=8, seed=seed)
        return solver, 1, lambda a: (a[:, 0] > 0).cpu().numpy().astype(np.int32)
    discrete = hasattr(space, "n")
    dim = 1 if discrete else int(np.prod(space.shape))
    gen = torch.Generator().manual_seed(seed)
    solver = lambda history, ids: torch.rand(len(ids), horizon, dim, generator=gen)
    if discrete:
        return solver, dim, lambda a: np.minimum(a[:, 0].cpu().numpy() * space.n, space.n - 1).astype(np.int32)
    return solver, dim, lambda a: (space.low + a.cpu().numpy().reshape(-1, *space.shape) * (space.high - space.low))


def demo(args, device: torch.device) -> dict:
    """Run the loop; returns the numbers of the summary."""
    import envpool

    from gpubuf.envpool import EnvPoolSource
    from gpubuf.planning import PlanConfig, Planner
    from gpubuf.prioritized import PrioritizedTransitionBuffer

    torch.manual_seed(args.seed)
    timer = Timer(device)
    batch = args.num_envs // 2 if args.async_ else args.num_envs
    env = envpool.make(args.env, env_type="gymnasium", num_envs=args.num_envs, batch_size=batch, seed=args.seed)
    obs_key = "pixels" if len(env.observation_space.shape) >= 3 else "observation"
    source = EnvPoolSource(TimedEnv(env, timer), obs_key=obs_key, device=device)
    config = PlanConfig(horizon=8, receding_horizon=4, action_block=1, history_len=4)
    solver, action_dim, to_env = make_policy(args.env, env.action_space, config.horizon, args.seed)
    planner = Planner(config, solver, args.num_envs, action_dim, device=device)
    capacity, batch_size = args.num_envs * 64, 32
    per = PrioritizedTransitionBuffer(capacity, batch_size, source.transition_sample(vectorized=not args.async_),
                                      vectorized_env=not args.async_, device=device, seed=args.seed)
    source.transitions = per
    learner = ValueLearner(int(np.prod(env.observation_space.shape)), device)
    # time the buffer operations where they happen (instance attributes shadow the methods)
    source._receive = timer.wrap(source._receive, "stage+insert")
    for obj, name, label in ((planner.history, "append", "append"), (planner.history, "get", "get"),
                             (per, "insert", "insert"), (per, "sample", "sample"),
                             (per, "update_priorities", "update")):
        setattr(obj, name, timer.wrap(getattr(obj, name), label))

    with_next_obs = not args.async_  # the row layout of async mode stores next observations
    t0 = time.perf_counter()
    step = source.reset()
    env_steps = 0
    for i in range(1, args.steps + 1):
        actions = planner.act(step.info, step.env_ids, step.first)
        step = source.step(to_env(actions), step.env_ids)
        env_steps += len(step.env_ids)
        if per.num_valid(with_next_obs) >= batch_size:
            learner.update(per, with_next_obs)
        if i == args.steps or i % max(1, args.steps // 20) == 0:
            progress(i, args.steps, env_steps, time.perf_counter() - t0)
    wall = time.perf_counter() - t0
    ops = ("env", "stage+insert", "insert", "append", "get", "sample", "update")
    buffers = sum(timer.total_s(k) for k in ("stage+insert", "append", "get", "sample", "update"))
    return {
        "env": args.env, "num_envs": args.num_envs, "async": args.async_, "steps": args.steps,
        "device": str(device), "env_steps": env_steps, "wall_s": wall, "env_steps_per_s": env_steps / wall,
        "median_us": {k: timer.median_us(k) for k in ops},
        "total_s": {k: timer.total_s(k) for k in ops},
        "buffers_over_env": buffers / max(timer.total_s("env"), 1e-12),
        "sizes": {"obs_shape": list(env.observation_space.shape), "obs_key": obs_key,
                  "history_bytes": planner.history.nbytes, "per_capacity": capacity, "per_bytes": per.nbytes,
                  "batch_size": batch_size, "plan": dataclasses.asdict(config)},
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
                     "envpool": envpool.__version__, "machine": platform.machine(), "cpu_threads":
                     torch.get_num_threads()},
    }


class ValueLearner:
    """A linear state-value function trained by TD(0) on PER batches; the TD errors become priorities."""

    def __init__(self, obs_size: int, device: torch.device, lr: float = 0.1, gamma: float = 0.99):
        self.w = torch.zeros(obs_size, device=device)
        self._batch = None
        self.lr, self.gamma = lr / obs_size, gamma

    def update(self, per, with_next_obs: bool) -> None:
        batch, idx = per.sample(with_next_obs=with_next_obs, out=self._batch)
        self._batch = batch  # the next sample writes into the same tensors (no allocation)
        B = batch.reward.shape[0]
        scale = 1 / 255 if batch.observation.dtype == torch.uint8 else 1.0
        x = batch.observation.reshape(B, -1).float() * scale  # (B, obs)
        x_next = batch.next_observation.reshape(B, -1).float() * scale
        target = batch.reward.float() + self.gamma * (x_next @ self.w) * (~batch.terminated.bool())
        td = target - x @ self.w  # (B,)
        self.w += self.lr * (batch.PER_weights.float() * td) @ x
        per.update_priorities(idx, td)


def summary_table(r: dict) -> str:
    m, sizes = r["median_us"], r["sizes"]
    rows = [
        ("task", f"{r['env']} x {r['num_envs']} envs ({'async' if r['async'] else 'sync'}), {r['steps']} steps"),
        ("device", r["device"]),
        ("env steps/s", f"{r['env_steps_per_s']:,.0f}  ({r['env_steps']} env steps in {r['wall_s']:.2f} s)"),
        ("env step (send+recv) median us", f"{m['env']:.0f}"),
        ("stage + PER insert median us", f"{m['stage+insert']:.0f}  (insert alone {m['insert']:.0f})"),
        ("history append median us", f"{m['append']:.0f}"),
        ("history get median us", f"{m['get']:.0f}"),
        ("PER sample median us", f"{m['sample']:.0f}"),
        ("PER update median us", f"{m['update']:.0f}"),
        ("buffers / env time", f"{100 * r['buffers_over_env']:.1f} %"),
        ("sizes", f"obs {tuple(sizes['obs_shape'])}, history {sizes['history_bytes']:,} B, PER "
                  f"{sizes['per_capacity']} transitions {sizes['per_bytes']:,} B, batch {sizes['batch_size']}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv=None) -> int:
    warnings.filterwarnings("ignore", message=".*precision lowered by casting.*")  # envpool's Box spaces
    parser = build_parser()
    args = parser.parse_args(argv)
    device = check_args(parser, args)
    result = demo(args, device)
    print(summary_table(result))
    try:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    except OSError as err:
        parser.demo.error(f"--out: cannot write {args.out!r} ({err.strerror})")
    print(f"numbers written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
