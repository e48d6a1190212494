"""A call that raises leaves the buffer exactly as it was, whatever the cause: inputs that pass every shape
check but fail while being converted or copied (meta and sparse tensors, in the second key or leaf, on a
full buffer), and rejected priority updates. Both backends."""

import numpy as np
import pytest
import torch
from snapshots import assert_unchanged, snapshot
from test_replay_helpers import make_transition

from gpubuf import HistoryBuffer, PrioritizedTransitionBuffer, TransitionBuffer


def full_history(device):
    buf = HistoryBuffer(3, 4, 2, ("action",), device=device)
    for t in range(6):  # more than max_len: the next append overwrites the oldest entries
        buf.append({"pixels": np.full((3, 1, 2), t, np.uint8), "action": np.full((3, 1, 2), t, np.float32)})
    return buf


def unreadable(kind: str, like: torch.Tensor):
    if kind == "meta":
        return torch.empty(like.shape, dtype=like.dtype, device="meta")
    return like.to_sparse()


@pytest.mark.parametrize("kind", ["meta", "sparse"])
def test_history_append_failing_in_the_second_key_writes_nothing(kind, backend, device):
    buf = full_history(device)
    before, got = snapshot(buf), buf.get(3)
    bad = {"pixels": np.full((3, 1, 2), 9, np.uint8), "action": unreadable(kind, torch.ones(3, 1, 2))}
    with pytest.raises(TypeError, match="action: expected a dense tensor"):
        buf.append(bad)
    assert_unchanged(buf, before)
    assert all(torch.equal(buf.get(3)[k], v) for k, v in got.items())


@pytest.mark.parametrize("kind", ["meta", "sparse"])
@pytest.mark.parametrize("prioritized", [False, True])
def test_replay_insert_failing_in_a_later_leaf_writes_nothing(kind, prioritized, backend, device):
    cls = PrioritizedTransitionBuffer if prioritized else TransitionBuffer
    buf = cls(30, 4, make_transition(0, 1, 3), n_steps=2, device=device, seed=0)
    buf.insert(make_transition(0, 10, 3)).insert(make_transition(10, 4, 3))  # full and wrapped
    buf.sample()  # the tree is built and kept up to date from here on
    before, tree = snapshot(buf), buf._trees[0].tree.clone()
    bad = make_transition(14, 3, 3)
    bad.info = {"step": unreadable(kind, bad.info["step"])}  # the last leaf
    with pytest.raises(TypeError, match=r"info\['step'\]: expected a dense tensor"):
        buf.insert(bad)
    assert_unchanged(buf, before)
    assert torch.equal(tree, buf._trees[0].tree)


@pytest.mark.parametrize("indices, td, exc, match", [
    ([0, 1], [1.0, float("nan")], ValueError, "td_errors: .* finite"),
    ([0, 90], [1.0, 2.0], IndexError, r"indices: expected flat start indices in \[0, 30\)"),
    (np.array([0, 2**63], np.uint64), [1.0, 2.0], IndexError, "indices: expected flat start indices"),
    ([0, 1], [1.0], ValueError, "td_errors: expected a real 1-D array of 2 values"),
    ([0.0, 1.0], [1.0, 2.0], TypeError, "indices: expected a 1-D integer array"),
    ([0, 1], [1e30, 2.0], ValueError, "td_errors, alpha: priority .* overflows float64"),
])
def test_rejected_priority_update_writes_nothing(indices, td, exc, match, backend, device):
    buf = PrioritizedTransitionBuffer(30, 4, make_transition(0, 1, 3), n_steps=2, device=device, seed=0, alpha=12.0)
    buf.insert(make_transition(0, 6, 3))
    buf.sample()
    before, tree = snapshot(buf), buf._trees[0].tree.clone()
    with pytest.raises(exc, match=match):
        buf.update_priorities(indices, td)
    assert_unchanged(buf, before)
    assert torch.equal(tree, buf._trees[0].tree)


def test_priority_update_accepts_unsigned_and_empty_indices(backend, device):
    buf = PrioritizedTransitionBuffer(30, 4, make_transition(0, 1, 3), n_steps=2, device=device, seed=0)
    buf.insert(make_transition(0, 6, 3))
    before = snapshot(buf)
    assert buf.update_priorities([], []) is buf
    assert buf.update_priorities(np.array([], np.int64), torch.zeros(0)) is buf
    assert_unchanged(buf, before)
    for dtype in (np.uint8, np.uint32, np.uint64, np.int16):
        buf.update_priorities(np.array([4, 2], dtype), [2.0, 3.0])
    assert buf._priority[[2, 4]].tolist() == pytest.approx([3.0 + 1e-6, 2.0 + 1e-6])


def test_reset_with_bad_ids_writes_nothing(device):
    buf = full_history(device)
    before = snapshot(buf)
    for ids, exc in (([0, 7], IndexError), ([0.5], TypeError), ([[0]], TypeError)):
        with pytest.raises(exc, match="env_ids"):
            buf.reset(ids)
        assert_unchanged(buf, before)


def test_get_with_an_impossible_n_names_n(device):
    buf = full_history(device)
    with pytest.raises(MemoryError, match=r"n: get\(n=1125899906842624\) needs \d+ bytes of output on cpu"):
        buf.get(2**50)
