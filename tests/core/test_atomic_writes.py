"""A call that raises leaves the buffer exactly as it was, whatever the cause: inputs that pass every shape
check but fail while being converted or copied (meta and sparse tensors, in the second key or leaf, on a
full buffer), and rejected priority updates. Both backends."""

import numpy as np
import pytest
import torch
from fixtures import make_transition
from snapshots import assert_unchanged, snapshot

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
    before, mass = snapshot(buf), buf.sampling_mass()
    bad = make_transition(14, 3, 3)
    bad.info = {"step": unreadable(kind, bad.info["step"])}  # the last leaf
    with pytest.raises(TypeError, match=r"info\['step'\]: expected a dense tensor"):
        buf.insert(bad)
    assert_unchanged(buf, before)
    assert torch.equal(mass, buf.sampling_mass())


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
    before, mass = snapshot(buf), buf.sampling_mass()
    with pytest.raises(exc, match=match):
        buf.update_priorities(indices, td)
    assert_unchanged(buf, before)
    assert torch.equal(mass, buf.sampling_mass())


def test_priority_update_accepts_unsigned_and_empty_indices(backend, device):
    buf = PrioritizedTransitionBuffer(30, 4, make_transition(0, 1, 3), n_steps=2, device=device, seed=0)
    buf.insert(make_transition(0, 6, 3))
    before = snapshot(buf)
    assert buf.update_priorities([], []) is buf
    assert buf.update_priorities(np.array([], np.int64), torch.zeros(0)) is buf
    assert_unchanged(buf, before)
    for dtype in (np.uint8, np.uint32, np.uint64, np.int16):
        buf.update_priorities(np.array([4, 2], dtype), [2.0, 3.0])
    assert buf.state_dict()["priority"][[2, 4]].tolist() == pytest.approx([3.0 + 1e-6, 2.0 + 1e-6])


def test_reset_with_bad_ids_writes_nothing(device):
    buf = full_history(device)
    before = snapshot(buf)
    for ids, exc in (([0, 7], IndexError), ([0.5], TypeError), ([[0]], TypeError)):
        with pytest.raises(exc, match="env_ids"):
            buf.reset(ids)
        assert_unchanged(buf, before)


def test_get_with_an_impossible_n_names_n(device):
    buf = full_history(device)
    with pytest.raises(MemoryError, match=r"n: get\(n=2147483647\) needs \d+ bytes of output on"):
        buf.get(2**31 - 1)  # about 100 GB of output
    for n in (2**31, 2**50, 2**64):
        with pytest.raises(ValueError, match=rf"n: expected fewer than 2\*\*31 frames per row, got {n}"):
            buf.get(n)


def lazy_views(t: torch.Tensor) -> list[torch.Tensor]:
    """Inputs whose values are fine but whose memory is not what it seems: conjugate and negative views,
    a contiguous slice at an odd byte offset, a size-1 axis with stride 0, a tensor that requires grad."""
    odd = torch.zeros(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape).copy_(t)
    out = [odd, t.expand(t.shape).as_strided(t.shape, t.stride()), t.clone().requires_grad_(t.is_floating_point())]
    if t.is_complex():
        out += [t.conj(), torch._neg_view(t)]
    return out


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.complex64, torch.bfloat16, torch.float8_e4m3fn])
def test_history_append_stores_any_memory_layout_by_value(dtype, backend, device):
    """Views that share memory oddly are copied by value in phase 1; a new key is fixed only on success."""
    buf = HistoryBuffer(3, 4, device=device)
    base = torch.arange(3 * 5, dtype=torch.float32).view(3, 1, 5).to(dtype)
    for x in lazy_views(base):
        buf.append({"x": x})
        assert torch.equal(buf.get(1)["x"].view(torch.uint8), x.detach().resolve_conj().resolve_neg()
                           .reshape(3, 1, 5).to(device).view(torch.uint8))
        assert not buf.state_dict()["data"]["x"].requires_grad


def test_inputs_that_are_the_buffers_own_storage_are_copied_first(backend, device):
    """Writing the buffer's own state back into it (which overlaps the rows being written) is by value."""
    buf = HistoryBuffer(2, 2, device=device)
    buf.append({"x": torch.tensor([[1], [2]], dtype=torch.int32)})
    buf.append({"x": torch.tensor([[3], [4]], dtype=torch.int32)})
    storage = buf.state_dict()["data"]["x"]  # rows: slot 0 (envs 0, 1), slot 1 (envs 0, 1)
    buf.append({"x": storage[:2]})  # overwrites slot 0 with slot 0's own values
    buf.append({"x": storage[2:].flip(0)})  # slot 1 <- slot 1 reversed, read before being written
    assert buf.get(2)["x"].tolist() == [[1, 4], [2, 3]]

    rb = TransitionBuffer(16, 2, make_transition(0, 1, 2), device=device, seed=0)  # 8 rows of 2 envs
    rb.insert(make_transition(0, 4, 2))
    own = rb.state_dict()["data"]["observation"]
    again = make_transition(4, 3, 2)
    again.observation = own[3:6]  # rows 3..5 written to rows 4..6: the source overlaps the rows written
    want = own[3:6].clone()
    rb.insert(again)
    assert torch.equal(rb.state_dict()["data"]["observation"][4:7].cpu(), want.cpu())


