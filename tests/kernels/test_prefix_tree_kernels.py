"""Kernels of kernels/prefix_tree.py and kernels/sequence.py against their torch twins, and tree properties.

Without CUDA the Triton kernels run through the interpreter on CPU tensors (TRITON_INTERPRET=1, set in
conftest), so sizes stay small and odd. With CUDA every tensor lives on the GPU; sums computed there are
compared with host sums to a stated tolerance (``GPU_RTOL``: reductions may add in another order).
"""

import functools

import numpy as np
import pytest
import torch
from scipy import stats

from gpubuf.kernels import prefix_tree as pt
from gpubuf.kernels import sequence as sequence_kernels
from gpubuf.ops import backend_table, host_loops
from gpubuf.ops.prefix_tree import sample_twin, update_range_twin, update_twin
from gpubuf.ops.sequence import gather_twin
from gpubuf.replay.sampling.tree import PrefixSumTree

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GPU_RTOL = 1e-13  # float64 sums of <= 64 positive terms, added in any order, agree to ~64 ulp (1.4e-14)


def make_tree(capacity, fanout, seed=0, zero_frac=0.3):
    """A tree with random leaf masses (some exactly zero) built through the torch twin."""
    g = torch.Generator().manual_seed(seed)
    tree = PrefixSumTree(capacity, backend_table(torch.device(DEVICE), "torch"), fanout)
    tree.tree = torch.zeros(tree.size, dtype=torch.float64, device=DEVICE)
    mass = torch.rand(capacity, generator=g, dtype=torch.float64) * 10
    mass[torch.rand(capacity, generator=g) < zero_frac] = 0
    tree.update(torch.arange(capacity, device=DEVICE), mass.to(DEVICE))
    return tree, mass


@pytest.mark.parametrize("capacity, fanout", [(1, 16), (37, 16), (1000, 16), (300, 64)])
def test_tree_levels_are_sums_of_children(capacity, fanout):
    tree, mass = make_tree(capacity, fanout)
    t, off = tree.tree.cpu(), tree.offsets
    assert off[-1] - off[-2] == fanout  # the top level is one node
    for k in range(1, len(off) - 1):
        children = t[off[k - 1]:off[k]].view(-1, fanout)
        child = children.sum(1)
        if DEVICE == "cpu" and host_loops.ENABLED:  # the compiled host loops add the children in order
            child = functools.reduce(torch.add, children.unbind(1))
        if DEVICE == "cpu":  # the same host reduction: bit for bit
            assert torch.equal(t[off[k]:off[k] + child.numel()], child)
        else:  # GPU sums against host sums of the same children
            torch.testing.assert_close(t[off[k]:off[k] + child.numel()], child, rtol=GPU_RTOL, atol=0)
    assert tree.total().item() == pytest.approx(mass.sum().item(), rel=1e-12)


