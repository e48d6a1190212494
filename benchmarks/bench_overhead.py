"""Host overhead per call of every buffer op at small sizes, in microseconds and in units of one trivial
torch op dispatch measured in the same run.

Sizes: 16 envs, CartPole-sized observations (4 float32), batch 32, 16k capacity (1024 rows x 16 envs),
history get(4) with action_block 1. The unit is the mean time of 8 trivial ops on 16-element tensors (add,
mul, sub with out=, index_select, empty, copy_, fill_, a slice). Ops run interleaved in rotating order
(:func:`gpubuf.benchmarking.timing.median_us`), one thread, median of many repeats; the trees are built
before timing.

    python benchmarks/bench_overhead.py            # -> results/overhead_cpu.json and a markdown table
"""

import argparse
import json
import platform
from pathlib import Path

import numpy as np
import torch

import gpubuf
from gpubuf import HistoryBuffer, PrioritizedTransitionBuffer, Transition, TransitionBuffer
from gpubuf.benchmarking.timing import median_us, syncer

E, OBS, B, ROWS = 16, 4, 32, 1024
TARGETS = {"history append": 15, "history get(4)": 15, "replay insert": 15, "PER insert": 15,
           "uniform sample": 20, "PER sample": 20, "PER update": 20, "PER sample without replacement": 40}


def trivial_ops(device):
    a, b, out = (torch.rand(16, device=device) for _ in range(3))
    idx = torch.arange(8, device=device)
    return [lambda: torch.add(a, b, out=out), lambda: torch.mul(a, b, out=out), lambda: torch.sub(a, b, out=out),
            lambda: torch.index_select(a, 0, idx), lambda: torch.empty(16, device=device),
            lambda: out.copy_(a), lambda: out.fill_(1.0), lambda: a[2:10]]


def rollout(T, rng):
    return Transition(observation=rng.standard_normal((T, E, OBS)).astype(np.float32),
                      action=rng.integers(0, 2, (T, E)).astype(np.int64), reward=np.ones((T, E), np.float32),
                      terminated=np.zeros((T, E), bool), truncated=np.zeros((T, E), bool))


def cases(device):
    rng = np.random.default_rng(0)
    hist = HistoryBuffer(E, 8, 1, ("action",), device=device)
    info = {"observation": rng.standard_normal((E, 1, OBS)).astype(np.float32),
            "action": np.zeros((E, 1, 1), np.float32)}
    for _ in range(8):
        hist.append(info)
    uni = TransitionBuffer(E * ROWS, B, rollout(1, rng), device=device, seed=0)
    per = PrioritizedTransitionBuffer(E * ROWS, B, rollout(1, rng), device=device, seed=0)
    one = rollout(1, rng)
    for buf in (uni, per):
        buf.insert(rollout(ROWS, rng))
        buf.sample(with_next_obs=True)  # trees built
    idx = np.arange(B, dtype=np.int64)
    td = rng.random(B).astype(np.float32)
    cfg = gpubuf.PlanConfig(horizon=4, receding_horizon=1, history_len=2)
    planner = gpubuf.Planner(cfg, lambda history, ids: torch.zeros(len(ids), 4, 1, device=device), E, 1,
                             device=device)
    step = {"observation": torch.zeros(E, 1, OBS, device=device), "action": torch.zeros(E, 1, 1, device=device)}
    return {
        "history append": lambda: hist.append(info),
        "history get(4)": lambda: hist.get(4),
        "replay insert": lambda: uni.insert(one),
        "PER insert": lambda: per.insert(one),
        "uniform sample": lambda: uni.sample(with_next_obs=True),
        "PER sample": lambda: per.sample(with_replacement=True, with_next_obs=True),
        "PER sample without replacement": lambda: per.sample(with_next_obs=True),
        "PER update": lambda: per.update_priorities(idx, td),
        "Planner.act (trivial model)": lambda: planner.act(step),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=400)
    args = p.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    ops = cases(device)
    trivial = trivial_ops(device)
    ops["trivial op (unit)"] = lambda: [f() for f in trivial]
    med = median_us(ops, args.repeats, 1, syncer(device), skip=0)  # one timed call of each op per round
    unit = med.pop("trivial op (unit)") / len(trivial)
    rows = [{"op": k, "us": v, "units": v / unit, "target_units": TARGETS.get(k)} for k, v in med.items()]
    meta = {"machine": platform.processor() or platform.machine(), "device": str(device), "torch": torch.__version__,
            "threads": 1, "repeats": args.repeats, "unit_us": unit}
    out = Path(__file__).parent / "results" / f"overhead_{device.type}.json"
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"host overhead on {device}, torch {torch.__version__}, 1 thread, median of {args.repeats}; "
          f"unit = one trivial op = {unit:.2f} us")
    print("\n| op | us | units | target (units) |\n|---|---:|---:|---:|")
    for r in rows:
        t = r["target_units"]
        mark = "" if t is None else (" (met)" if r["units"] <= t else " (not met)")
        print(f"| {r['op']} | {r['us']:.0f} | {r['units']:.1f} | {t if t else '-'}{mark} |")


if __name__ == "__main__":
    main()
