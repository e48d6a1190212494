"""Sampling through GraphSampler: eager ``buffer.sample`` vs ``GraphSampler.sample`` vs (CUDA) the same
draw captured in a CUDA graph and replayed, with a check that replayed windows are real.

Sizes: 64 envs, 2**14 rows per env (2**20 starts), 84-byte observations, n_steps 4, batch 256; uniform
and prioritized buffers. Median per call over interleaved repeats.

    python benchmarks/bench_graph.py                   # CPU: eager vs GraphSampler
    python benchmarks/bench_graph.py --device cuda     # adds CUDA-graph replay
"""

import argparse
import json

import torch

from gpubuf import PrioritizedTransitionBuffer, Transition, TransitionBuffer, Unit
from gpubuf.apps.benchmarking.timing import median_us, syncer
from gpubuf.ops import capture_graph

E, ROWS, N, B = 64, 2**14, 4, 256


def build(cls, device):
    sample = Transition(observation=torch.zeros(1, E, 21), action=torch.zeros(1, E, dtype=torch.int64),
                        reward=torch.zeros(1, E), terminated=torch.zeros(1, E, dtype=torch.bool),
                        truncated=torch.zeros(1, E, dtype=torch.bool))
    buf = cls(E * ROWS, B, sample, n_steps=N, device=device, seed=0)
    T = 2048
    for t0 in range(0, ROWS, T):
        v = (torch.arange(t0, t0 + T).unsqueeze(1) * E + torch.arange(E)).float()  # value = step * E + env
        buf.insert(Transition(observation=v.unsqueeze(-1).expand(T, E, 21).contiguous(),
                              action=v.long(), reward=v, terminated=torch.zeros(T, E, dtype=torch.bool),
                              truncated=torch.zeros(T, E, dtype=torch.bool)))
    return buf


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    sync = syncer(dev)
    rows = []
    for name, cls in (("uniform", TransitionBuffer), ("prioritized", PrioritizedTransitionBuffer)):
        buf = build(cls, dev)
        gs = buf.graph_sampler(B)
        fns = {"eager sample": lambda buf=buf: buf.sample(unit=Unit.window(), with_replacement=True),
               "GraphSampler.sample": gs.sample}
        if cuda:
            graph, (out, idx) = capture_graph(gs.sample)
            graph.replay()
            torch.cuda.synchronize()
            obs, starts = out.observation[:, :, 0].cpu(), idx.cpu()
            want = ((starts // E).unsqueeze(1) + torch.arange(N)) % ROWS * E + starts.unsqueeze(1) % E
            assert torch.equal(obs, want.float()), "replayed windows are not the rows of their starts"
            fns["CUDA graph replay"] = graph.replay
        # 3 interleaved rounds of repeats // 3 samples of each call; a sample times 5 consecutive calls
        med = median_us(fns, 3, args.repeats // 3 or 1, sync, skip=0, calls=5)
        rows += [{"buffer": name, "call": k, "us": us} for k, us in med.items()]
    print(f"sampling {B} windows of {N} rows from 2**20 starts on {dev}, median us per call")
    print("| buffer | call | us |\n|---|---|---:|")
    for r in rows:
        print(f"| {r['buffer']} | {r['call']} | {r['us']:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": str(dev), "torch": torch.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