@pytest.mark.parametrize("prioritized", [False, True])
def test_replay_insert_does_not_join_the_autograd_graph(prioritized, backend, device):
    cls = PrioritizedTransitionBuffer if prioritized else TransitionBuffer
    buf = cls(30, 4, make_transition(0, 1, 3), device=device, seed=0)
    tr = make_transition(0, 5, 3)
    tr.reward = torch.as_tensor(tr.reward, device=device).float().requires_grad_()
    buf.insert(tr)
    assert not any(t.requires_grad for t in buf.state_dict()["data"].values())
    batch = buf.sample()
    assert not (batch[0] if prioritized else batch).reward.requires_grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e5m2, torch.complex32])
def test_replay_on_cpu_stores_dtypes_numpy_lacks(dtype, backend):
    sample = make_transition(0, 1, 3)
    sample.reward = torch.zeros(1, 3).to(dtype)
    buf = TransitionBuffer(30, 4, sample, device="cpu", seed=0)
    tr = make_transition(0, 4, 3)
    tr.reward = torch.arange(12.0).view(4, 3).to(dtype)
    buf.insert(tr)
    assert torch.equal(buf.state_dict()["data"]["reward"][:4].view(torch.uint8), tr.reward.view(torch.uint8))


def test_block_keys_reject_dtypes_they_cannot_clean(device):
    for dtype in (torch.complex64, torch.float8_e4m3fn, torch.uint16):
        buf = HistoryBuffer(2, 3, 1, ("action",), device=device)
        with pytest.raises(TypeError, match=rf"info_dict\['action'\]: a block key holds .* got {dtype}"):
            buf.append({"action": torch.zeros(2, 1, 2).to(dtype), "obs": torch.zeros(2, 1)})
        assert buf.keys == () and buf.get(1) is None  # nothing was fixed by the failed first append


def test_numpy_views_of_the_storage_are_read_before_the_write(backend):
    """An input reaching the buffer's memory through numpy (not a torch view) is copied first too."""
    rb = TransitionBuffer(8, 2, make_transition(0, 1, 2), device="cpu", seed=0)  # 4 rows of 2 envs
    rb.insert(make_transition(0, 3, 2))
    own = rb.state_dict()["data"]["observation"].numpy()
    for wrap in (lambda a: a, torch.from_numpy):
        tr = make_transition(10, 3, 2)
        tr.observation = wrap(own[1:4])  # rows 1..3, written at rows 3, 0, 1 (wrapping): read before written
        want = own[1:4].copy()
        pos = rb.state_dict()["pos"]
        rb.insert(tr)
        stored = rb.state_dict()["data"]["observation"].numpy()
        np.testing.assert_array_equal(stored[[(pos + i) % 4 for i in range(3)]], want)


def test_out_tensors_may_not_alias_the_storage_or_each_other(backend, device):
    buf = HistoryBuffer(2, 4, device=device)
    for t in range(3):
        buf.append({"x": torch.full((2, 1), float(t)), "y": torch.full((2, 1), float(t))})
    before = snapshot(buf)
    storage = buf.state_dict()["data"]["x"]
    with pytest.raises(ValueError, match=r"out\['x'\]: shares memory with the buffer's storage"):
        buf.get(2, out={"x": storage[:4].view(2, 2), "y": torch.empty(2, 2, device=device)})
    shared = torch.empty(2, 2, device=device)
    with pytest.raises(ValueError, match=r"out\['y'\]: shares memory with out\['x'\]"):
        buf.get(2, out={"x": shared, "y": shared})
    assert_unchanged(buf, before)
    rb = TransitionBuffer(30, 4, make_transition(0, 1, 3), device=device, seed=0)
    rb.insert(make_transition(0, 5, 3))
    out = rb.sample()
    out.reward = rb.state_dict()["data"]["reward"].view(-1)[:4]
    with pytest.raises(ValueError, match=r"out.reward: shares memory with the buffer's storage"):
        rb.sample(out=out)


@pytest.fixture
def python_sigint():
    """Python's own Ctrl-C handler for the test (a process started in the background by a shell inherits SIGINT
    ignored), the inherited one put back after."""
    import signal

    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, inherited)


