"""``sample(out=...)`` in a loop: the check of an ``out`` passed again is kept (its word views too), and nothing that
changed since is written through the kept views."""

import copy

import pytest
import torch
from fixtures import make_transition

from gpubuf import TransitionBuffer

E, M, n = 3, 16, 4


def build():
    buf = TransitionBuffer(E * M, 5, make_transition(0, 1, E), n_steps=n, seed=0)
    buf.insert(make_transition(0, 10, E))
    return buf


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(vars(a).values(), vars(b).values(), strict=True)
               if isinstance(x, torch.Tensor))


def test_an_out_passed_again_gets_the_windows_a_fresh_sample_gets():
    buf = build()
    out = buf.sample(key=0)
    for t in range(6):
        buf.insert(make_transition(10 + 3 * t, 3, E))  # the ring wraps
        got = buf.sample(key=t, out=out)
        assert got is out
        assert same(got, buf.sample(key=t))


def test_another_out_of_the_same_shapes_is_written_and_the_first_is_left_alone():
    buf = build()
    first = buf.sample(key=0)
    buf.sample(key=1, out=first)
    kept = copy.deepcopy(first)
    second = buf.sample(key=2)
    for t in range(3):
        assert same(buf.sample(key=10 + t, out=second), buf.sample(key=10 + t))
    assert same(first, kept)


@pytest.mark.parametrize("change", ["wrong dtype", "wrong shape", "reallocated", "non-contiguous"])
def test_an_out_changed_since_its_last_check_is_checked_again(change):
    buf = build()
    out = buf.sample(key=0)
    buf.sample(key=1, out=out)
    obs = out.observation
    before = obs.clone()
    if change == "wrong dtype":
        out.observation = obs.double()
    elif change == "wrong shape":
        out.observation = obs[:, :-1].clone()
    elif change == "reallocated":
        out.observation = obs.clone()
    else:
        out.observation = obs.transpose(0, 1).contiguous().transpose(0, 1)
    if change == "reallocated":
        got = buf.sample(key=3, out=out)
        assert same(got, buf.sample(key=3)) and got.observation is out.observation
        assert torch.equal(obs, before)  # the old leaf is not written through views kept from it
    else:
        with pytest.raises(ValueError, match="out.observation"):
            buf.sample(key=3, out=out)
