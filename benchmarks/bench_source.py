"""``EnvPoolSource.step`` against the raw envpool step it wraps (issue 20: within 2x on CPU).

Interleaved rounds, each timing ``--steps`` calls of every variant back to back on its own env
(same env, same count, same random actions), medians over the rounds:

- ``raw``: ``env.step(actions)`` of ``envpool.make(task, env_type="gymnasium")``;
- ``source``: ``EnvPoolSource(env, device=...).step(actions)``, no buffer attached;
- ``source+history``: the same with a ``HistoryBuffer`` attached (for information);
- ``host-only``: the source over a stub env that replays recorded EnvPool outputs (no simulator,
  no worker threads): the source's own per-step host cost, less sensitive to a busy machine than
  the ratio (envpool's thread hand-off dominates the raw step).

    python benchmarks/bench_source.py                      # Pendulum-v1 x 8, CPU
    python benchmarks/bench_source.py --task CartPole-v1 --num-envs 16 --rounds 51
    git show HEAD~1:gpubuf/envpool.py > /tmp/old.py
    python benchmarks/bench_source.py --compare /tmp/old.py    # adds "source@old.py" (no buffer)
"""

import argparse
import importlib.util
import statistics
import time

import envpool
import numpy as np
import torch

from gpubuf import HistoryBuffer
from gpubuf.sources.envpool import EnvPoolSource


def make(task, n):
    return envpool.make(task, env_type="gymnasium", num_envs=n, batch_size=n, seed=0)


def actions_for(env, n, rng, count):
    space = env.action_space
    if hasattr(space, "n"):
        return [rng.integers(0, space.n, size=n).astype(np.int32) for _ in range(count)]
    lo, hi = np.broadcast_to(space.low, space.shape), np.broadcast_to(space.high, space.shape)
    return [rng.uniform(lo, hi, size=(n, *space.shape)).astype(space.dtype) for _ in range(count)]


class _Replay:
    """A stand-in for an envpool env: replays recorded ``step`` outputs, sends go nowhere."""

    def __init__(self, env, steps):
        self.config, self.spec = env.config, env.spec
        self.action_space, self.observation_space = env.action_space, env.observation_space
        self._reset = env.reset()
        self._steps = [env.step(a) for a in steps]
        self._i = 0

    def reset(self):
        return self._reset

    def send(self, action, env_id=None):
        pass

    def recv(self):
        self._i = (self._i + 1) % len(self._steps)
        return self._steps[self._i]


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="Pendulum-v1")
    p.add_argument("--num-envs", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=41)
    p.add_argument("--steps", type=int, default=200, help="timed steps per variant per round")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--compare", default=None,
                   help="another gpubuf/envpool.py (e.g. from git show) timed as a further variant")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    n, rng = args.num_envs, np.random.default_rng(0)

    raw_env = make(args.task, n)
    raw_env.reset()
    src = EnvPoolSource(make(args.task, n), device=args.device)
    src.reset()
    hist_env = make(args.task, n)
    hsrc = EnvPoolSource(hist_env, device=args.device)
    hsrc.history = HistoryBuffer(n, 64, device=args.device)
    hsrc.reset()
    acts = actions_for(raw_env, n, rng, args.steps)

    stub = EnvPoolSource(_Replay(make(args.task, n), acts), device=args.device)
    stub.reset()
    variants = {"raw": raw_env.step, "source": src.step, "source+history": hsrc.step,
                "host-only": stub.step}
    if args.compare:
        spec = importlib.util.spec_from_file_location("envpool_compare", args.compare)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        other = mod.EnvPoolSource(make(args.task, n), device=args.device)
        other.reset()
        name = args.compare.rsplit("/", 1)[-1]
        variants[f"source@{name}"] = other.step
        other = mod.EnvPoolSource(_Replay(make(args.task, n), acts), device=args.device)
        other.reset()
        variants[f"host-only@{name}"] = other.step
    times = {k: [] for k in variants}
    for fn in variants.values():  # warm-up
        for a in acts[:20]:
            fn(a)
    for r in range(args.rounds):
        order = list(variants.items())
        if r % 2:
            order.reverse()
        for name, fn in order:
            t0 = time.perf_counter()
            for a in acts:
                fn(a)
            times[name].append((time.perf_counter() - t0) / len(acts))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.task} x {n}, device {args.device}, {args.rounds} interleaved rounds of "
          f"{args.steps} steps, medians per step:")
    for k, v in med.items():
        print(f"  {k:28s} {v * 1e3:8.4f} ms   {v / med['raw']:5.2f}x raw")
    print(f"host-only overhead per step: {med['host-only'] * 1e6:.1f} us")
    print(f"ratio source/raw = {med['source'] / med['raw']:.2f} (target <= 2)")


if __name__ == "__main__":
    main()
