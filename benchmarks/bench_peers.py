"""The peer harness: every call gpubuf is compared on, against its peers, in one process, one thread, interleaved.

Sections (each section's contenders run interleaved in rotating order, medians):

- PER insert / sample / update of 256 transitions on a full buffer of 2**17 and 2**20 (obs float32[17], action
  float32[6]): gpubuf, torchrl (its compiled segment trees), flashbax, cpprb; stable-baselines3's uniform
  ``ReplayBuffer`` add / sample as a reference row (it has no PER);
- sequence sampling, 32 windows of 16 frames (64x64x3 uint8) from 64 envs x 1024 steps: gpubuf, gpubuf with
  ``out=``, flashbax's trajectory buffer;
- HistoryBuffer ``append`` at 1024 envs (pixels (1, 64, 64, 3) uint8, action (1, 2) float32) against per-env
  numpy deques (stable-worldmodel's layout, views, no copy);
- stacked pixel sampling, batch 32, 84x84 uint8 frames, k = 4, n = 3 step returns, 2**17 steps: gpubuf (one frame per
  step) against cpprb's ``stack_compress`` + ``Nstep``;
- ``EnvPoolSource.step`` of 16 CartPole envs with a HistoryBuffer and a PrioritizedTransitionBuffer attached against
  the raw envpool step.

Each call's target is printed beside it, met or not. Run it with the venv of ``benchmarks/setup_peers.sh`` on a quiet
machine (no other benchmark or test beside it):

    .venv-peers/bin/python benchmarks/bench_peers.py      # -> results/peers_cpu.json and a markdown table
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))  # bench_pixel_replay's stream and peers

from gpubuf.apps.benchmarking import history, per, sequences  # noqa: E402
from gpubuf.apps.benchmarking.peers import Peers  # noqa: E402
from gpubuf.apps.benchmarking.timing import machine, median_us, versions  # noqa: E402


def sb3_rows(log2: int, batch: int, repeats: int) -> list[dict]:
    """stable-baselines3 ReplayBuffer add / sample of ``batch`` transitions (uniform; reference only)."""
    try:
        from gymnasium import spaces
        from stable_baselines3.common.buffers import ReplayBuffer
    except ImportError:
        return []
    n = 2**log2
    rb = ReplayBuffer(n, spaces.Box(-1, 1, (per.OBS,), np.float32), spaces.Box(-1, 1, (per.ACT,), np.float32),
                      device="cpu", n_envs=batch, optimize_memory_usage=False)
    rng = np.random.default_rng(0)
    obs = rng.standard_normal((batch, per.OBS), dtype=np.float32)
    act = rng.standard_normal((batch, per.ACT), dtype=np.float32)
    rew, done = np.zeros(batch, np.float32), np.zeros(batch, bool)
    infos = [{} for _ in range(batch)]
    for _ in range(n // batch):
        rb.add(obs, obs, act, rew, done, infos)

    def add():
        rb.add(obs, obs, act, rew, done, infos)

    med = median_us({"insert": add, "sample": lambda: rb.sample(batch)}, repeats, 5)
    return [{"suite": "replay", "case": f"PER N=2**{log2}", "op": f"{op} {batch}", "impl": "sb3 (uniform)",
             "us": us} for op, us in med.items()]


def pixel_rows(repeats: int) -> list[dict]:
    """gpubuf and cpprb stacked n-step pixel sampling, batch 32, 2**17 steps."""
    import bench_pixel_replay as px

    stream = px.Stream(2**17)
    fns = {}
    sample, _, _ = px.gpubuf_peer(stream, 2**17)
    fns["gpubuf"] = lambda: sample(32)
    if px.importable("cpprb") is None:
        sample_c, _, _ = px.cpprb_peer(stream, 2**17, with_next=False)
        fns["cpprb"] = lambda: sample_c(32)
    med = median_us(fns, repeats, 5)
    return [{"suite": "pixels", "case": "84x84 k=4 n=3, 2**17 steps", "op": "sample 32", "impl": k, "us": v}
            for k, v in med.items()]


def source_rows(rounds: int, steps: int = 100) -> list[dict]:
    """``EnvPoolSource.step`` (HistoryBuffer + PrioritizedTransitionBuffer attached) against the raw step, 16 CartPole
    envs; per round each variant runs ``steps`` steps back to back."""
    import envpool

    from gpubuf import EnvPoolSource, HistoryBuffer, PrioritizedTransitionBuffer

    def make():
        return envpool.make("CartPole-v1", env_type="gymnasium", num_envs=16, batch_size=16, seed=0)

    raw = make()
    raw.reset()
    src = EnvPoolSource(make(), history=HistoryBuffer(16, 8))
    src.transitions = PrioritizedTransitionBuffer(16 * 4096, 64, src.transition_sample(), n_steps=3, seed=0)
    src.reset()
    acts = [a.astype(np.int32) for a in np.random.default_rng(0).integers(0, 2, (steps, 16))]

    def run(step):
        def go():
            for a in acts:
                step(a)
        return go

    med = median_us({"raw envpool step": run(raw.step), "EnvPoolSource.step": run(src.step)}, rounds)
    return [{"suite": "source", "case": "CartPole x 16 (+history, +PER)", "op": "step", "impl": k, "us": v / steps}
            for k, v in med.items()]


TARGETS = {  # (suite, op-prefix) -> (peers gpubuf must be at most as slow as, allowance per peer)
    ("replay", "insert"): {"torchrl": 1, "flashbax": 1, "cpprb": 1.5, "rlox": 1},
    ("replay", "sample"): {"torchrl": 1, "flashbax": 1, "cpprb": 1, "rlox": 1},
    ("replay", "update"): {"torchrl": 1, "flashbax": 1, "cpprb": 1.5},
    ("replay", "sample 32x16"): {"flashbax": 1},
    ("history", "append"): {"deque": 1, "copy floor": 1.1},
    ("pixels", "sample"): {"cpprb": 1},
    ("source", "step"): {"raw envpool step": 2},
}


def verdicts(rows: list[dict]) -> list[dict]:
    """Per gpubuf call (``gpubuf`` and ``gpubuf (out=)``): its time, the worst allowed peer time, met or not."""
    out = []
    for g in rows:
        if g["impl"] not in ("gpubuf", "gpubuf (out=)", "EnvPoolSource.step"):
            continue
        goal = next((t for (s, op), t in sorted(TARGETS.items(), key=lambda kv: -len(kv[0][1]))
                     if s == g["suite"] and g["op"].startswith(op)), None)
        if goal is None:
            continue
        peers = {r["impl"]: r["us"] for r in rows if (r["suite"], r["case"], r["op"]) ==
                 (g["suite"], g["case"], g["op"]) and r["impl"] in goal}
        bound = min((us * goal[p], p) for p, us in peers.items()) if peers else None
        out.append({"case": g["case"], "op": g["op"], "impl": g["impl"], "us": g["us"],
                    "bound_us": bound and bound[0], "bound_by": bound and f"{bound[1]} x{goal[bound[1]]:g}",
                    "met": None if bound is None else g["us"] <= bound[0]})
    return out


def markdown(result: dict) -> str:
    lines = [f"machine: {result['machine']['device_name']}, {result['machine']['cpus']} CPUs, 1 thread; "
             f"loadavg before/after {result['loadavg']}", "",
             "| suite | case | op | impl | median us |", "|---|---|---|---|---:|"]
    lines += [f"| {r['suite']} | {r['case']} | {r['op']} | {r['impl']} | {r['us']:.1f} |" for r in result["rows"]]
    lines += ["", "| case | op | gpubuf | us | target (at most) | met |", "|---|---|---|---:|---:|---|"]
    for v in result["verdicts"]:
        bound = "-" if v["bound_us"] is None else f"{v['bound_us']:.1f} ({v['bound_by']})"
        met = "-" if v["met"] is None else ("met" if v["met"] else "NOT met")
        lines.append(f"| {v['case']} | {v['op']} | {v['impl']} | {v['us']:.1f} | {bound} | {met} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=20, help="rounds per section")
    p.add_argument("--sections", default="per,sequences,history,pixels,source")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "peers_cpu.json")
    args = p.parse_args()
    os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    torch.set_num_threads(1)
    sections, cpu = args.sections.split(","), torch.device("cpu")
    found = Peers(["deque", "cpprb", "rlox", "torchrl", "flashbax"])
    load, rows, t0 = [os.getloadavg()[0]], [], time.time()
    if "per" in sections:
        for lg in (17, 20):
            rows += per.run(lg, 256, cpu, args.repeats, found) + sb3_rows(lg, 256, args.repeats)
    if "sequences" in sections:
        rows += sequences.run(64, 1024, cpu, args.repeats, found)
    if "history" in sections:
        rows += [r for r in history.run(1024, cpu, args.repeats, found) if r["op"] == "append"]
    if "pixels" in sections:
        rows += pixel_rows(args.repeats)
    if "source" in sections:
        rows += source_rows(args.repeats)
    load.append(os.getloadavg()[0])
    result = {"machine": machine(cpu), "loadavg": load, "seconds": round(time.time() - t0),
              "versions": versions(["gpubuf", "torch", "numpy", "numba", "cpprb", "torchrl", "tensordict", "flashbax",
                                    "jax", "stable-baselines3", "envpool"]),
              "missing": found.missing, "failed": found.failed, "rows": rows}
    result["verdicts"] = verdicts(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(markdown(result))


if __name__ == "__main__":
    main()
