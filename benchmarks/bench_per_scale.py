"""Prioritized replay at capacity 2**20 against cpprb, on the CPU: insert, sample and update_priorities.

gpubuf's PrioritizedTransitionBuffer (torch twins) beside cpprb's PrioritizedReplayBuffer, both full,
alpha 0.6, beta 0.4, holding CartPole-sized transitions (observation 4 float32, action int64, reward
float32, terminated, truncated) and sampled with next observations (gpubuf's ``with_next_obs``, cpprb's
``next_of``). One env: cpprb keeps one stream of transitions, so gpubuf stores them unvectorized
(``vectorized_env=False``) and an insert is 16 consecutive transitions in both. Sampling is with
replacement (cpprb's only kind), batch 256; the update re-prioritises the last sample's 256 indices.
Interleaved rounds (per round one untimed call, then two timed), one thread, medians.
Targets (issue 20): insert <= 2x cpprb, sample <= 1.2x cpprb.

    pip install -e '.[bench]'
    python benchmarks/bench_per_scale.py           # -> results/per_scale_cpu.json and a markdown table
"""

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from gpubuf import PrioritizedTransitionBuffer, Transition, Unit
from gpubuf.apps.benchmarking.timing import machine, median_us, versions

CAPACITY, B, INSERT, OBS, CHUNK = 2**20, 256, 16, 4, 2**16
TARGETS = {"insert": 2.0, "sample": 1.2}  # gpubuf / cpprb


def rows(n: int, rng) -> dict:
    """n transitions in cpprb's names, next observations included."""
    return {"obs": rng.standard_normal((n, OBS)).astype(np.float32), "act": rng.integers(0, 2, n),
            "rew": np.ones(n, np.float32), "terminated": np.zeros(n, bool), "truncated": np.zeros(n, bool),
            "next_obs": rng.standard_normal((n, OBS)).astype(np.float32)}


def transition(d: dict) -> Transition:
    return Transition(observation=d["obs"], action=d["act"], reward=d["rew"], terminated=d["terminated"],
                      truncated=d["truncated"])


def contenders(rng) -> dict:
    """``{(op, peer): fn}`` on full buffers."""
    import cpprb

    batch = rows(INSERT, rng)
    td = rng.random(B).astype(np.float32)
    per = PrioritizedTransitionBuffer(CAPACITY, B, transition(batch), vectorized_env=False, device="cpu",
                                      seed=0)
    env = {"obs": {"shape": OBS, "dtype": np.float32}, "act": {"dtype": np.int64}, "rew": {"dtype": np.float32},
           "terminated": {"dtype": np.bool_}, "truncated": {"dtype": np.bool_}}
    rb = cpprb.PrioritizedReplayBuffer(CAPACITY, env, next_of="obs", alpha=0.6, eps=1e-6)
    for _ in range(CAPACITY // CHUNK):
        chunk = rows(CHUNK, rng)
        per.insert(transition(chunk))
        rb.add(**chunk)
    gpubuf_batch, gpubuf_td = transition(batch), torch.from_numpy(td)
    last = {}

    def gpubuf_sample():
        last["gpubuf"] = per.sample(with_replacement=True, unit=Unit.transition()).indices

    def cpprb_sample():
        last["cpprb"] = rb.sample(B, beta=0.4)["indexes"]

    gpubuf_sample()
    cpprb_sample()
    return {("insert", "gpubuf"): lambda: per.insert(gpubuf_batch), ("insert", "cpprb"): lambda: rb.add(**batch),
            ("sample", "gpubuf"): gpubuf_sample, ("sample", "cpprb"): cpprb_sample,
            ("update_priorities", "gpubuf"): lambda: per.update_priorities(last["gpubuf"], gpubuf_td),
            ("update_priorities", "cpprb"): lambda: rb.update_priorities(last["cpprb"], td)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "per_scale_cpu.json")
    args = p.parse_args()
    try:
        import cpprb  # noqa: F401
    except ImportError:
        raise SystemExit("bench_per_scale needs cpprb: pip install -e '.[bench]'") from None
    torch.set_num_threads(1)
    med = median_us(contenders(np.random.default_rng(0)), args.repeats, 1, skip=1, calls=2)
    table = []
    for op in ("insert", "sample", "update_priorities"):
        g, c = med[(op, "gpubuf")], med[(op, "cpprb")]
        t = TARGETS.get(op)
        table.append({"op": op, "gpubuf_us": g, "cpprb_us": c, "ratio": g / c, "target_ratio": t,
                      "met": None if t is None else g / c <= t})
    meta = {**machine(torch.device("cpu")), **versions(["torch", "numpy", "cpprb"]), "capacity": CAPACITY,
            "batch": B, "insert_rows": INSERT, "envs": 1, "repeats": args.repeats}
    args.out.write_text(json.dumps({"meta": meta, "rows": table}, indent=1))
    print(f"PER at {CAPACITY} transitions (1 env), batch {B}, inserts of {INSERT}; CPU, 1 thread, "
          f"median of {args.repeats}")
    print("\n| op | gpubuf us | cpprb us | gpubuf / cpprb | target |\n|---|---:|---:|---:|---:|")
    for r in table:
        target = "-" if r["target_ratio"] is None else \
            f"<= {r['target_ratio']}x ({'met' if r['met'] else 'NOT met'})"
        print(f"| {r['op']} | {r['gpubuf_us']:.0f} | {r['cpprb_us']:.0f} | {r['ratio']:.2f}x | {target} |")


if __name__ == "__main__":
    main()
