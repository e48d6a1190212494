"""torchrl's replay buffer with its own samplers against the same buffer with gpubuf's (``gpubuf.torchrl``), one run.

Each contender is a ``TensorDictReplayBuffer`` over a ``LazyTensorStorage`` of N rows (obs float32[17], action
float32[6], reward float32, done bool, an episode id int64: 1024-step episodes), filled before timing; the sampler
argument (or the storage's, for uniform draws) is the only difference. Calls, batch 256, one thread, interleaved
rounds, medians:

- prioritized (alpha 0.6, beta 0.4, eps 1e-6): ``extend`` of 256 rows, ``sample()``, ``update_priority`` of the
  sampled indices; torchrl's ``PrioritizedSampler`` (its compiled segment trees: run from the venv of
  ``benchmarks/setup_peers.sh``, which rebuilds them for this torch) against ``gpubuf.torchrl.PrioritizedSampler``;
- uniform: ``sample()`` with torchrl's ``RandomSampler`` (one ``randint``: the time is the storage's gather), over
  ``LazyTensorStorage`` against ``gpubuf.torchrl.ReplayStorage``, and over files: ``LazyMemmapStorage`` against
  ``ReplayStorage(storage_dir=...)`` (both in a temporary directory), and ``extend`` of 256 rows into those files;
- sequences: ``sample()`` of 8 slices of 32 steps; torchrl's ``SliceSampler`` against
  ``gpubuf.torchrl.SliceSampler``, both told the episode key (``traj_key="episode"``);
- prioritized sequences: the same with ``PrioritizedSliceSampler`` (alpha 0.6, beta 0.4).

    .venv-peers/bin/python benchmarks/bench_torchrl.py      # -> results/torchrl_cpu.json
"""

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from gpubuf.apps.benchmarking.per import prepared_priorities
from gpubuf.apps.benchmarking.timing import machine, median_us, versions

B, EPISODE, SLICE = 256, 1024, 32


def rows(start: int, n: int) -> "TensorDict":  # noqa: F821
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(start)
    return TensorDict({"obs": torch.randn(n, 17, generator=g), "action": torch.randn(n, 6, generator=g),
                       "reward": torch.randn(n, generator=g), "done": torch.zeros(n, 1, dtype=torch.bool),
                       "episode": torch.arange(start, start + n) // EPISODE}, batch_size=[n])


def replay(n: int, sampler, storage=None):
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    rb = TensorDictReplayBuffer(storage=storage or LazyTensorStorage(n), sampler=sampler, batch_size=B)
    for s in range(0, n, 2**16):
        rb.extend(rows(s, min(2**16, n - s)))
    return rb


def prioritized_calls(rb) -> dict:
    batch, state = rows(0, B), {}
    priorities = prepared_priorities(B, lambda a: torch.as_tensor(a, dtype=torch.float32))

    def sample():
        state["index"] = rb.sample()["index"]

    sample()
    return {"extend": lambda: rb.extend(batch), "sample": sample,
            "update_priority": lambda: rb.update_priority(state["index"], priorities())}


def contenders(n: int, scratch: Path) -> dict:
    """(call, implementation) -> zero-argument callable."""
    import torchrl.data as native

    import gpubuf.torchrl as plugin

    out = {("uniform sample", "torchrl"): replay(n, native.RandomSampler()).sample,
           ("uniform sample", "gpubuf"): replay(n, native.RandomSampler(), plugin.ReplayStorage(n)).sample,
           ("uniform sample, files", "torchrl"): replay(n, native.RandomSampler(), native.LazyMemmapStorage(
               n, scratch_dir=scratch / f"torchrl{n}")).sample,
           ("uniform sample, files", "gpubuf"): replay(n, native.RandomSampler(), plugin.ReplayStorage(
               n, storage_dir=scratch / f"gpubuf{n}")).sample}
    for name, storage in (("torchrl", native.LazyMemmapStorage(n, scratch_dir=scratch / f"torchrl-w{n}")),
                          ("gpubuf", plugin.ReplayStorage(n, storage_dir=scratch / f"gpubuf-w{n}"))):
        batch, rb = rows(0, B), replay(n, native.RandomSampler(), storage)
        out[("extend 256, files", name)] = lambda rb=rb, batch=batch: rb.extend(batch)
    for name, mod in (("torchrl", native), ("gpubuf", plugin)):
        per = replay(n, mod.PrioritizedSampler(n, alpha=0.6, beta=0.4, eps=1e-6))
        out.update({(f"prioritized {call}", name): fn for call, fn in prioritized_calls(per).items()})
        seq = replay(n, mod.SliceSampler(slice_len=SLICE, traj_key="episode"))
        out[("sequences sample", name)] = seq.sample
        per_seq = replay(n, mod.PrioritizedSliceSampler(n, 0.6, 0.4, slice_len=SLICE, traj_key="episode"))
        out[("prioritized sequences sample", name)] = per_seq.sample
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--log2-sizes", default="17,20")
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "torchrl_cpu.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    np.random.seed(0)
    table = []
    print("| N | call | torchrl (us) | gpubuf.torchrl (us) | speed-up |\n|---|---|---|---|---|")
    scratch = Path(tempfile.mkdtemp(prefix="bench_torchrl_"))
    for log2 in map(int, args.log2_sizes.split(",")):
        fns = contenders(2**log2, scratch)
        us = median_us(fns, args.repeats)
        for call in dict.fromkeys(c for c, _ in fns):
            a, b = us.get((call, "torchrl")), us.get((call, "gpubuf"))
            table.append({"log2_size": log2, "call": call, "torchrl_us": a, "gpubuf_us": b,
                          "speedup": a / b if a and b else None})
            cells = [f"{x:.1f}" if x else "-" for x in (a, b)] + [f"{a / b:.2f}x" if a and b else "-"]
            print(f"| 2**{log2} | {call} | " + " | ".join(cells) + " |", flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine(torch.device("cpu")),
                                    "versions": versions(["torch", "torchrl", "tensordict", "numpy"]),
                                    "batch": B, "repeats": args.repeats, "rows": table}, indent=1))


if __name__ == "__main__":
    main()
