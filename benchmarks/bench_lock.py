"""What the per-buffer lock costs a steady-state call, in one process: each public call against the
same method body called without the lock (under ``torch.compiler.disable`` like the public one),
interleaved in alternating order, 50 calls per sample, median of 300 samples each. One thread,
CPU, the sizes of ``bench_overhead.py`` (16 envs, CartPole-sized rows, batch 32).

    python benchmarks/bench_lock.py          # -> results/lock_cpu.json and a markdown table
"""

import json
import statistics
import time
import types
from pathlib import Path

import numpy as np
import torch

from gpubuf import HistoryBuffer, PrioritizedTransitionBuffer, Transition, TransitionBuffer, Unit
from gpubuf.apps.benchmarking.timing import machine

E, CALLS, SAMPLES = 16, 50, 300


def rows(T: int) -> Transition:
    return Transition(observation=np.random.rand(T, E, 4).astype(np.float32),
                      action=np.zeros((T, E), np.int64), reward=np.zeros((T, E), np.float32),
                      terminated=np.zeros((T, E), bool), truncated=np.zeros((T, E), bool))


def without_lock(obj, cls, name: str):
    """``obj.name`` without the lock: the method under the lock's wrapper, disabled for Dynamo as
    the public one is."""
    body = getattr(cls, name).__wrapped__.__wrapped__  # torch.compiler.disable -> locked -> body
    return types.MethodType(torch.compiler.disable(body), obj)


def cases() -> dict:
    hist = HistoryBuffer(E, 1024, device="cpu")
    info = {"obs": np.zeros((E, 1, 4), np.float32), "action": np.zeros((E, 1, 2), np.float32)}
    for _ in range(10):
        hist.append(info)
    uni = TransitionBuffer(E * 1024, 32, rows(1), device="cpu", seed=0)
    uni.insert(rows(1024))
    per = PrioritizedTransitionBuffer(E * 1024, 32, rows(1), device="cpu", seed=0)
    per.insert(rows(1024))
    idx = per.sample(unit=Unit.window()).indices
    td, one = torch.rand(32), rows(1)
    bare = {name: without_lock(obj, type(obj), name)
            for obj, name in ((hist, "append"), (hist, "get"), (uni, "insert"), (uni, "sample"),
                              (per, "update_priorities"))}
    return {"history append": (lambda: hist.append(info), lambda: bare["append"](info)),
            "history get(4)": (lambda: hist.get(4), lambda: bare["get"](4)),
            "replay insert": (lambda: uni.insert(one), lambda: bare["insert"](one)),
            "uniform sample": (lambda: uni.sample(), lambda: bare["sample"]()),
            "PER update": (lambda: per.update_priorities(idx, td),
                           lambda: bare["update_priorities"](idx, td))}


def main():
    torch.set_num_threads(1)
    rows_out = []
    for call, (locked, bare) in cases().items():
        timed = {"locked": [], "bare": []}
        for r in range(SAMPLES):
            order = (("bare", bare), ("locked", locked)) if r % 2 else (("locked", locked),
                                                                        ("bare", bare))
            for who, fn in order:
                fn()
                t0 = time.perf_counter()
                for _ in range(CALLS):
                    fn()
                timed[who].append((time.perf_counter() - t0) / CALLS * 1e6)
        lk, br = statistics.median(timed["locked"]), statistics.median(timed["bare"])
        rows_out.append({"op": call, "without_lock_us": br, "with_lock_us": lk,
                         "lock_us": lk - br, "ratio": lk / br})
    out = Path(__file__).parent / "results" / "lock_cpu.json"
    out.write_text(json.dumps({"meta": {**machine(torch.device("cpu")), "torch": torch.__version__,
                                        "calls_per_sample": CALLS, "samples": SAMPLES},
                               "rows": rows_out}, indent=1))
    print("| call | without the lock us | with it us | lock us | ratio |\n|---|---:|---:|---:|---:|")
    for r in rows_out:
        print(f"| {r['op']} | {r['without_lock_us']:.2f} | {r['with_lock_us']:.2f} | "
              f"{r['lock_us']:+.2f} | {r['ratio']:.3f} |")


if __name__ == "__main__":
    main()
