"""The checked priority write: the Triton kernel (interpreted here), the numba loop and the torch twin give the same
writes on odd sizes with index-valued data, set every check bit, keep the largest of duplicates, and write nothing
when a check fails; and the importance weights op in its forms."""

import numpy as np
import pytest
import torch

from gpubuf.ops import BAD_INDEX, NOT_FINITE, OVERFLOW, backend_table, host_loops, priorities
from gpubuf.replay.sampling.tree import PrefixSumTree

CPU = torch.device("cpu")
IMPLEMENTATIONS = {"twin": priorities.write_twin, "numba": priorities.write_host, "triton": priorities.write_cuda,
                   "host-checked": priorities.write_host_checked}


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def write(request):
    if request.param == "numba" and not host_loops.ENABLED:
        pytest.skip('needs numba: pip install "gpubuf[fast]"')
    return IMPLEMENTATIONS[request.param]


def state(size: int, n_trees: int, fanout: int = 4):
    """Priorities ``i`` of start ``i`` (index-valued), ``n_trees`` trees of masses ``i ** alpha`` (alpha 1) where
    valid (every third start invalid in the second tree), a running maximum and a result."""
    prio = torch.arange(size, dtype=torch.float32)
    valids = [torch.ones(size, dtype=torch.bool), torch.arange(size) % 3 != 0][:n_trees]
    trees = []
    for valid in valids:
        t = PrefixSumTree(size, backend_table(CPU, "torch"), fanout)
        t.update_range(0, prio.double() * valid)
        trees.append(t)
    return prio, trees, valids, torch.full((1,), 2.0, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)


def run(write, size, n_trees, idx, td, eps=0.0, limit=1e30):
    prio, trees, valids, box, result = state(size, n_trees)
    write(prio, [t.tree for t in trees], valids, trees[0].offsets if trees else [0], 4, idx, td, eps, 1.0, limit,
          box, result)
    return prio, [t.tree for t in trees], box, result


@pytest.mark.parametrize("size, K, n_trees", [(1, 1, 1), (37, 9, 2), (1031, 2053, 1), (4099, 300, 2), (50, 5, 0)])
def test_every_implementation_writes_as_the_twin(write, size, K, n_trees):
    g = torch.Generator().manual_seed(size)
    idx = torch.randint(0, size, (K,), generator=g)  # duplicates when K is large
    td = torch.randint(-1000, 1000, (K,), generator=g).to(torch.float64)  # integers: every sum exact
    want = run(priorities.write_twin, size, n_trees, idx, td)
    got = run(write, size, n_trees, idx, td)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True))
    assert got[3].tolist() == [0.0, float(td.abs().max())] and got[2][0] == max(2.0, float(td.abs().max()))
    # the written starts hold their largest new priority, every other start its own index
    expect = torch.arange(size, dtype=torch.float32)
    expect.scatter_reduce_(0, idx, td.abs().float(), "amax", include_self=False)
    assert torch.equal(got[0], expect)


def test_duplicates_keep_their_largest_new_value_even_below_the_old_one(write):
    prio, _, box, result = run(write, 40, 1, torch.tensor([30, 30, 7, 30]), torch.tensor([1.0, -3.0, 2.0, 2.5]),
                               eps=0.5)
    assert prio[30] == 3.5 and prio[7] == 2.5 and result.tolist() == [0.0, 3.5] and box[0] == 3.5


@pytest.mark.parametrize("idx, td, code", [
    ([1, 40], [1.0, 1.0], BAD_INDEX),
    ([1, -1], [1.0, 1.0], BAD_INDEX),
    ([1, 2], [1.0, float("nan")], NOT_FINITE),
    ([1, 2], [float("inf"), 1.0], NOT_FINITE),
    ([1, 2], [1e39, 1.0], NOT_FINITE),  # finite in float64, not in float32
    ([1, 2], [1e9, 1.0], OVERFLOW),
    ([1, 45], [float("nan"), 1e9], BAD_INDEX | NOT_FINITE),  # overflow is checked once the others pass
    ([1, 45], [3.0, 1e9], BAD_INDEX),
])
def test_every_check_sets_its_bit_and_nothing_is_written(write, idx, td, code):
    before = state(40, 2)
    prio, trees, box, result = run(write, 40, 2, torch.tensor(idx), torch.tensor(td, dtype=torch.float64),
                                   eps=1e-6, limit=1e8)
    assert int(result[0]) == code
    assert torch.equal(prio, before[0]) and torch.equal(box, before[3])
    assert all(torch.equal(t, b.tree) for t, b in zip(trees, before[1], strict=True))


def test_the_limit_is_the_float64_bound_whatever_runs(write):
    """A float32 priority just below the bound is written, one at the bound is not (the kernel compares in float32
    against the smallest float32 at or above the bound)."""
    limit = 1e6 + 0.3
    at = np.float32(limit)
    at = at if float(at) >= limit else np.nextafter(at, np.float32(np.inf))
    below = np.nextafter(at, np.float32(0))
    assert float(below) < limit <= float(at)
    for value, code in ((below, 0), (at, OVERFLOW)):
        *_, result = run(write, 10, 1, torch.tensor([2]), torch.tensor([float(value)]), limit=limit)
        assert int(result[0]) == code


def test_the_table_binds_one_write_per_backend(monkeypatch):
    monkeypatch.setattr(host_loops, "ENABLED", False)
    assert backend_table(CPU, "torch").priority_write is not backend_table(CPU, "triton").priority_write
    assert backend_table(CPU, "torch").implementations()["priority_write"] == "host-checked torch"


# ---- importance weights


WEIGHTS = {"twin": priorities.weights_twin, "numba": priorities.weights_host}


@pytest.mark.parametrize("form", sorted(WEIGHTS))
def test_importance_weights_of_one_batch(form):
    if form == "numba" and not host_loops.ENABLED:
        pytest.skip('needs numba: pip install "gpubuf[fast]"')
    mass = torch.tensor([4.0, 1.0, 2.0, 8.0], dtype=torch.float64)
    got = WEIGHTS[form](mass, 0.5)
    assert got.dtype == torch.float32 and torch.equal(got, torch.tensor([0.5, 1.0, 2**-0.5, 8**-0.5]))


def test_importance_weights_per_minibatch_from_a_device_beta_without_allocating():
    mass = torch.tensor([[4.0, 1.0, 2.0], [3.0, 6.0, 12.0]], dtype=torch.float64)
    beta = torch.tensor(1.0, dtype=torch.float64)
    want = torch.tensor([[0.25, 1.0, 0.5], [1.0, 0.5, 0.25]])
    assert torch.equal(priorities.weights_twin(mass.clone(), beta), want)
    out, work = torch.empty(2, 3), (torch.empty(2, 1, dtype=torch.float64), torch.empty((), dtype=torch.float64))
    scratch = mass.clone()
    assert priorities.weights_twin(scratch, beta, out, work) is out and torch.equal(out, want)
    beta.fill_(0.0)  # read when the call runs
    assert torch.equal(priorities.weights_twin(mass.clone(), beta, out, work), torch.ones(2, 3))
