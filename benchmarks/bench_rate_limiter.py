"""What a ``RateLimiter`` costs per call: ``insert`` and ``sample`` of one buffer without a limiter, with
``RateLimiter.min_size`` and with ``RateLimiter.sample_to_insert_ratio`` (a band wide enough that no call waits,
so the numbers are the limiter's bookkeeping, not waiting), interleaved in one run, medians.

Sizes: 16 envs, CartPole-sized rows (4 float32), an insert of one time row (16 transitions), a sample of 32
windows; 16k capacity. One thread.

    python benchmarks/bench_rate_limiter.py                  # -> results/rate_limiter_cpu.json
"""

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from gpubuf import RateLimiter, Transition, TransitionBuffer
from gpubuf.apps.benchmarking.timing import machine, median_us

E, B = 16, 32


def rows(T: int) -> Transition:
    return Transition(observation=np.random.rand(T, E, 4).astype(np.float32), action=np.zeros((T, E), np.float32),
                      reward=np.zeros((T, E), np.float32), terminated=np.zeros((T, E), bool),
                      truncated=np.zeros((T, E), bool))


def buffers() -> dict:
    wide = 1e15  # never waits: the limiter's bookkeeping alone
    limiters = {"none": None, "min_size": RateLimiter.min_size(64),
                "ratio": RateLimiter.sample_to_insert_ratio(2.0, 64, wide)}
    out = {}
    for name, limiter in limiters.items():
        buf = TransitionBuffer(E * 1024, B, rows(1), device="cpu", seed=0, rate_limiter=limiter)
        buf.insert(rows(512))
        out[name] = buf
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2000)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "rate_limiter_cpu.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    bufs, row = buffers(), rows(1)
    fns = {}
    for name, buf in bufs.items():
        fns[f"insert/{name}"] = lambda buf=buf: buf.insert(row)
        fns[f"sample/{name}"] = lambda buf=buf: buf.sample()
    us = median_us(fns, args.repeats)
    table = []
    for call in ("insert", "sample"):
        base = us[f"{call}/none"]
        for name in ("none", "min_size", "ratio"):
            t = us[f"{call}/{name}"]
            table.append({"call": call, "limiter": name, "us": t, "overhead_us": t - base, "ratio": t / base})
            print(f"| {call} | {name} | {t:.1f} | {t - base:+.1f} | {t / base:.3f} |", flush=True)
    args.out.write_text(json.dumps({"meta": machine(torch.device("cpu")), "repeats": args.repeats,
                                    "command": "python benchmarks/bench_rate_limiter.py", "rows": table}, indent=1))


if __name__ == "__main__":
    main()
