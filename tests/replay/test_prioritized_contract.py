"""PrioritizedTransitionBuffer against its documented contract on both backends (triton: the interpreter on CPU)."""

import numpy as np
import pytest
import torch
from fixtures import Model, check_windows, make_transition
from scipy import stats

from gpubuf import PrioritizedTransitionBuffer

pytestmark = pytest.mark.usefixtures("host_loops")  # with the compiled host loops and with the torch twins


def build(E=3, M=10, n=2, B=4, device="cpu", **kw):
    return PrioritizedTransitionBuffer(M * E, B, make_transition(0, 1, E), n_steps=n, device=device, seed=0, **kw)


def primed(E, M, n, alpha, rows, td):
    """A buffer and its model holding ``rows`` rows of ``E`` envs, priorities of starts ``0..len(td)-1`` set
    from ``td``."""
    buf = build(E=E, M=M, n=n, alpha=alpha)
    model = Model(M, E, n)
    buf.insert(make_transition(0, rows, E))
    model.insert(rows)
    buf.update_priorities(np.arange(len(td)), td)
    model.update(range(len(td)), td, buf.eps)
    return buf, model


def probs(model: Model, alpha: float, with_next_obs=False) -> dict[int, float]:
    valid = sorted(model.valid_starts(with_next_obs))
    m = np.array([model.prio[i] ** alpha for i in valid])
    return dict(zip(valid, m / m.sum(), strict=True))


def test_none_arguments_take_the_buffer_s_defaults_and_return_indices_false_returns_the_batch_alone():
    """The one sample signature: ``None`` is the buffer's default (prioritized: without replacement, indices
    returned); ``return_indices=False`` returns the batch alone, the same draw as with indices."""
    from gpubuf import TransitionBuffer

    buf = build(E=2, M=6, n=1)
    buf.insert(make_transition(0, 6, 2))
    batch, flat = buf.sample(key=3, batch_size=12)  # without replacement: every start once
    assert sorted(flat.tolist()) == list(range(12))
    again, same = buf.sample(key=3, with_replacement=None, batch_size=12, return_indices=None)
    assert torch.equal(same, flat)
    alone = buf.sample(key=3, batch_size=12, return_indices=False)
    assert torch.equal(alone.observation, batch.observation) and torch.equal(alone.PER_weights, batch.PER_weights)
    uniform = TransitionBuffer(12, 4, make_transition(0, 1, 2), device="cpu", seed=0)
    uniform.insert(make_transition(0, 6, 2))
    got = uniform.sample(key=3, return_indices=None, with_replacement=None)
    assert not isinstance(got, tuple) and got.observation.shape == (4, 2)
    got, idx = uniform.sample(key=3, return_indices=True)
    assert idx.shape == (4,)


def test_sample_returns_indices_and_weights(backend, device):
    E, M, n = 3, 8, 2
    buf = build(E=E, M=M, n=n, device=device, alpha=0.7, beta=0.5)
    model = Model(M, E, n)
    buf.insert(make_transition(0, 6, E, trunc_steps=(2,)))
    model.insert(6, (2,))
    idx = torch.tensor([0, 4, 7, 9, 4])
    td = torch.tensor([3.0, -0.5, 0.01, 2.0, 0.7])
    buf.update_priorities(idx, td)
    model.update(idx.tolist(), td.tolist(), buf.eps)
    assert buf.max_priority == pytest.approx(3.0 + 1e-6)
    for wno in (False, True):
        batch, flat = buf.sample(key=1, batch_size=6, with_next_obs=wno)
        check_windows(batch, flat, model, wno)
        P = probs(model, 0.7, wno)
        N = len(P)
        w = np.array([(N * P[i]) ** -0.5 for i in flat.tolist()])
        assert batch.PER_weights.dtype == torch.float32 and batch.PER_weights.shape == (6,)
        np.testing.assert_allclose(batch.PER_weights.cpu().numpy(), w / w.max(), rtol=1e-5)
    # new starts get the running max priority
    buf.insert(make_transition(6, 2, E))
    model.insert(2)
    prio = buf.state_dict()["priority"].cpu().numpy()
    for i in range(6 * E, 8 * E):
        assert prio[i] == pytest.approx(model.prio[i])


def test_duplicates_resolve_to_largest(backend, device):
    buf = build(device=device)
    buf.insert(make_transition(0, 5, 3))
    buf.update_priorities(np.array([2, 2, 2, 5]), np.array([0.5, -4.0, 1.0, 0.1]))
    assert buf.state_dict()["priority"][2].item() == pytest.approx(4.0 + 1e-6)
    assert buf.state_dict()["priority"][5].item() == pytest.approx(0.1 + 1e-6)
    assert buf.max_priority == pytest.approx(4.0 + 1e-6)
    buf.update_priorities([2], [0.0])  # max_priority never decreases
    assert buf.max_priority == pytest.approx(4.0 + 1e-6)


def test_update_priorities_takes_strided_indices(backend, device):
    buf = build(device=device, alpha=1.0)
    buf.insert(make_transition(0, 5, 3))
    buf.sample(key=0)  # builds the tree, so the update below goes through the tree kernel
    idx = torch.tensor([[2, 0], [5, 0], [7, 0]])[:, 0]  # a strided view
    buf.update_priorities(idx, torch.tensor([1.0, 2.0, 3.0]))
    want = [1.0 + 1e-6, 2.0 + 1e-6, 3.0 + 1e-6]
    assert buf.sampling_mass()[[2, 5, 7]].tolist() == pytest.approx(want)
    assert buf.sampling_mass()[[0, 1]].tolist() == [1.0, 1.0]


