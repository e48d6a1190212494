"""Buffers inside ``torch.compile``: a learner step that samples, computes a loss and updates priorities
compiles once and never recompiles as the buffer fills (the buffer calls are opaque to Dynamo, so nothing
guards on the host-side counters that change every step)."""

import torch
from fixtures import make_transition

from gpubuf import HistoryBuffer, PrioritizedTransitionBuffer


def test_a_learner_step_compiles_once_and_does_not_recompile_as_the_buffer_fills(device):
    torch._dynamo.reset()
    buf = PrioritizedTransitionBuffer(3 * 400, 16, make_transition(0, 1, 3), n_steps=2, device=device, seed=0)
    buf.insert(make_transition(0, 10, 3))
    model = torch.nn.Linear(2, 1).to(device)

    def step():
        batch, idx = buf.sample(with_replacement=True)
        td = model(batch.observation[:, 0]).squeeze(-1) - batch.reward[:, 0]
        loss = (td**2 * batch.PER_weights).mean()
        buf.update_priorities(idx, td.detach())
        return loss

    explanation = torch._dynamo.explain(step)()
    assert explanation.graph_break_count <= 2  # at most one break per buffer call, none inside the model
    compiled = torch.compile(step, backend="eager")
    compiled()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for t in range(200):  # the buffer fills and wraps: counts, positions and priorities change every step
            buf.insert(make_transition(10 + 2 * t, 2, 3))
            loss = compiled()
            assert torch.isfinite(loss)
    assert len(buf) == buf.max_size


def test_history_reads_compile_without_recompiling(device):
    torch._dynamo.reset()
    hist = HistoryBuffer(2, 6, 2, ("action",), device=device)

    def features():
        out = hist.get(3)
        return out["obs"].float().mean() + out["action"].sum()

    hist.append({"obs": torch.zeros(2, 1, 3, device=device), "action": torch.zeros(2, 1, 1, device=device)})
    compiled = torch.compile(features, backend="eager")
    compiled()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for t in range(30):
            hist.append({"obs": torch.full((2, 1, 3), float(t), device=device),
                         "action": torch.ones(2, 1, 1, device=device)})
            assert torch.equal(compiled(), features())

