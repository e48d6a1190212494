"""GraphSampler: fixed tensors, device random numbers, the buffer's live tree; exact distribution, real
windows, PER weights, and (on CUDA) capture and replay in a CUDA graph."""

import numpy as np
import pytest
import torch
from fixtures import make_transition
from scipy import stats

from gpubuf import GraphSampler, PrioritizedTransitionBuffer, TransitionBuffer
from gpubuf.ops import capture_graph


def _check_windows(out, idx, E, M, n):
    """Every window holds the rows of its start: value = global_step * E + env, wrapped in the ring."""
    starts = idx.cpu()
    obs = out.observation.cpu()
    for b, s in enumerate(starts.tolist()):
        step, env = divmod(s, E)
        rows = [((step + j) % M) for j in range(n)]
        got = obs[b, :, 0] if n > 1 else obs[b, 0].unsqueeze(0)
        assert [int(v) % E for v in got] == [env] * n
        assert [(int(v) // E) % M for v in got] == rows


@pytest.mark.parametrize("prioritized", [False, True])
def test_draws_real_windows_into_the_same_tensors(backend, device, prioritized):
    cls = PrioritizedTransitionBuffer if prioritized else TransitionBuffer
    E, M, n = 3, 16, 3
    buf = cls(E * M, 8, make_transition(0, 1, E), n_steps=n, device=device, seed=0)
    buf.insert(make_transition(0, 12, E, trunc_steps=(9,)))
    buf.insert(make_transition(12, 9, E))  # wrapped once
    gs = buf.graph_sampler(batch_size=8, with_next_obs=True, generator=torch.Generator(device).manual_seed(1))
    assert isinstance(gs, GraphSampler)
    out1, idx1 = gs.sample()
    first = {k: v for k, v in vars(out1).items() if isinstance(v, torch.Tensor)}
    _check_windows(out1, idx1, E, M, n)
    mass = buf.sampling_mass(with_next_obs=True)
    assert bool((mass[idx1] > 0).all())  # valid starts only (the truncation at step 9 excludes some)
    assert torch.equal(out1.next_observation[:, :-1], out1.observation[:, 1:])
    buf.insert(make_transition(21, 5, E))  # the sampler reads the buffer as it is now
    out2, idx2 = gs.sample()
    assert out2 is out1 and idx2 is idx1
    assert all(getattr(out2, k) is v for k, v in first.items())  # no new tensors
    _check_windows(out2, idx2, E, M, n)
    if prioritized:
        m = buf.sampling_mass(with_next_obs=True)[idx2]
        want = (m / m.min()).pow(-buf.beta).float()
        torch.testing.assert_close(out2.PER_weights, want)


def test_prioritized_draws_follow_the_exact_probabilities():
    E, M = 2, 20
    buf = PrioritizedTransitionBuffer(E * M, 8, make_transition(0, 1, E), alpha=0.7, device="cpu", seed=0)
    buf.insert(make_transition(0, 20, E))
    g = torch.Generator().manual_seed(3)
    buf.update_priorities(torch.arange(E * M), torch.rand(E * M, generator=g) * 4)
    p = buf.sampling_mass().numpy()
    gs = buf.graph_sampler(batch_size=50, generator=torch.Generator().manual_seed(7))
    counts = np.zeros(E * M)
    for _ in range(400):
        _, idx = gs.sample()
        np.add.at(counts, idx.numpy(), 1)
    assert stats.chisquare(counts, p / p.sum() * counts.sum()).pvalue > 1e-4


def test_uniform_draws_cover_valid_starts_evenly():
    E, M = 2, 12
    buf = TransitionBuffer(E * M, 8, make_transition(0, 1, E), n_steps=2, device="cpu", seed=0)
    buf.insert(make_transition(0, 12, E, trunc_steps=(4,)))
    valid = buf.sampling_mass(with_next_obs=True).numpy() > 0
    gs = buf.graph_sampler(batch_size=40, with_next_obs=True, generator=torch.Generator().manual_seed(5))
    counts = np.zeros(E * M)
    for _ in range(300):
        np.add.at(counts, gs.sample()[1].numpy(), 1)
    assert counts[~valid].sum() == 0
    assert stats.chisquare(counts[valid]).pvalue > 1e-4


def test_set_beta_reaches_later_draws_and_bad_arguments_are_named():
    buf = PrioritizedTransitionBuffer(40, 4, make_transition(0, 1, 2), device="cpu", seed=0)
    with pytest.raises(ValueError, match="sample: no valid sequence start"):
        buf.graph_sampler()
    buf.insert(make_transition(0, 10, 2))
    buf.update_priorities(torch.arange(20), torch.arange(20.0))
    gs = buf.graph_sampler(generator=torch.Generator().manual_seed(0))
    gs.set_beta(1.0)
    out, idx = gs.sample()
    m = buf.sampling_mass()[idx]
    torch.testing.assert_close(out.PER_weights, (m / m.min()).pow(-1.0).float())
    with pytest.raises(ValueError, match="beta"):
        gs.set_beta(float("nan"))
    with pytest.raises(ValueError, match="generator: expected a torch.Generator"):
        buf.graph_sampler(generator=3)
    with pytest.raises(ValueError, match="batch_size"):
        buf.graph_sampler(batch_size=0)
    with pytest.raises(ValueError, match="boundaries: expected 'allow' or 'forbid'"):
        buf.graph_sampler(boundaries="mask")


def test_forbid_draws_windows_inside_one_episode(backend, device):
    E, M, n = 2, 20, 3
    buf = TransitionBuffer(E * M, 8, make_transition(0, 1, E), n_steps=n, device=device, seed=0)
    buf.insert(make_transition(0, 18, E, trunc_steps=(5, 11)))
    gs = buf.graph_sampler(batch_size=32, boundaries="forbid", generator=torch.Generator(device).manual_seed(0))
    for _ in range(3):
        out, idx = gs.sample()
        _check_windows(out, idx, E, M, n)
        assert not out.truncated[:, :-1].any()  # no episode end before the last row
        assert out.is_first[:, 0].all() and not out.is_first[:, 1:].any() and out.mask.all()


@pytest.mark.cuda
@pytest.mark.parametrize("prioritized", [False, True])
def test_a_cuda_graph_replays_the_sampler(prioritized):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cls = PrioritizedTransitionBuffer if prioritized else TransitionBuffer
    E, M, n = 4, 256, 4
    buf = cls(E * M, 64, make_transition(0, 1, E), n_steps=n, device="cuda", seed=0)
    buf.insert(make_transition(0, 100, E))
    gs = buf.graph_sampler()
    graph, out, idx = captured(gs)
    seen = set()
    for t in range(5):
        buf.insert(make_transition(100 + 10 * t, 10, E))
        graph.replay()
        torch.cuda.synchronize()
        _check_windows(out, idx, E, M, n)
        assert bool((buf.sampling_mass()[idx] > 0).all())
        seen.add(tuple(idx.tolist()))
    assert len(seen) == 5  # fresh random numbers at every replay


def test_a_load_keeps_the_samplers_tree_current(backend, device):
    E, M, n = 2, 8, 1
    buf = PrioritizedTransitionBuffer(E * M, 4, make_transition(0, 1, E), n_steps=n, device=device, seed=0)
    buf.insert(make_transition(0, 8, E))
    small = PrioritizedTransitionBuffer(E * M, 4, make_transition(0, 1, E), n_steps=n, device=device, seed=0)
    small.insert(make_transition(0, 3, E))
    gs = buf.graph_sampler(batch_size=64, generator=torch.Generator(device).manual_seed(0))
    buf.load_state_dict(small.state_dict())
    assert set(gs.sample()[1].tolist()) <= set(range(3 * E))  # only the loaded rows
    buf.insert(make_transition(3, 2, E))
    assert set(gs.sample()[1].tolist()) <= set(range(5 * E))
    uniform = TransitionBuffer(E * M, 4, make_transition(0, 1, E), device=device)
    uniform.insert(make_transition(0, 3, E))
    with pytest.raises(ValueError, match="set_beta: the buffer is not prioritized"):
        uniform.graph_sampler().set_beta(0.5)


def _per_weights(buf, idx, beta):
    m = buf.sampling_mass()[idx]
    return (m / m.min()).pow(-beta).float()


def _prioritized(device, beta=0.4, **kw):
    buf = PrioritizedTransitionBuffer(40, 4, make_transition(0, 1, 2), beta=beta, device=device, seed=0, **kw)
    buf.insert(make_transition(0, 10, 2))
    buf.update_priorities(torch.arange(20), torch.arange(20.0) * (1 + beta))
    return buf


def test_the_sampler_follows_the_buffers_beta(device):
    """update_beta, load_state_dict and set_beta all set the one beta: the buffer's, which every draw reads."""
    buf = _prioritized(device)
    gs = buf.graph_sampler(batch_size=16, generator=torch.Generator(device).manual_seed(0))
    buf.update_beta(1.0)
    out, idx = gs.sample()
    torch.testing.assert_close(out.PER_weights, _per_weights(buf, idx, 1.0))
    buf.load_state_dict(_prioritized(device, beta=0.25).state_dict())
    out, idx = gs.sample()
    assert buf.beta == 0.25
    torch.testing.assert_close(out.PER_weights, _per_weights(buf, idx, 0.25))
    assert gs.set_beta(0.7) is gs and buf.beta == 0.7  # the sampler sets the buffer's beta
    out, idx = gs.sample()
    torch.testing.assert_close(out.PER_weights, _per_weights(buf, idx, 0.7))


@pytest.mark.parametrize("bad", [float("nan"), -0.5, "1"])
def test_a_bad_beta_names_beta_and_changes_nothing(bad, device):
    buf = _prioritized(device)
    gs = buf.graph_sampler(batch_size=16, generator=torch.Generator(device).manual_seed(0))
    for set_beta in (gs.set_beta, buf.update_beta):
        with pytest.raises(ValueError, match="beta: expected a finite number >= 0, got"):
            set_beta(bad)
        assert buf.beta == 0.4 and buf.beta_tensor.item() == 0.4
    with pytest.raises(AttributeError):
        buf.beta_tensor = torch.zeros(())  # read-only
    out, idx = gs.sample()
    torch.testing.assert_close(out.PER_weights, _per_weights(buf, idx, 0.4))


def test_a_reopened_storage_dir_buffer_samples_with_its_saved_beta(tmp_path):
    buf = _prioritized("cpu", storage_dir=tmp_path / "b")
    buf.update_beta(0.9)
    buf.close()
    again = PrioritizedTransitionBuffer(40, 4, make_transition(0, 1, 2), beta=0.4, device="cpu", seed=0,
                                        storage_dir=tmp_path / "b")
    assert again.beta == 0.9
    gs = again.graph_sampler(batch_size=16, generator=torch.Generator().manual_seed(0))
    out, idx = gs.sample()
    torch.testing.assert_close(out.PER_weights, _per_weights(again, idx, 0.9))
    again.update_beta(0.1)
    out, idx = gs.sample()
    torch.testing.assert_close(out.PER_weights, _per_weights(again, idx, 0.1))
    again.close()


@pytest.mark.cuda
def test_a_captured_graph_follows_the_buffers_beta():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    buf = _prioritized("cuda")
    gs = buf.graph_sampler(batch_size=16)
    graph, out, idx = captured(gs)
    for change, beta in ((lambda: buf.update_beta(1.0), 1.0), (lambda: gs.set_beta(0.6), 0.6),
                         (lambda: buf.load_state_dict(_prioritized("cuda", beta=0.2).state_dict()), 0.2)):
        change()
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.PER_weights, _per_weights(buf, idx, beta))


def captured(gs):
    """``(graph, out, indices)``: ``gs.sample()`` captured in a CUDA graph after warm-up calls on a side
    stream (Triton compiles outside the capture)."""
    graph, (out, idx) = capture_graph(gs.sample)
    return graph, out, idx