@pytest.mark.parametrize("capacity, fanout", [(37, 16), (1000, 16), (300, 64)])
def test_sample_kernel_matches_twin(capacity, fanout):
    tree, mass = make_tree(capacity, fanout, seed=capacity)
    u = torch.rand(53, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    u[0], u[1] = 0.0, 1.0 - 2**-53  # both ends of [0, 1)
    ref = torch.empty(53, dtype=torch.int64, device=DEVICE)
    out = torch.empty_like(ref)
    sample_twin(tree.tree, tree.offsets, fanout, u, ref)
    pt.sample(tree.tree, tree.offsets, fanout, u, out)
    assert torch.equal(ref, out)
    assert (mass[ref.cpu()] > 0).all()  # never a zero-mass leaf
    # the picked leaf's interval holds u * total
    cum = torch.cumsum(mass, 0)
    tgt = u.cpu() * mass.sum()
    assert ((cum[ref.cpu()] - mass[ref.cpu()] <= tgt * (1 + 1e-12)) & (tgt <= cum[ref.cpu()] * (1 + 1e-12))).all()


@pytest.mark.parametrize("capacity, fanout, K", [(37, 16, 5), (1000, 16, 41), (300, 64, 17)])
def test_update_kernel_matches_twin(capacity, fanout, K):
    a, _ = make_tree(capacity, fanout, seed=3)
    b = a.tree.clone()
    g = torch.Generator().manual_seed(K)
    idx = torch.randint(0, capacity, (K,), generator=g)
    idx[-1] = idx[0]  # a duplicate, carrying the same value
    vals = torch.rand(capacity, generator=g, dtype=torch.float64)[idx]
    update_twin(a.tree, a.offsets, fanout, idx.to(DEVICE), vals.to(DEVICE))
    pt.update(b, a.offsets, fanout, idx.to(DEVICE), vals.to(DEVICE))
    assert torch.equal(a.tree[:capacity], b[:capacity])  # leaves exactly
    torch.testing.assert_close(a.tree, b, rtol=1e-14, atol=0)  # parent sums: reduction order may differ


@pytest.mark.parametrize("dtype, shape", [(torch.uint8, (5, 3)), (torch.float32, (7,)), (torch.bool, ()),
                                          (torch.int64, (2, 3))])
@pytest.mark.parametrize("shift", [0, 1])
def test_sequence_gather_matches_twin(dtype, shape, shift):
    M, E, n, B = 11, 3, 4, 9
    D = int(np.prod(shape))
    storage = (torch.arange(M * E * D) % 251).to(dtype).view(M * E, D).to(DEVICE)  # value = index (mod)
    starts = torch.randint(0, M * E, (B,), generator=torch.Generator().manual_seed(shift)).to(DEVICE)
    ref = torch.empty((B, n, D), dtype=dtype, device=DEVICE)
    out = torch.empty_like(ref)
    other = (torch.arange(M * E * 2) % 97).view(M * E, 2).to(DEVICE)  # a second leaf in the same call
    other_ref, other_out = (torch.empty((B, n, 2), dtype=other.dtype, device=DEVICE) for _ in range(2))
    gather_twin([(storage, ref, shift), (other, other_ref, 1 - shift)], starts, n, E, M)
    sequence_kernels.gather([(storage, out, shift), (other, other_out, 1 - shift)], starts, n, E, M)
    assert torch.equal(ref, out) and torch.equal(other_ref, other_out)
    s = starts.cpu()
    other_rows = ((s // E).unsqueeze(1) + torch.arange(n) + 1 - shift) % M * E + (s % E).unsqueeze(1)
    assert torch.equal(other_ref.cpu(), other.cpu()[other_rows])
    s = starts.cpu()
    rows = ((s // E).unsqueeze(1) + torch.arange(n) + shift) % M * E + (s % E).unsqueeze(1)
    assert torch.equal(ref.cpu(), storage.cpu()[rows])


def test_tree_sampling_frequencies():
    tree, mass = make_tree(500, 16, seed=5, zero_frac=0.5)
    u = torch.rand(100000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    out = torch.empty(100000, dtype=torch.int64)
    sample_twin(tree.tree, tree.offsets, 16, u, out)
    counts = torch.bincount(out, minlength=500).numpy()
    live = (mass > 0).numpy()
    assert counts[~live].sum() == 0
    p = mass.numpy()[live] / mass.sum().item()
    assert stats.chisquare(counts[live], p * 100000).pvalue > 1e-4


def test_float_drift_after_millions_of_updates():
    """3 million leaf updates (3000 vectorised batches of 1000 indices, priorities spanning 12 decades): the
    tree stays a deterministic function of its leaves, so afterwards every live leaf is still sampled."""
    cap, F = 1000, 16
    tree = PrefixSumTree(cap, backend_table(torch.device("cpu"), "torch"), F)
    tree.tree = torch.zeros(tree.size, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    for _ in range(3000):
        idx = torch.randint(0, cap, (1000,), generator=g).unique()
        tree.update(idx, torch.pow(10.0, torch.rand(idx.numel(), generator=g, dtype=torch.float64) * 12 - 6))
    idx = torch.arange(cap)
    tree.update(idx, torch.ones(cap, dtype=torch.float64))  # all equal again: every leaf must be reachable
    assert tree.total().item() == cap
    out = torch.empty(40000, dtype=torch.int64)
    sample_twin(tree.tree, tree.offsets, F, torch.rand(40000, dtype=torch.float64, generator=g), out)
    assert torch.bincount(out, minlength=cap).min() > 0


@pytest.mark.parametrize("capacity, fanout, K", [(5003, 16, 700), (300, 32, 513), (37, 16, 600)])
def test_many_program_update_matches_twin(capacity, fanout, K, monkeypatch):
    """Updates of MANY_PROGRAMS_FROM leaves or more: one launch per level over many programs (here 1 <= every
    update), indexed with duplicates and contiguous ranges, against the twin."""
    a, _ = make_tree(capacity, fanout, seed=K)
    b = a.tree.clone()
    g = torch.Generator().manual_seed(K)
    idx = torch.randint(0, capacity, (K,), generator=g)
    vals = torch.rand(capacity, generator=g, dtype=torch.float64)[idx]  # duplicates carry equal values
    assert K >= pt.MANY_PROGRAMS_FROM
    update_twin(a.tree, a.offsets, fanout, idx.to(DEVICE), vals.to(DEVICE))
    pt.update(b, a.offsets, fanout, idx.to(DEVICE), vals.to(DEVICE))
    assert torch.equal(a.tree[:capacity], b[:capacity])
    torch.testing.assert_close(a.tree, b, rtol=1e-14, atol=0)
    monkeypatch.setattr(pt, "MANY_PROGRAMS_FROM", 1)  # small ranges too, the top level crossing nodes
    for lo, n in [(0, capacity), (capacity - 37, 37), (3, 29)]:
        v = torch.rand(n, generator=g, dtype=torch.float64).to(DEVICE)
        update_range_twin(a.tree, a.offsets, fanout, lo, v)
        pt.update_range(b, a.offsets, fanout, lo, v)
        assert torch.equal(a.tree[:capacity], b[:capacity])
        torch.testing.assert_close(a.tree, b, rtol=1e-14, atol=0)


def test_many_program_grids_cover_every_touched_parent():
    # levels: 2**20+32, 2**15+32, 1056, 64, 32
    tree = PrefixSumTree(2**20 + 5, backend_table(torch.device("cpu"), "torch"), 32)
    assert pt.level_grids(2**20 + 5, 0, tree.offsets, 32, True) == [1025, 1025, 33, 2, 1]
    assert pt.level_grids(4096, 0, tree.offsets, 32, False) == [4, 128, 128, 128, 128]
    assert pt.level_grids(40, 31, tree.offsets, 32, True) == [1, 1, 1, 1, 1]


@pytest.mark.cuda
@pytest.mark.parametrize("K", [4096, 100])
def test_cuda_update_at_scale_with_fanout_32(K):
    """2**20 + 3 leaves, fanout 32 (the buffers' fanout): scattered updates (many programs for K = 4096, one
    for K = 100) and a full range rebuild against the twin on the GPU."""
    cap, F = 2**20 + 3, 32
    a, _ = make_tree(cap, F, seed=11)
    b = a.tree.clone()
    g = torch.Generator().manual_seed(K)
    idx = torch.randint(0, cap, (K,), generator=g)
    vals = torch.rand(cap, generator=g, dtype=torch.float64)[idx]
    update_twin(a.tree, a.offsets, F, idx.to(DEVICE), vals.to(DEVICE))
    pt.update(b, a.offsets, F, idx.to(DEVICE), vals.to(DEVICE))
    assert torch.equal(a.tree[:cap], b[:cap])
    torch.testing.assert_close(a.tree, b, rtol=1e-14, atol=0)
    full = torch.rand(cap, generator=g, dtype=torch.float64).to(DEVICE)
    update_range_twin(a.tree, a.offsets, F, 0, full)
    pt.update_range(b, a.offsets, F, 0, full)
    assert torch.equal(a.tree[:cap], b[:cap])
    torch.testing.assert_close(a.tree, b, rtol=1e-14, atol=0)
    torch.testing.assert_close(b[a.offsets[-2]:].sum().cpu(), full.cpu().sum(), rtol=GPU_RTOL, atol=0)


@pytest.mark.cuda
def test_cuda_kernels_match_twin_at_scale():
    tree, mass = make_tree(2**20 + 3, 64, seed=9)
    u = torch.rand(4096, dtype=torch.float64, device="cuda")
    ref = torch.empty(4096, dtype=torch.int64, device="cuda")
    out = torch.empty_like(ref)
    sample_twin(tree.tree, tree.offsets, 64, u, ref)
    pt.sample(tree.tree, tree.offsets, 64, u, out)
    assert (ref == out).float().mean() > 0.999  # boundary ties may round differently
    assert (mass.cuda()[out] > 0).all()


@pytest.mark.parametrize("lo, K", [(0, 1000), (5, 17), (990, 10), (63, 130)])
def test_range_update_matches_indexed_update(lo, K):
    a, _ = make_tree(1000, 16, seed=4)
    b = a.tree.clone()
    vals = torch.rand(K, dtype=torch.float64, generator=torch.Generator().manual_seed(K)).to(DEVICE)
    update_range_twin(a.tree, a.offsets, 16, lo, vals)
    update_twin(b, a.offsets, 16, torch.arange(lo, lo + K, device=DEVICE), vals)
    torch.testing.assert_close(a.tree, b, rtol=1e-14, atol=0)


def _adversarial(capacity, kind):
    mass = torch.zeros(capacity, dtype=torch.float64)
    if kind == "one live leaf first":
        mass[0] = 1.0
    elif kind == "one live leaf last":
        mass[-1] = 1e-300
    elif kind == "one subnormal leaf":
        mass[capacity // 2] = 5e-324
    elif kind == "subnormals":
        mass[::7] = 5e-324
    elif kind == "huge (sums overflow to inf)":
        mass[::3] = 1e308
    elif kind == "huge and subnormal":
        mass[1::5], mass[2::5] = 1.7e308, 5e-324
    return mass


@pytest.mark.parametrize("capacity, fanout", [(37, 16), (300, 32), (5003, 16)])
@pytest.mark.parametrize("kind", ["one live leaf first", "one live leaf last", "one subnormal leaf", "subnormals",
                                  "huge (sums overflow to inf)", "huge and subnormal"])
def test_descent_never_returns_a_dead_or_padding_leaf(capacity, fanout, kind):
    """Zeros, subnormals, infinite sums, a single live leaf: both the twin and the kernel return only leaves
    of positive mass below the capacity, for uniforms across [0, 1) including both ends."""
    mass = _adversarial(capacity, kind)
    tree = PrefixSumTree(capacity, backend_table(torch.device(DEVICE), "torch"), fanout)
    tree.tree = torch.zeros(tree.size, dtype=torch.float64, device=DEVICE)
    tree.update(torch.arange(capacity, device=DEVICE), mass.to(DEVICE))
    u = torch.cat([torch.tensor([0.0, 1.0 - 2**-53, 0.5]), torch.rand(29, dtype=torch.float64,
                   generator=torch.Generator().manual_seed(capacity))]).to(DEVICE)
    for sample in (sample_twin, pt.sample):
        out = torch.full((u.numel(),), -1, dtype=torch.int64, device=DEVICE)
        sample(tree.tree, tree.offsets, fanout, u, out)
        out = out.cpu()
        assert ((out >= 0) & (out < capacity)).all(), (sample.__module__, out.max().item())
        assert (mass[out] > 0).all(), sample.__module__