def test_invalid_start_priority_keeps_zero_mass(backend, device):
    buf = build(device=device, n=3)
    buf.insert(make_transition(0, 4, 3))  # rows 2, 3 are no valid starts yet (windows of 3)
    buf.update_priorities([7, 10], [100.0, 100.0])
    assert buf.sampling_mass()[[7, 10]].tolist() == [0.0, 0.0]
    _, flat = buf.sample(key=0, batch_size=50, with_replacement=True)
    assert set(flat.tolist()) <= set(range(6))


def test_update_beta_and_state_dict(backend, device):
    buf = build(device=device)
    assert buf.update_beta(0.9) is buf and buf.beta == 0.9
    buf.insert(make_transition(0, 7, 3))
    buf.update_priorities([1, 4], [2.0, 5.0])
    other = build(device=device)
    other.load_state_dict(buf.state_dict())
    assert other.beta == 0.9 and other.max_priority == buf.max_priority
    a, ia = buf.sample()
    b, ib = other.sample()
    assert torch.equal(ia, ib) and torch.equal(a.PER_weights, b.PER_weights)


def test_per_chi_square_with_replacement():
    E, M, n, alpha = 2, 10, 2, 0.6
    buf, model = primed(E, M, n, alpha, 9, np.random.default_rng(0).uniform(0, 3, size=16))
    P = probs(model, alpha)
    _, flat = buf.sample(key=3, batch_size=40000, with_replacement=True)
    counts = np.bincount(flat.numpy(), minlength=M * E)
    keys = sorted(P)
    assert counts[[i for i in range(M * E) if i not in P]].sum() == 0
    assert stats.chisquare(counts[keys], np.array([P[k] for k in keys]) * 40000).pvalue > 1e-4


def test_per_without_replacement_is_plackett_luce():
    """First position ~ P; second position ~ sum_j P_j P_i / (1 - P_j) (together: the inclusion law for B=2)."""
    alpha = 1.0
    buf, model = primed(1, 8, 1, alpha, 8, np.array([0.1, 0.5, 1.0, 2.0, 4.0, 0.3, 0.05, 1.5]))
    P = np.array([probs(model, alpha)[i] for i in range(8)])
    trials = 3000
    first, second = np.zeros(8), np.zeros(8)
    for s in range(trials):
        _, flat = buf.sample(key=s, batch_size=2)
        a, b = flat.tolist()
        assert a != b
        first[a] += 1
        second[b] += 1
    p2 = np.array([sum(P[j] * P[i] / (1 - P[j]) for j in range(8) if j != i) for i in range(8)])
    assert stats.chisquare(first, P * trials).pvalue > 1e-4
    assert stats.chisquare(second, p2 / p2.sum() * trials).pvalue > 1e-4
    # the tree is restored exactly after sampling without replacement
    before = buf.sampling_mass()
    buf.sample(key=0, batch_size=8)
    assert torch.equal(before, buf.sampling_mass())


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs, match", [(dict(alpha=-1.0), "alpha"), (dict(beta=float("nan")), "beta"),
                                           (dict(eps=0.0), "eps")])
def test_bad_constructor(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build(**kwargs)


@pytest.mark.parametrize("indices, td, exc, match", [
    ([0, 1], [1.0, float("nan")], ValueError, "td_errors"),
    ([0, 1], [1.0, float("inf")], ValueError, "td_errors"),
    ([0, 30], [1.0, 1.0], IndexError, "indices"),
    ([0, -1], [1.0, 1.0], IndexError, "indices"),
    ([0.0, 1.0], [1.0, 1.0], TypeError, "indices"),
    ([0, 1], [1.0], ValueError, "td_errors"),
])
def test_bad_update_priorities_writes_nothing(indices, td, exc, match):
    buf = build()
    buf.insert(make_transition(0, 5, 3))
    prio, mass, mx = buf.state_dict()["priority"].clone(), buf.sampling_mass(), buf.max_priority
    with pytest.raises(exc, match=match):
        buf.update_priorities(np.array(indices), np.array(td))
    assert torch.equal(prio, buf.state_dict()["priority"]) and torch.equal(mass, buf.sampling_mass())
    assert mx == buf.max_priority


def test_bad_update_beta():
    buf = build()
    with pytest.raises(ValueError, match="beta"):
        buf.update_beta(-0.1)
    assert buf.beta == 0.4


@pytest.mark.cuda
def test_state_dict_round_trips_across_devices():
    """Save on CUDA, load on CPU and back: data, priorities and the RNG continue exactly."""
    gpu = build(device="cuda", alpha=0.8)
    gpu.insert(make_transition(0, 7, 3))
    gpu.update_priorities([1, 4, 9], [2.0, 0.5, 7.0])
    cpu = build(device="cpu", alpha=0.8)
    cpu.load_state_dict(gpu.state_dict())
    back = build(device="cuda", alpha=0.8)
    back.load_state_dict(cpu.state_dict())
    draws = [b.sample(batch_size=4)[1].cpu().tolist() for b in (gpu, cpu, back)]
    assert draws[0] == draws[1] == draws[2]
