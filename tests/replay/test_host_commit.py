"""HostCommit: an insert's bookkeeping on the CPU in compiled loops equals the reference path bit for bit.

The reference is ``StartRing.write`` then the sampler's ``rows_written`` (numpy and torch); the compiled path runs the
same work as two numba loops. Two buffers take the same inserts (random flags, episode ends, rows holding no
transition, ring wraps, priority updates between them, validity kinds kept from different points on), one through
each path, and must hold the same flags, counts, validity, masks, priorities and trees after every insert."""

import numpy as np
import pytest
import torch

from gpubuf import PrioritizedTransitionBuffer, Transition, TransitionBuffer, Unit
from gpubuf.ops import host_loops

pytestmark = pytest.mark.skipif(not host_loops.ENABLED, reason='needs numba: pip install "gpubuf[fast]"')


def random_rows(rng: np.random.Generator, T: int, E: int, g0: int, is_last: bool) -> Transition:
    """T rows of E envs, observation = global row index (a wrong row shows), random ends."""
    obs = (np.arange(g0, g0 + T, dtype=np.float32)[:, None, None] * 10 + np.arange(E)[:, None]).repeat(2, 2)
    tr = Transition(observation=obs, action=rng.standard_normal((T, E, 1)).astype(np.float32),
                    reward=rng.standard_normal((T, E)).astype(np.float32),
                    terminated=rng.random((T, E)) < 0.15, truncated=rng.random((T, E)) < 0.1)
    if is_last:
        tr.info = {"is_last": rng.random((T, E)) < 0.1}
    return tr


def bookkeeping(buf) -> dict:
    """Every array and count the insert's bookkeeping writes."""
    ring, sampler = buf.ring, buf.sampler
    state = {"pos": ring.pos, "count": ring.count, "total": ring.total, "trunc": ring.trunc.copy(),
             "ends": ring.ends.copy(), "last": ring.last.copy(),
             "n": (ring.n_trunc, ring.n_ends, ring.n_last), "n_valid": dict(ring.n_valid),
             "valid": {k: v.copy() for k, v in ring.valid.items()}}
    for kind in sampler.kept_kinds():
        state[f"mask{kind}"] = sampler.valid_mask(kind).clone()
        state[f"tree{kind}"] = sampler.tree(kind).tree.clone()
    if sampler.prioritized:
        state["priority"] = sampler.priority.clone()
    return state


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k, va in a.items():
        vb = b[k]
        if isinstance(va, dict):
            assert va.keys() == vb.keys(), k
            for kk in va:
                assert np.array_equal(va[kk], vb[kk]), (k, kk)
        elif isinstance(va, torch.Tensor):
            assert torch.equal(va, vb), k  # float64 trees: bit for bit
        else:
            assert np.array_equal(va, vb), (k, va, vb)


@pytest.mark.parametrize("prioritized", [False, True])
@pytest.mark.parametrize("n_steps", [1, 3])
@pytest.mark.parametrize(("E", "is_last"), [(1, False), (3, False), (3, True)])
def test_compiled_commit_equals_the_reference_path(prioritized, n_steps, E, is_last):
    rng = np.random.default_rng(n_steps * 10 + E + is_last)
    cls = PrioritizedTransitionBuffer if prioritized else TransitionBuffer
    M = 13  # odd: windows and wraps land everywhere
    fast, ref = (cls(M * E, 4, random_rows(rng, 1, E, 0, is_last), n_steps=n_steps, seed=0) for _ in range(2))
    assert fast._commit is not None
    ref._commit = None  # the reference: StartRing.write + the sampler's rows_written
    kinds = [(False, "allow"), (True, "allow"), (False, "forbid"), (True, "forbid")]
    g = 0
    for step in range(40):
        T = int(rng.integers(1, M + 1)) if step % 5 == 4 else int(rng.integers(1, 4))
        rows = random_rows(rng, T, E, g, is_last)
        g += T
        for buf in (fast, ref):
            buf.insert(rows)
        if step % 8 == 3 and kinds:  # keep one more validity kind from here on
            nxt, bounds = kinds.pop(0)
            for buf in (fast, ref):
                buf.num_valid(nxt, bounds)
                buf.sampling_mass(nxt, bounds)
        if prioritized and step % 4 == 1 and len(ref):
            idx = rng.integers(0, M * E, 5)
            td = rng.random(5) * 4
            for buf in (fast, ref):
                buf.update_priorities(idx, td)
        assert_same(bookkeeping(fast), bookkeeping(ref))
    for unit, bounds in [(Unit.window(), "allow"), (Unit.transition(), "forbid")]:
        if ref.num_valid(unit == Unit.transition(), bounds):
            a, b = (buf.sample(batch_size=16, boundaries=bounds, unit=unit, key=5, with_replacement=True)
                    for buf in (fast, ref))
            assert torch.equal(a.indices, b.indices) and torch.equal(a.observation, b.observation)


def test_a_cuda_buffer_or_a_selector_keeps_the_reference_path():
    from gpubuf import Fifo

    rows = random_rows(np.random.default_rng(0), 1, 1, 0, False)
    assert TransitionBuffer(8, 2, rows, selector=Fifo())._commit is not None  # the selector is told as before
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(host_loops, "ENABLED", False)
        assert TransitionBuffer(8, 2, rows)._commit is None
