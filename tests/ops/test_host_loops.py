"""The compiled host loops (numba) against their pure-torch twins, on odd-sized trees whose masses name their
leaves (leaf ``i`` holds ``i + 1``, so a wrong index shows), and the checked priority write."""

import numpy as np
import pytest
import torch

from gpubuf.ops import backend_table, host_loops
from gpubuf.ops import prefix_tree as pt
from gpubuf.replay.sampling.tree import PrefixSumTree

pytestmark = pytest.mark.skipif(not host_loops.ENABLED, reason="numba is not installed")
CPU = torch.device("cpu")


def trees(capacity: int, fanout: int):
    a, b = (PrefixSumTree(capacity, backend_table(CPU, "torch"), fanout) for _ in range(2))
    values = torch.arange(1, capacity + 1, dtype=torch.float64)
    pt.update_range_twin(a.tree, a.offsets, fanout, 0, values)
    pt.update_range_host(b.tree, b.offsets, fanout, 0, values)
    return a, b


@pytest.mark.parametrize("capacity, fanout", [(1, 32), (7, 4), (33, 32), (1000, 32), (4099, 8), (70001, 32)])
def test_the_loops_build_update_and_descend_as_the_twins(capacity, fanout):
    a, b = trees(capacity, fanout)
    assert torch.equal(a.tree[:capacity], b.tree[:capacity])
    torch.testing.assert_close(a.tree, b.tree, rtol=1e-15, atol=0)  # parents: sums in another order
    g = torch.Generator().manual_seed(capacity)
    for _ in range(3):
        idx = torch.randint(0, capacity, (257,), generator=g)  # duplicates carry equal values
        values = (idx * 3 % 17 + 1).to(torch.float64)
        pt.update_twin(a.tree, a.offsets, fanout, idx, values)
        pt.update_host(b.tree, b.offsets, fanout, idx, values)
        torch.testing.assert_close(a.tree, b.tree, rtol=1e-15, atol=0)
        lo = int(torch.randint(0, capacity, (1,), generator=g))
        span = torch.arange(lo, min(capacity, lo + 45), dtype=torch.float64) + 0.5
        pt.update_range_twin(a.tree, a.offsets, fanout, lo, span)
        pt.update_range_host(b.tree, b.offsets, fanout, lo, span)
        torch.testing.assert_close(a.tree, b.tree, rtol=1e-15, atol=0)
    u = torch.rand(999, dtype=torch.float64, generator=g)
    u[:3] = torch.tensor([0.0, 1.0 - 2**-53, 0.5])
    want, got = torch.empty(999, dtype=torch.int64), torch.empty(999, dtype=torch.int64)
    pt.sample_twin(a.tree, a.offsets, fanout, u, want)
    pt.sample_host(b.tree, b.offsets, fanout, u, got)
    assert torch.equal(got, want)


def test_a_descent_never_picks_a_leaf_of_zero_mass():
    a, b = trees(200, 8)
    zero = torch.arange(0, 200, 2)
    pt.update_host(b.tree, b.offsets, 8, zero, torch.zeros(100, dtype=torch.float64))
    u = torch.linspace(0, 1 - 2**-53, 5001, dtype=torch.float64)
    out = torch.empty(5001, dtype=torch.int64)
    pt.sample_host(b.tree, b.offsets, 8, u, out)
    assert bool((out % 2 == 1).all()) and set(out.tolist()) == set(range(1, 200, 2))


def test_the_priority_write_checks_everything_before_writing():
    prio = np.ones(10, np.float32)
    eps = np.float32(1e-6)
    code, top = host_loops.priority_write(prio, np.array([3, 3, 7]), np.array([-2.0, 5.0, 1.0]), eps, 1e30)
    assert code == 0 and top == pytest.approx(5.0)
    assert prio[3] == np.float32(5.0) + eps and prio[7] == np.float32(1.0) + eps  # duplicates: their largest
    before = prio.copy()
    cases = [(np.array([1, 10]), np.ones(2), host_loops.BAD_INDEX),
             (np.array([1, -1]), np.ones(2), host_loops.BAD_INDEX),
             (np.array([1, 2]), np.array([1.0, np.nan]), host_loops.NOT_FINITE),
             (np.array([1, 2]), np.array([np.inf, 1.0]), host_loops.NOT_FINITE),
             (np.array([1, 2]), np.array([1e9, 1.0]), host_loops.OVERFLOW),
             (np.array([1, 20]), np.array([np.nan, 1.0]), host_loops.BAD_INDEX | host_loops.NOT_FINITE)]
    for idx, td, want in cases:
        code, _ = host_loops.priority_write(prio, idx, td, eps, 1e8)
        assert code == want
        assert np.array_equal(prio, before)