def test_an_interrupt_inside_sampling_without_replacement_leaves_the_tree_whole(python_sigint):
    """Ctrl-C (or a timer) arriving between the rounds of a draw without replacement is delivered after the
    drawn starts are restored: a full draw afterwards still returns every valid start once."""
    import signal

    class Interrupt(Exception):
        pass

    def handler(*_):
        raise Interrupt

    buf = PrioritizedTransitionBuffer(64 * 4, 8, make_transition(0, 1, 4), seed=0, device="cpu")
    buf.insert(make_transition(0, 32, 4))
    n = buf.num_valid()
    old = signal.signal(signal.SIGALRM, handler)
    hits = 0
    try:
        for i in range(300):
            try:
                signal.setitimer(signal.ITIMER_REAL, 1e-5 * (1 + i % 50))
                for _ in range(20):
                    buf.sample(batch_size=n - 1)
            except Interrupt:
                hits += 1
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        signal.signal(signal.SIGALRM, old)
    assert hits > 0, "no interrupt landed: nothing was tested"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # every handler was put back
    _, idx = buf.sample(batch_size=n)
    assert sorted(idx.tolist()) == list(range(n))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu, torch.uint4])
def test_dtypes_that_cannot_keep_values_are_not_storage(dtype):
    with pytest.raises(TypeError, match=rf"x: buffers store bool, .* got {dtype}"):
        HistoryBuffer(2, 3, device="cpu").append({"x": torch.zeros(2, 1, dtype=torch.uint8).view(dtype)})
    sample = make_transition(0, 1, 3)
    sample.reward = torch.zeros(1, 3, dtype=torch.uint8).view(dtype)
    with pytest.raises(TypeError, match=rf"data_sample.reward: buffers store bool, .* got {dtype}"):
        TransitionBuffer(30, 4, sample, device="cpu")


def test_an_input_viewing_another_leafs_storage_is_read_before_the_write(backend):
    rb = TransitionBuffer(8, 2, make_transition(0, 1, 2), device="cpu", seed=0)
    rb.insert(make_transition(0, 2, 2))
    obs = rb.state_dict()["data"]["observation"].numpy()  # (4, 2, 2): rows 0..1 hold steps 0..1
    tr = make_transition(0, 2, 2)  # rewritten at rows 2..3, observation first
    tr.observation = np.full((2, 2, 2), 7.0, np.float32)
    tr.reward = obs[2:4, :, 0]  # reads the observation rows written in the same call
    want = obs[2:4, :, 0].copy()
    rb.insert(tr)
    np.testing.assert_array_equal(rb.state_dict()["data"]["reward"][2:4].numpy(), want)


def test_loading_a_state_whose_tensors_are_other_keys_storage_swaps_them(backend, device):
    buf = HistoryBuffer(2, 2, device=device)
    buf.append({"a": torch.ones(2, 1), "b": torch.full((2, 1), 2.0)})
    state = buf.state_dict()
    state["data"] = {"a": state["data"]["b"], "b": state["data"]["a"]}
    buf.load_state_dict(state)
    assert buf.get(1)["a"].flatten().tolist() == [2.0, 2.0] and buf.get(1)["b"].flatten().tolist() == [1.0, 1.0]
    rb = TransitionBuffer(8, 2, make_transition(0, 1, 2), device=device, seed=0)
    rb.insert(make_transition(0, 4, 2))
    state = rb.state_dict()
    state["data"] = {**state["data"], "action": state["data"]["reward"], "reward": state["data"]["action"]}
    want_action, want_reward = state["data"]["action"].clone(), state["data"]["reward"].clone()
    rb.load_state_dict(state)
    assert torch.equal(rb.state_dict()["data"]["action"], want_action)
    assert torch.equal(rb.state_dict()["data"]["reward"], want_reward)


def test_sample_out_may_not_alias_the_priorities(device):
    per = PrioritizedTransitionBuffer(32, 4, make_transition(0, 1, 2), device=device, seed=0)
    per.insert(make_transition(0, 6, 2))
    out, _ = per.sample()
    out.reward = per.state_dict()["priority"][:4]
    before = snapshot(per)
    with pytest.raises(ValueError, match="out.reward: shares memory with the buffer's storage"):
        per.sample(out=out)
    assert_unchanged(per, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.uint8, torch.int64])
def test_zero_width_leaves_sample_as_empty_columns(dtype, backend, device):
    sample = make_transition(0, 1, 2)
    sample.info = {"none": torch.zeros(1, 2, 0, dtype=dtype)}
    rb = TransitionBuffer(16, 2, sample, device=device, seed=0)
    tr = make_transition(0, 4, 2)
    tr.info = {"none": torch.zeros(4, 2, 0, dtype=dtype)}
    rb.insert(tr)
    assert rb.sample().info["none"].shape == (2, 0)


def test_every_held_signal_handler_runs_once_even_when_one_raises(python_sigint):
    """Ctrl-C and a user signal both arriving during a write: after it, KeyboardInterrupt is raised and the
    other handler has run too (as Python would have done without the hold)."""
    import signal

    from gpubuf._core.signals import signals_held

    ran = []
    old = signal.signal(signal.SIGUSR1, lambda s, f: ran.append(s))
    try:
        with pytest.raises(KeyboardInterrupt):
            with signals_held():
                signal.raise_signal(signal.SIGUSR1)  # delivered to this thread at once (os.kill may pick another)
                signal.raise_signal(signal.SIGINT)
                assert ran == []  # held while inside
        assert ran == [signal.SIGUSR1]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGUSR1, old)
