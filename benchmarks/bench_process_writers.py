"""Actors in other processes against one process doing the same work: transitions per second into one buffer.

Each actor steps gymnasium's native vector CartPole (``ENVS`` envs, numpy, one thread) and inserts rows of
``T`` steps; the learner samples a batch of 256 between commits. Modes, each timed from when every actor is
ready (process start-up excluded) to when the last row is committed:

- ``one process``: the learner process steps all ``P * ENVS`` envs itself (``P`` vector envs, one after the
  other), inserts their ``T`` rows as one block of ``P * ENVS`` lanes and samples once per block, as a
  single-process loop does;
- ``P actor processes``: ``P`` spawned actors insert through ``buffer.writer(envs=...)`` handles (lanes of one
  vectorized buffer of ``P * ENVS`` envs) while the learner samples, which commits their rows.

Repeated ``--rounds`` times, modes interleaved; medians.

    python benchmarks/bench_process_writers.py            # -> results/process_writers_cpu.json
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


def actor_processes(P: int, blocks: int) -> float:
    ctx = mp.get_context("spawn")
    buf = TransitionBuffer(P * ENVS * 4096, B, empty(P * ENVS), seed=0)
    flags = torch.zeros(1 + P, dtype=torch.int64).share_memory_()
    procs = [ctx.Process(target=actor, args=(buf.writer(envs=range(i * ENVS, (i + 1) * ENVS), rows=64), i, blocks,
                                             flags), daemon=True) for i in range(P)]
    for p in procs:
        p.start()
    while not all(flags[1:]):
        time.sleep(0.01)
    want = P * ENVS * T * blocks
    t0 = time.perf_counter()
    flags[0] = 1
    while len(buf) < want:
        if buf.num_valid() >= B:
            buf.sample()  # commits what the actors published
        else:
            buf.collect()
    seconds = time.perf_counter() - t0
    for p in procs:
        p.join(30)
    return want / seconds


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=300, help="inserts of T rows per actor")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--actors", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "process_writers_cpu.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    runs: dict = {}
    for _ in range(args.rounds):
        for P in args.actors:
            for mode, fn in (("one process", one_process), ("actor processes", actor_processes)):
                runs.setdefault((P, mode), []).append(fn(P, args.blocks))
    table = []
    print("| actors | envs | one process (transitions/s) | actor processes (transitions/s) | speed-up |")
    for P in args.actors:
        one, many = (statistics.median(runs[(P, m)]) for m in ("one process", "actor processes"))
        table.append({"actors": P, "envs": P * ENVS, "one_process_per_s": one, "actor_processes_per_s": many,
                      "speedup": many / one})
        print(f"| {P} | {P * ENVS} | {one:,.0f} | {many:,.0f} | {many / one:.2f} |", flush=True)
    args.out.write_text(json.dumps({"machine": machine(torch.device("cpu")), "envs_per_actor": ENVS,
                                    "rows_per_insert": T, "batch": B, "blocks": args.blocks, "rounds": args.rounds,
                                    "table": table},
                                   indent=1))


if __name__ == "__main__":
    main()
