"""Sharded replay benchmark: ShardedBuffer sample + update throughput with 1, 2 and 4 ranks (gloo on CPU by
default; ``--backend nccl --device cuda`` on GPUs, one rank per GPU; ``--backend gloo --device cuda`` keeps
the shards on the GPU and stages collectives through the host).

Weak scaling: every rank holds a full shard of ``2**log2_size`` transitions (the ``per`` case of
bench_replay.py: obs float32[17], action float32[6], reward float32, terminated, truncated) and, per
iteration, samples ``B`` windows and updates their ``B`` priorities (both collective). Cases:

- ``per``: PrioritizedTransitionBuffer shards, sample with replacement + update_priorities;
- ``per no-repl``: the same, sampling without replacement (the prioritized default);
- ``uniform``: TransitionBuffer shards, sample with replacement only.

``local`` rows time the same calls on the unwrapped buffer in one process (no communication). Each rank times
``--iters`` iterations of every case one by one after a barrier, the cases interleaved in rotating order
(:func:`gpubuf.apps.benchmarking.timing.median_us`); a row reports the slowest rank's median iteration.
Scaling efficiency = global windows/s with W ranks / (W x global windows/s with 1 rank). Processes get
``torch.set_num_threads(1)``; ranks beyond the machine's cores share them (say so when quoting numbers).

Every run also checks what it timed: observation 0 of row ``i`` on rank ``r`` is its global index
``r * 2**log2_size + i``, so each rank verifies that the windows it received are the rows its global
indices name, on every backend and device.

    python benchmarks/bench_distributed.py            # writes benchmarks/results/distributed_cpu.json
    python benchmarks/bench_distributed.py --backend nccl --device cuda --ranks 1 --out distributed_nccl.json
"""

import argparse
import json
import multiprocessing
import os
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gpubuf import PrioritizedTransitionBuffer, Transition, TransitionBuffer, Unit
from gpubuf.apps.benchmarking.timing import median_us, syncer
from gpubuf.replay.sharded.buffer import ShardedBuffer

OBS, ACT = 17, 6
ROW_BYTES = (OBS + ACT + 1) * 4 + 2  # bytes of one window (n_steps = 1)


def transitions(first: int, n: int, rng: np.random.Generator) -> Transition:
    """Rows ``first .. first + n - 1`` of a shard; observation 0 holds the row's global index."""
    obs = rng.standard_normal((n, OBS), dtype=np.float32)
    obs[:, 0] = np.arange(first, first + n)
    return Transition(observation=obs,
                      action=rng.standard_normal((n, ACT), dtype=np.float32),
                      reward=rng.standard_normal(n, dtype=np.float32), terminated=np.zeros(n, bool),
                      truncated=np.zeros(n, bool))


def shard(cls, N: int, B: int, rank: int, device: torch.device):
    rng = np.random.default_rng(rank)
    buf = cls(N, B, transitions(0, 1, rng), vectorized_env=False, device=device, seed=rank)
    for i in range(0, N, 2**16):
        buf.insert(transitions(rank * N + i, min(N, 2**16), rng))
    return buf


def check_windows(per: ShardedBuffer, uni: ShardedBuffer, B: int, g: torch.Generator) -> None:
    """The windows a rank receives are the rows that their global indices name."""
    for replace in (True, False):
        batch = per.sample(key=g, with_replacement=replace, unit=Unit.window())
        idx = batch.indices
        got = batch.observation[:, 0].long().cpu()
        if not torch.equal(got, idx.cpu()):
            raise AssertionError(f"rank {dist.get_rank()}: windows do not match their global indices "
                                 f"(with_replacement={replace})")
    seen = uni.sample(key=g).observation[:, 0].long().cpu()
    if not ((seen >= 0) & (seen < dist.get_world_size() * per.local.max_size)).all():
        raise AssertionError(f"rank {dist.get_rank()}: uniform windows hold rows that were never inserted")


def timed(steps: dict, iters: int, barrier, sync) -> dict[str, float]:
    """Case -> median seconds of one of its ``steps`` over ``iters`` calls, synced by ``sync``: after 5 warm-up
    calls of each and a barrier, the cases interleaved in rotating order (the same order on every rank, so
    their collectives meet)."""
    for step in steps.values():
        for _ in range(5):
            step()
    barrier()
    return {name: us / 1e6 for name, us in median_us(steps, iters, 1, sync, skip=0, warmup=0).items()}


