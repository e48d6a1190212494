"""Samples are always real starts: a valid start's mass can never reach zero or overflow (eps and alpha are
checked where the mass is made), so no priority can hide a start or poison the tree. Both backends."""

import math

import pytest
import torch
from fixtures import make_transition

from gpubuf import PrioritizedTransitionBuffer


def build(device, **kw):
    buf = PrioritizedTransitionBuffer(30, 8, make_transition(0, 1, 3), n_steps=2, device=device, seed=0, **kw)
    return buf.insert(make_transition(0, 6, 3))  # starts 0..14 valid


@pytest.mark.parametrize("kw, match", [
    ({"eps": 1e-50}, "eps: expected at least 1.17549e-38"),
    ({"eps": 1e-6, "alpha": 60.0}, r"eps, alpha: eps\*\*alpha = 1e-06\*\*60 underflows float64"),
    ({"alpha": float("inf")}, "alpha: expected a finite number >= 0"),
    ({"eps": 0.0}, "eps: expected a finite number > 0"),
    ({"beta": -1.0}, "beta: expected a finite number >= 0"),
])
def test_masses_that_could_vanish_are_rejected_at_construction(kw, match):
    with pytest.raises(ValueError, match=match):
        build("cpu", **kw)


def test_a_start_at_the_smallest_priority_is_drawn_again_once_raised(backend, device):
    """alpha = 50: every start at priority eps has mass eps**50 = 1e-300 (> 0, still valid); raising one
    start's priority makes it (almost surely) the only one drawn, with finite importance weights."""
    buf = build(device, alpha=50.0)
    n = buf.num_valid()
    buf.update_priorities(torch.arange(n), torch.zeros(n))
    batch, idx = buf.sample(batch_size=8)
    assert torch.isfinite(batch.PER_weights).all() and (idx < n).all()
    buf.update_priorities([4], [1.0])
    batch, idx = buf.sample(batch_size=8, with_replacement=True)
    assert idx.tolist() == [4] * 8 and torch.isfinite(batch.PER_weights).all()


def test_priorities_that_would_overflow_the_mass_are_rejected(backend, device):
    buf = build(device, alpha=1000.0, eps=0.5)
    buf.update_priorities([1], [1.0])  # 1.5**1000 * 30 starts: still finite
    with pytest.raises(ValueError, match=r"td_errors, alpha: priority 2.5 \*\* alpha 1000 over 30 starts overflows"):
        buf.update_priorities([2], [2.0])
    assert buf.max_priority == 1.5
    _, idx = buf.sample(batch_size=4, with_replacement=True)
    assert idx.tolist() == [1] * 4  # the one start of priority 1.5 outweighs all others by 1.5**1000


def test_new_starts_take_a_max_priority_whose_mass_is_finite(backend, device):
    buf = build(device, alpha=100.0, eps=1e-3)
    buf.sample()
    buf.update_priorities([0], [1e3])  # (1e3)**100 = 1e300: finite
    buf.insert(make_transition(6, 2, 3))  # new starts get max_priority
    _, idx = buf.sample(batch_size=6)
    mass = buf.sampling_mass()
    assert (mass[idx] > 0).all() and math.isfinite(float(mass.sum()))
