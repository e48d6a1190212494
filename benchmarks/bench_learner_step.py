"""A whole prioritized learner step: sample -> a small MLP's TD loss and its backward -> priority update.

Variants, interleaved, medians per step (the buffer takes an insert of one row per env between steps):

- ``eager``: ``buffer.sample`` and ``buffer.update_priorities`` (checked on the host);
- ``graph sampler``: ``GraphSampler.sample`` and ``GraphSampler.update_priorities`` (checked on the device), eager;
- ``compiled``: the same step, its sample -> loss -> update part under ``torch.compile(fullgraph=True)``
  (inductor; the backward and the optimizer step stay eager);
- ``cuda graph`` (CUDA only): the same step captured once in a CUDA graph and replayed.

Sizes: 64 envs x 2**14 rows (2**20 starts), observations float32[17], windows of 2 rows, batch 256 (4 minibatches of 64
with ``--minibatches 4``).

    python benchmarks/bench_learner_step.py                  # CPU
    python benchmarks/bench_learner_step.py --device cuda    # adds the CUDA-graph replay
"""

import argparse

import torch

from gpubuf import PrioritizedTransitionBuffer, Transition, Unit
from gpubuf.apps.benchmarking.timing import step_variants
from gpubuf.ops import capture_graph

E, ROWS, OBS, N = 64, 2**14, 17, 2


def rows(T: int, device) -> Transition:
    return Transition(observation=torch.randn(T, E, OBS, device=device), action=torch.zeros(T, E, device=device),
                      reward=torch.randn(T, E, device=device), terminated=torch.zeros(T, E, dtype=torch.bool,
                                                                                      device=device),
                      truncated=torch.zeros(T, E, dtype=torch.bool, device=device))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--minibatches", type=int, default=1)
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    dev = torch.device(args.device)
    buf = PrioritizedTransitionBuffer(E * ROWS, args.batch, rows(1, dev), n_steps=N, device=dev, seed=0)
    for _ in range(ROWS // 2048):
        buf.insert(rows(2048, dev))
    net = torch.nn.Sequential(torch.nn.Linear(OBS, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(dev)
    opt = torch.optim.SGD(net.parameters(), lr=1e-4)
    K = args.minibatches
    gs = buf.graph_sampler(batch_size=args.batch // K, minibatches=K)
    one = rows(1, dev)

    def loss_of(batch):
        q = net(batch.observation[..., 0, :]).squeeze(-1)
        target = batch.reward[..., 0] + 0.99 * net(batch.observation[..., 1, :]).squeeze(-1).detach()
        td = q - target
        return (td.pow(2) * batch.PER_weights).mean(), td.detach()

    def eager():
        batch = buf.sample(unit=Unit.window(), with_replacement=True)
        loss, td = loss_of(batch)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        buf.update_priorities(batch.indices, td)

    def graph_forward():  # sample -> loss -> priorities: what torch.compile(fullgraph=True) takes whole
        batch, idx = gs.sample()
        loss, td = loss_of(batch)
        gs.update_priorities(idx, td)
        return loss

    def backward(forward):
        def step():
            loss = forward()
            opt.zero_grad(set_to_none=False)
            loss.backward()
            opt.step()
        return step

    graph_step = backward(graph_forward)

    def with_insert(step):
        def run():
            buf.insert(one)
            step()
        return run

    fns = {"eager": with_insert(eager), "graph sampler": with_insert(graph_step),
           "compiled": with_insert(backward(torch.compile(graph_forward, fullgraph=True)))}
    if dev.type == "cuda":
        graph, _ = capture_graph(graph_step)  # the whole step, backward and optimizer step included
        fns["cuda graph"] = with_insert(graph.replay)
    step_variants(fns, args.repeats, dev, f"learner step on {dev} (batch {args.batch}, {K} minibatches, one insert)",
                  {"batch": args.batch, "minibatches": K}, args.out)
    gs.check_updates()

if __name__ == "__main__":
    main()
