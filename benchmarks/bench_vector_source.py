"""``VectorEnvSource.step`` against the raw gymnasium vector-env step it wraps (issue 27: within 1.5x at 1024 envs on
CPU), and the bytes each step stores against a buffer that also stores next observations.

Interleaved rounds, each timing ``--steps`` calls of every variant back to back on its own env (same construction,
same random actions), medians over the rounds:

- ``raw``: ``env.step(actions)``;
- ``source``: ``VectorEnvSource(env).step(actions)`` writing into a vectorized ``TransitionBuffer`` and a
  ``HistoryBuffer`` (NEXT_STEP rows);
- ``host-only``: the same source over a vector env that replays recorded outputs (no simulator): the source's own
  per-step cost;
- ``TensorSource``: its step on recorded torch tensors (no final observations, a vectorized buffer and a history).

Envs: CartPole-v1 through gymnasium's own vectorized implementation (``vector_entry_point``: numpy over all envs, the
cheapest raw step, so the strictest ratio) and through ``SyncVectorEnv`` (one Python env per slot); 84x84 frames from
ale-py's own Atari vector env (Pong, grayscale, one frame per observation; the bench extra installs ale-py), and
TensorSource on recorded 84x84 uint8 frames.

    python benchmarks/bench_vector_source.py                    # 16 and 1024 envs -> results/vector_source_cpu.json
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from gymnasium.vector import VectorEnv

from gpubuf import HistoryBuffer, TransitionBuffer
from gpubuf.apps.benchmarking.timing import machine
from gpubuf.sources.vector_env import VectorEnvSource


def make(mode: str, n: int):
    return gym.make_vec("CartPole-v1", n, vectorization_mode=mode)


class Replayed(VectorEnv):
    """A vector env that replays recorded ``step`` outputs of ``env`` (same spaces and metadata); no simulator."""

    def __init__(self, env, actions):
        self.num_envs, self.metadata = env.num_envs, env.metadata
        self.single_observation_space, self.single_action_space = env.single_observation_space, env.single_action_space
        self.observation_space, self.action_space = env.observation_space, env.action_space
        self._reset = env.reset(seed=0)
        self._steps = [env.step(a) for a in actions]
        self._i = 0

    def reset(self, *, seed=None, options=None):
        return self._reset

    def step(self, actions):
        out = self._steps[self._i % len(self._steps)]
        self._i += 1
        return out


def atari(n: int):
    """ale-py's Atari vector env of ``n`` Pong envs, 84x84 grayscale, one frame per observation (NEXT_STEP)."""
    try:
        from ale_py.vector_env import AtariVectorEnv
    except ImportError as e:
        raise SystemExit("the 84x84 rows need ale-py: pip install -e '.[bench]'") from e
    return AtariVectorEnv("pong", num_envs=n, stack_num=1)


def source_for(env, n, rows: int = 256):
    src = VectorEnvSource(env, device="cpu")
    src.history = HistoryBuffer(n, 8, device="cpu")
    src.transitions = TransitionBuffer(n * rows, 256, src.transition_sample(), device="cpu", seed=0)
    src.reset(seed=0)
    return src


def row_bytes(buf, with_next_obs: bool) -> int:
    """Bytes one env's row takes in ``buf`` (plus one more observation when next observations are stored too)."""
    data = buf.state_dict()["data"]
    per_row = {k: v[0, 0].numel() * v.element_size() for k, v in data.items()}
    return sum(per_row.values()) + (per_row["observation"] if with_next_obs else 0)


def bench(label: str, make_env, n: int, steps: int, rounds: int, rows: int = 256) -> dict:
    """Interleaved rounds of the raw step, the source's step and the source on replayed outputs, all on one env of
    ``n`` sub-envs made by ``make_env()`` (discrete actions; one env, as a 1024-env Atari vector env takes minutes to
    build: the source's rows are not checked here, only timed)."""
    env = make_env()
    rng = np.random.default_rng(0)
    actions = [rng.integers(0, env.single_action_space.n, n) for _ in range(steps)]
    host = source_for(Replayed(env, actions), n, rows)  # records its outputs from env
    raw, src = env, source_for(env, n, rows)
    calls = {"raw": raw.step, "source": src.step, "host-only": host.step}
    times = {k: [] for k in calls}
    for r in range(rounds):
        order = list(calls)[r % 3:] + list(calls)[:r % 3]
        for name in order:
            fn = calls[name]
            t0 = time.perf_counter()
            for a in actions:
                fn(a)
            times[name].append((time.perf_counter() - t0) / steps * 1e6)
    med = {k: statistics.median(v) for k, v in times.items()}
    buf = src.transitions
    env.close()
    return {"env": label, "num_envs": n, "raw_us": med["raw"], "source_us": med["source"],
            "host_only_us": med["host-only"], "ratio": med["source"] / med["raw"],
            "bytes_per_env_step": row_bytes(buf, False), "bytes_with_next_obs": row_bytes(buf, True)}