def cases(N: int, B: int, rank: int, sharded: bool, device: torch.device):
    """{case: one iteration}; ``sharded``: through ShardedBuffer (collective, checked first), else on the local
    buffer."""
    per, uni = shard(PrioritizedTransitionBuffer, N, B, rank, device), shard(TransitionBuffer, N, B, rank, device)
    g = torch.Generator().manual_seed(100 + rank)
    if sharded:
        per, uni = ShardedBuffer(per), ShardedBuffer(uni)
        check_windows(per, uni, B, g)

    def per_step(replace: bool):
        idx = per.sample(key=g, with_replacement=replace, unit=Unit.window()).indices
        per.update_priorities(idx, torch.rand(B, generator=g) * 2)

    return {"per": lambda: per_step(True), "per no-repl": lambda: per_step(False),
            "uniform": lambda: uni.sample(key=g)}


def worker(rank: int, world: int, init: str, out: str, N: int, B: int, iters: int, backend: str,
           device_type: str) -> None:
    torch.set_num_threads(1)
    device = torch.device(device_type)
    if device.type == "cuda":  # one GPU per rank when there are enough (NCCL needs that), else they share
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init}", rank=rank, world_size=world)
    sync = syncer(device)
    try:
        res = timed(cases(N, B, rank, True, device), iters, dist.barrier, sync)
        if world == 1:
            res.update({f"{name} local": sec
                        for name, sec in timed(cases(N, B, rank, False, device), iters, lambda: None, sync).items()})
        everyone = [None] * world
        dist.all_gather_object(everyone, res)
        if rank == 0:
            Path(out).write_text(json.dumps(everyone))
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--log2-size", type=int, default=17, help="transitions per shard: 2**log2_size")
    parser.add_argument("--batch", type=int, default=256, help="windows sampled (and priorities updated) per rank")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--device", default="cpu", help="where the shards live: cpu or cuda")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "distributed_cpu.json"))
    args = parser.parse_args()
    N, B = 2**args.log2_size, args.batch
    ranks = list(map(int, args.ranks.split(",")))
    if max(ranks) * N > 2**24:
        parser.error("--ranks/--log2-size: global indices must stay exact in float32 (ranks * 2**log2_size <= 2**24)")
    if args.backend == "nccl" and (args.device != "cuda" or max(ranks) > torch.cuda.device_count()):
        parser.error(f"--backend nccl: needs --device cuda and one GPU per rank ({torch.cuda.device_count()} here)")
    load_start = os.getloadavg()[0]  # other work sharing the cores
    multiprocessing.get_context("forkserver").set_forkserver_preload(["gpubuf.replay.sharded.buffer"])
    per_world = {}
    for W in ranks:
        with tempfile.TemporaryDirectory() as tmp:
            mp.start_processes(worker, args=(W, f"{tmp}/init", f"{tmp}/res.json", N, B, args.iters, args.backend,
                                             args.device), nprocs=W, start_method="forkserver")
            per_world[W] = json.loads(Path(f"{tmp}/res.json").read_text())
        print(f"{W} rank(s) done", file=sys.stderr, flush=True)
    rows = []
    for W, ranks in per_world.items():
        for name in ranks[0]:
            sec = max(r[name] for r in ranks)  # the slowest rank's median iteration
            rows.append({"case": name.removesuffix(" local"), "impl": "local" if name.endswith("local") else "sharded",
                         "ranks": W, "us_per_iter": sec * 1e6, "windows_per_s": W * B / sec,
                         "MB_per_s": W * B * ROW_BYTES / sec / 1e6})
    base = {r["case"]: r["windows_per_s"] for r in rows if r["ranks"] == 1 and r["impl"] == "sharded"}
    for r in rows:
        if r["impl"] == "sharded" and r["case"] in base:
            r["efficiency"] = r["windows_per_s"] / (r["ranks"] * base[r["case"]])
    meta = {"machine": platform.machine(), "cpus": os.cpu_count(), "load_avg_1min": [load_start, os.getloadavg()[0]],
            "torch": torch.__version__, "backend": args.backend, "device": args.device, "threads_per_rank": 1,
            "shard_size": N, "batch": B, "iters": args.iters}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"\nShard of 2**{args.log2_size} transitions per rank, B = {B} per rank; {os.cpu_count()} CPU cores "
          f"(1-min load average {meta['load_avg_1min'][0]:.1f} before, {meta['load_avg_1min'][1]:.1f} after), "
          f"{args.backend} on {args.device}, 1 thread per rank\n")
    print("| case | impl | ranks | us / iteration | global windows/s | scaling efficiency |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        eff = f"{r['efficiency']:.2f}" if "efficiency" in r else "-"
        print(f"| {r['case']} | {r['impl']} | {r['ranks']} | {r['us_per_iter']:.0f} | {r['windows_per_s']:.0f} | "
              f"{eff} |")


if __name__ == "__main__":
    main()
