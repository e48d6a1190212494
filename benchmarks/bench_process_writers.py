"""Actors in other processes against one process doing the same work: transitions per second into one buffer.

Each actor steps gymnasium's native vector CartPole (``ENVS`` envs, numpy, one thread) and inserts rows of
``T`` steps; the learner samples a batch of 256 between commits. Modes, each timed from when every actor is
ready (process start-up excluded) to when the last row is committed:

- ``one process``: the learner process steps all ``P * ENVS`` envs itself (``P`` vector envs, one after the
  other), inserts their ``T`` rows as one block of ``P * ENVS`` lanes and samples once per block, as a
  single-process loop does;
- ``P actor processes``: ``P`` spawned actors insert through ``buffer.writer(envs=...)`` handles (lanes of one
  vectorized buffer of ``P * ENVS`` envs) while the learner samples, which commits their rows;
- ``P Ray actors`` (``--ray``): the same actors as Ray actors of a local Ray instance, inserting through
  ``buffer.writer(envs=..., transport="ray")`` handles (their rows travel as Ray objects through the buffer's
  inbox actor).

Repeated ``--rounds`` times, modes interleaved; medians.

    python benchmarks/bench_process_writers.py            # -> results/process_writers_cpu.json
    python benchmarks/bench_process_writers.py --ray      # -> results/writers_ray_cpu.json (needs gpubuf[ray])
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp

from gpubuf import Transition, TransitionBuffer
from gpubuf.apps.benchmarking.timing import machine

ENVS, T, B = 16, 8, 256
ROWS = 64  # each writer's rows in flight (its queue), --rows


def make_env(seed: int):
    import gymnasium as gym

    env = gym.make_vec("CartPole-v1", num_envs=ENVS, vectorization_mode="vector_entry_point")
    obs, _ = env.reset(seed=seed)
    return env, obs


def block(env, obs, rng):
    """``T`` steps of one vector env as rows ``(T, ENVS, ...)``; returns ``(rows, obs)``."""
    o, a, r, te, tr = [], [], [], [], []
    for _ in range(T):
        action = rng.integers(0, 2, ENVS)
        nxt, reward, terminated, truncated, _ = env.step(action)
        o.append(obs), a.append(action), r.append(reward), te.append(terminated), tr.append(truncated)
        obs = nxt
    rows = Transition(observation=np.stack(o).astype(np.float32), action=np.stack(a),
                      reward=np.stack(r).astype(np.float32), terminated=np.stack(te), truncated=np.stack(tr))
    return rows, obs


def empty(E: int) -> Transition:
    return Transition(observation=np.zeros((1, E, 4), np.float32), action=np.zeros((1, E), np.int64),
                      reward=np.zeros((1, E), np.float32), terminated=np.zeros((1, E), bool),
                      truncated=np.zeros((1, E), bool))


def actor(writer, seed: int, blocks: int, flags) -> None:
    torch.set_num_threads(1)
    env, obs = make_env(seed)
    rng = np.random.default_rng(seed)
    flags[1 + seed] = 1  # ready
    while not flags[0]:
        time.sleep(0.001)
    for _ in range(blocks):
        rows, obs = block(env, obs, rng)
        writer.insert(rows, timeout=120)
    writer.close()


class RayActor:
    """:func:`actor` as a Ray actor: ready once its env is made, then :meth:`run` inserts through its writer."""

    def __init__(self, writer, seed: int):
        torch.set_num_threads(1)
        self.writer, self.seed, self.rng = writer, seed, np.random.default_rng(seed)
        self.env, self.obs = make_env(seed)

    def run(self, blocks: int) -> None:
        for _ in range(blocks):
            rows, self.obs = block(self.env, self.obs, self.rng)
            self.writer.insert(rows, timeout=120)
        self.writer.close()


def one_process(P: int, blocks: int) -> float:
    buf = TransitionBuffer(P * ENVS * 4096, B, empty(P * ENVS), seed=0)
    envs = [make_env(s) for s in range(P)]
    rngs = [np.random.default_rng(s) for s in range(P)]
    obs = [o for _, o in envs]
    t0 = time.perf_counter()
    for _ in range(blocks):
        parts = []
        for i, (env, _) in enumerate(envs):
            rows, obs[i] = block(env, obs[i], rngs[i])
            parts.append(rows)
        buf.insert(Transition(**{f: np.concatenate([getattr(r, f) for r in parts], axis=1)
                                 for f in ("observation", "action", "reward", "terminated", "truncated")}))
        if buf.num_valid() >= B:
            buf.sample()
    return P * ENVS * T * blocks / (time.perf_counter() - t0)


def learn_until(buf, want: int, t0: float) -> float:
    """The learner: sample (which commits what the actors published) until ``want`` transitions are in; the
    seconds since ``t0``."""
    while len(buf) < want:
        if buf.num_valid() >= B:
            buf.sample()
        else:
            buf.collect()
    return time.perf_counter() - t0


def actor_processes(P: int, blocks: int) -> float:
    ctx = mp.get_context("spawn")
    buf = TransitionBuffer(P * ENVS * 4096, B, empty(P * ENVS), seed=0)
    flags = torch.zeros(1 + P, dtype=torch.int64).share_memory_()
    procs = [ctx.Process(target=actor, args=(buf.writer(envs=range(i * ENVS, (i + 1) * ENVS), rows=ROWS), i, blocks,
                                             flags), daemon=True) for i in range(P)]
    for p in procs:
        p.start()
    while not all(flags[1:]):
        time.sleep(0.01)
    want = P * ENVS * T * blocks
    t0 = time.perf_counter()
    flags[0] = 1
    seconds = learn_until(buf, want, t0)
    for p in procs:
        p.join(30)
    return want / seconds


def ray_actors(P: int, blocks: int) -> float:
    import ray

    buf = TransitionBuffer(P * ENVS * 4096, B, empty(P * ENVS), seed=0)
    Actor = ray.remote(num_cpus=0)(RayActor)
    actors = [Actor.remote(buf.writer(envs=range(i * ENVS, (i + 1) * ENVS), rows=ROWS, transport="ray"), i)
              for i in range(P)]
    ray.get([a.__ray_ready__.remote() for a in actors])
    want = P * ENVS * T * blocks
    t0 = time.perf_counter()
    runs = [a.run.remote(blocks) for a in actors]
    seconds = learn_until(buf, want, t0)
    ray.get(runs)
    for a in actors:
        ray.kill(a)
    return want / seconds


MODES = {"one process": one_process, "actor processes": actor_processes, "Ray actors": ray_actors}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=300, help="inserts of T rows per actor")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--actors", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--rows", type=int, default=64, help="each writer's rows in flight (its queue's length)")
    p.add_argument("--ray", action="store_true", help="Ray actors as a third mode (a local Ray instance)")
    p.add_argument("--out", type=Path, default=None, help="default: results/process_writers_cpu.json, "
                   "with --ray results/writers_ray_cpu.json")
    args = p.parse_args()
    out = args.out or Path(__file__).parent / "results" / ("writers_ray_cpu.json" if args.ray else
                                                           "process_writers_cpu.json")
    torch.set_num_threads(1)
    global ROWS
    ROWS = args.rows
    modes = list(MODES)[:3 if args.ray else 2]
    if args.ray:
        import ray

        ray.init(include_dashboard=False, log_to_driver=False)
    runs: dict = {}
    for _ in range(args.rounds):
        for P in args.actors:
            for mode in modes:
                runs.setdefault((P, mode), []).append(MODES[mode](P, args.blocks))
    table = []
    print(f"| actors | envs | {' | '.join(f'{m} (transitions/s)' for m in modes)} | "
          f"{' | '.join(f'{m} / one process' for m in modes[1:])} |")
    for P in args.actors:
        rates = {m: statistics.median(runs[(P, m)]) for m in modes}
        row = {"actors": P, "envs": P * ENVS, **{m.replace(" ", "_") + "_per_s": r for m, r in rates.items()}}
        table.append(row)
        ratios = [rates[m] / rates["one process"] for m in modes[1:]]
        print(f"| {P} | {P * ENVS} | {' | '.join(f'{rates[m]:,.0f}' for m in modes)} | "
              f"{' | '.join(f'{r:.2f}' for r in ratios)} |", flush=True)
    out.write_text(json.dumps({"machine": machine(torch.device("cpu")), "envs_per_actor": ENVS,
                               "rows_per_insert": T, "rows_in_flight": ROWS, "batch": B, "blocks": args.blocks,
                               "rounds": args.rounds,
                               "table": table}, indent=1))


if __name__ == "__main__":
    main()