def bench_tensors(n: int, steps: int, rounds: int, frames: bool = False) -> dict:
    """``TensorSource.step`` (no final observations, a vectorized buffer and a history) on recorded torch tensors of
    ``n`` CartPole-sized envs (``frames``: 84x84 uint8 frames): the source's whole cost per simulator step."""
    from gpubuf.sources.tensors import TensorSource

    shape = (84, 84) if frames else (4,)
    obs_space = gym.spaces.Box(0, 255, shape, np.uint8) if frames else gym.spaces.Box(-np.inf, np.inf, shape,
                                                                                       np.float32)
    src = TensorSource(n, obs_space, gym.spaces.Discrete(2), final_obs=False, device="cpu")
    src.history = HistoryBuffer(n, 8, device="cpu")
    src.transitions = TransitionBuffer(n * (32 if frames else 256), 256, src.transition_sample(), device="cpu", seed=0)
    g = torch.Generator().manual_seed(0)

    def obs():
        return torch.randint(0, 256, (n, *shape), generator=g, dtype=torch.uint8) if frames else torch.rand(
            n, *shape, generator=g)

    src.reset(obs())
    recorded = [(torch.randint(0, 2, (n,), generator=g), obs(), torch.rand(n, generator=g),
                 torch.rand(n, generator=g) < 0.01, torch.rand(n, generator=g) < 0.005) for _ in range(steps)]
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for step in recorded:
            src.step(*step)
        times.append((time.perf_counter() - t0) / steps * 1e6)
    buf = src.transitions
    label = "84x84 uint8 frames" if frames else "4 float32"
    return {"env": f"TensorSource (torch tensors, {label}, no final obs)", "num_envs": n, "raw_us": None,
            "source_us": statistics.median(times), "host_only_us": statistics.median(times), "ratio": None,
            "bytes_per_env_step": row_bytes(buf, False), "bytes_with_next_obs": row_bytes(buf, True)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "vector_source_cpu.json")
    p.add_argument("--atari-envs", type=int, nargs="*", default=[16, 256],
                   help="sizes of the Atari rows (a 1024-env ALE vector env takes many minutes to build on 2 cores)")
    args = p.parse_args()
    rows = []
    for mode, n in (("vector_entry_point", 16), ("vector_entry_point", 1024), ("sync", 16), ("sync", 1024)):
        rows.append(bench(f"CartPole-v1 ({mode})", lambda mode=mode, n=n: make(mode, n), n,
                          args.steps if n < 1024 or mode != "sync" else max(5, args.steps // 5), args.rounds))
        show(rows[-1], rows, args)
    for frames in (False, True):
        for n in (16, 1024):
            rows.append(bench_tensors(n, args.steps, args.rounds, frames))
            show(rows[-1], rows, args)
    for n in args.atari_envs:  # a 256-env Atari step takes ~60 ms on 2 cores: fewer steps and rounds
        rows.append(bench("Pong 84x84 (ale-py AtariVectorEnv)", lambda n=n: atari(n), n,
                          args.steps if n <= 16 else max(5, args.steps // 5),
                          args.rounds if n <= 16 else max(5, args.rounds // 2), rows=32))
        show(rows[-1], rows, args)


def show(r: dict, rows: list, args) -> None:
    """Print a row; write every row so far to ``args.out``."""
    args.out.write_text(json.dumps({"meta": machine(torch.device("cpu")), "steps": args.steps, "rounds": args.rounds,
                                    "command": "python benchmarks/bench_vector_source.py", "rows": rows}, indent=1))
    raw, ratio = ("-", "-") if r["raw_us"] is None else (f"{r['raw_us']:.0f}", f"{r['ratio']:.2f}")
    print(f"| {r['env']} | {r['num_envs']} | {raw} | {r['source_us']:.0f} | {ratio} | {r['host_only_us']:.0f} | "
          f"{r['bytes_per_env_step']} | {r['bytes_with_next_obs']} |", flush=True)


if __name__ == "__main__":
    main()
