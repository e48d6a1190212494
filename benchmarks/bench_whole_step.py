"""The whole step of a GPU-simulator loop: simulator step -> source step -> sample -> a small MLP's TD loss, backward
and optimizer step -> priority update.

Variants, interleaved, medians per step:

- ``eager``: ``TensorSource.step`` (reads rewards, flags and actions to the host), ``buffer.sample`` and
  ``buffer.update_priorities`` (checked on the host);
- ``capturable``: ``TensorSource(capturable=True).step`` (the buffer's graph writer) and a ``GraphSampler``, eager;
- ``compiled, 1 graph``: the capturable step's simulator -> source -> sample -> loss -> update part as one
  ``torch.compile(fullgraph=True)`` graph (inductor; backward and optimizer step eager);
- ``compiled, 2 graphs``: the same part as two compiled graphs, simulator -> source, and sample -> loss -> update;
- ``cuda graph`` (CUDA only): the whole capturable step, backward and optimizer step included, captured once and
  replayed.

Sizes: 1024 envs (``--envs``), observations float32[17], actions float32[6], 2**10 rows per env, batch 256.

    python benchmarks/bench_whole_step.py                  # CPU
    python benchmarks/bench_whole_step.py --device cuda    # adds the CUDA-graph replay
"""

import argparse

import gymnasium as gym
import numpy as np
import torch

from gpubuf import PrioritizedTransitionBuffer, TensorSource, Unit
from gpubuf.apps.benchmarking.timing import step_variants
from gpubuf.ops import capture_graph

OBS, ACT, ROWS, BATCH = 17, 6, 2**10, 256


class Sim:
    """A batched linear simulator with same-step resets: state (E, OBS), episodes of 200 steps."""

    def __init__(self, E: int, device):
        g = torch.Generator().manual_seed(0)
        self.A = (torch.randn(OBS, OBS, generator=g) * 0.1).to(device)
        self.B = (torch.randn(ACT, OBS, generator=g) * 0.1).to(device)
        self.x = torch.zeros(E, OBS, device=device)
        self.t = torch.zeros(E, dtype=torch.int64, device=device)

    def step(self, action):
        x = self.x @ self.A + action @ self.B
        t = self.t + 1
        reward = -x.pow(2).mean(1)
        terminated, truncated = x.abs().amax(1) > 10, t >= 200
        done = terminated | truncated
        self.x.copy_(torch.where(done[:, None], torch.zeros_like(x), x))
        self.t.copy_(torch.where(done, torch.zeros_like(t), t))
        return self.x, reward, terminated, truncated & ~terminated


def build(E: int, dev, capturable: bool):
    """``(source, buffer, sim, policy net, q net, optimizer)``, the buffer half full."""
    box = gym.spaces.Box(-np.inf, np.inf, (OBS,), np.float32)
    src = TensorSource(E, box, gym.spaces.Box(-1, 1, (ACT,), np.float32), final_obs=False, device=dev,
                       capturable=capturable)
    buf = PrioritizedTransitionBuffer(E * ROWS, BATCH, src.transition_sample(), device=dev, seed=0)
    src.transitions = buf
    sim = Sim(E, dev)
    src.reset(sim.x.clone())
    pi = torch.nn.Linear(OBS, ACT).to(dev)
    q = torch.nn.Sequential(torch.nn.Linear(OBS + ACT, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(dev)
    for _ in range(ROWS // 2):
        act = torch.tanh(pi(sim.x)).detach()
        src.step(act, *sim.step(act))
    return src, buf, sim, pi, q, torch.optim.SGD(q.parameters(), lr=1e-4)


def td_loss(q, batch):
    x = torch.cat([batch.observation, batch.action], -1)
    target = batch.reward + 0.99 * q(torch.cat([batch.next_observation, batch.action], -1)).squeeze(-1).detach()
    td = q(x).squeeze(-1) - target
    return (td.pow(2) * batch.PER_weights).mean(), td.detach()


def eager_step(E, dev):
    src, buf, sim, pi, q, opt = build(E, dev, False)

    def step():
        with torch.no_grad():
            act = torch.tanh(pi(sim.x))
        src.step(act, *sim.step(act))
        batch = buf.sample(unit=Unit.transition(), with_replacement=True)
        loss, td = td_loss(q, batch)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        buf.update_priorities(batch.indices, td)

    return step


def capturable_steps(E, dev, compile_parts=None) -> tuple:
    """``(forward, with_backward)``: the capturable loop's part without the backward (simulator and source step, then
    sample, loss and update; ``compile_parts``: a function compiling each part on its own), and a maker of the whole
    step from it."""
    src, buf, sim, pi, q, opt = build(E, dev, True)
    gs = buf.graph_sampler(BATCH, with_next_obs=True)

    def env_part():
        with torch.no_grad():
            act = torch.tanh(pi(sim.x))
        src.step(act, *sim.step(act))

    def learn_part():
        batch, idx = gs.sample()
        loss, td = td_loss(q, batch)
        gs.update_priorities(idx, td)
        return loss

    if compile_parts is not None:
        env_part, learn_part = compile_parts(env_part), compile_parts(learn_part)

    def forward():
        env_part()
        return learn_part()

    def with_backward(fwd):
        def step():
            loss = fwd()
            opt.zero_grad(set_to_none=False)
            loss.backward()
            opt.step()
        return step

    return forward, with_backward


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--envs", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    dev = torch.device(args.device)
    E = args.envs
    forward, with_backward = capturable_steps(E, dev)
    one, one_backward = capturable_steps(E, dev)
    two, two_backward = capturable_steps(E, dev, lambda part: torch.compile(part, fullgraph=True))
    fns = {"eager": eager_step(E, dev), "capturable": with_backward(forward),
           "compiled, 1 graph": one_backward(torch.compile(one, fullgraph=True)),
           "compiled, 2 graphs": two_backward(two)}
    if dev.type == "cuda":
        graph_forward, graph_backward = capturable_steps(E, dev)
        graph, _ = capture_graph(graph_backward(graph_forward))
        fns["cuda graph"] = graph.replay
    step_variants(fns, args.repeats, dev, f"whole step on {dev} ({E} envs, batch {BATCH})",
                  {"envs": E, "batch": BATCH}, args.out)

if __name__ == "__main__":
    main()
