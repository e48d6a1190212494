"""The CUDA-only paths, simulated on the host: backend choice with CUDA present, every kernel launch under its
tensors' device, and bounded staging (pinned and device memory per key, in pieces past the cap)."""

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from fixtures import make_transition

from gpubuf import ops
from gpubuf._core.staging import Staging
from gpubuf.kernels import history, prefix_tree, sequence  # imported while the interpreter is set (conftest)
from gpubuf.ops import backend_table
from gpubuf.ops.prefix_tree import sample_twin
from gpubuf.replay.sampling.tree import PrefixSumTree

# ---- backend choice


@pytest.fixture
def cuda_present(monkeypatch):
    """CUDA reported present and Triton's interpreter off, as on a GPU machine."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.mark.parametrize("forced", ["", "torch", "triton"])
def test_host_memory_never_picks_triton_without_the_interpreter(cuda_present, monkeypatch, forced):
    monkeypatch.setenv("GPUBUF_BACKEND", forced)
    assert ops.backend_for(torch.device("cpu")) == "torch"  # host-RAM storage, host sampling
    assert ops.backend_for(torch.device("cuda", 1)) == (forced or "triton")
    assert not ops.triton_runs_on(torch.device("cpu")) and ops.triton_runs_on(torch.device("cuda", 0))


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("0", False), ("", False)])
def test_the_interpreter_lets_triton_take_host_tensors(monkeypatch, value, on):
    monkeypatch.setenv("TRITON_INTERPRET", value)
    monkeypatch.setenv("GPUBUF_BACKEND", "triton")
    assert ops.interpreting() is on
    assert ops.backend_for(torch.device("cpu")) == ("triton" if on else "torch")


def test_a_triton_request_on_host_tensors_runs_the_twin_without_the_interpreter(cuda_present, monkeypatch):
    def refused(name):
        def launcher(*args):
            raise AssertionError(f"a host tensor reached the Triton kernels of {name}")

        return launcher

    for module, names in ((history, ("append", "gather_frames", "pack_blocks")),
                          (prefix_tree, ("sample", "update", "update_range")), (sequence, ("gather",))):
        for name in names:
            monkeypatch.setattr(module, name, refused(f"{module.__name__}.{name}"))
    t = PrefixSumTree(37, backend_table(torch.device("cpu"), "triton"), fanout=4)
    t.update_range(0, torch.arange(1, 38, dtype=torch.float64))
    t.update(torch.tensor([3, 5]), torch.tensor([0.5, 0.25], dtype=torch.float64))
    want = torch.empty(9, dtype=torch.int64)
    u = torch.rand(9, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    sample_twin(t.tree, t.offsets, 4, u, want)
    assert torch.equal(t.sample(u), want)
    monkeypatch.setenv("GPUBUF_BACKEND", "triton")  # a whole buffer built with triton forced, on the host
    from gpubuf import PrioritizedTransitionBuffer

    buf = PrioritizedTransitionBuffer(60, 8, make_transition(0, 1, 3), n_steps=2, device="cpu", seed=0)
    assert buf.backend == "torch"
    buf.insert(make_transition(0, 12, 3))
    batch, idx = buf.sample(with_next_obs=True)
    buf.update_priorities(idx, torch.rand(8))
    assert batch.observation.shape[0] == 8


# ---- launches under their tensors' device


def test_on_device_makes_the_tensors_cuda_device_current(monkeypatch):
    import gpubuf.kernels as pkg

    entered = []
    monkeypatch.setattr(torch.cuda, "device", lambda d: entered.append(d) or contextlib.nullcontext())
    with pkg.on_device(SimpleNamespace(device=torch.device("cuda", 1))):
        pass
    with pkg.on_device(torch.zeros(1)):
        pass
    assert entered == [torch.device("cuda", 1)]  # host tensors enter nothing


@pytest.fixture
def guarded(monkeypatch):
    """Records, for every kernel launch, the devices whose guard is entered around it."""
    import gpubuf.kernels as pkg

    stack, launches = [], []

    @contextlib.contextmanager
    def recorder(t):
        stack.append(t.device)
        try:
            yield
        finally:
            stack.pop()

    monkeypatch.setattr(pkg, "on_device", recorder)
    kernels = {"append": history._append_kernel, "gather_frames": history._gather_frames_kernel,
               "pack_blocks": history._pack_blocks_kernel, "gather": sequence._gather_kernel,
               "sample": prefix_tree._sample_kernel, "update": prefix_tree._update_kernel}
    hooks = {}
    for name, fn in kernels.items():
        if not hasattr(fn, "add_pre_run_hook"):
            pytest.skip("this Triton has no pre-run hooks")
        hooks[name] = lambda *a, _name=name, **k: launches.append((_name, list(stack)))
        fn.add_pre_run_hook(hooks[name])
    yield launches
    for name, fn in kernels.items():
        fn.pre_run_hooks.remove(hooks[name])


def test_every_launcher_launches_under_its_tensors_device(guarded, monkeypatch):
    cpu = torch.device("cpu")
    storage = torch.arange(6 * 5, dtype=torch.int64).view(6, 5)
    meta = torch.tensor([[0, 1], [2, 1], [0, 0]])
    history.append([storage.clone()], [torch.zeros(2, 5, dtype=torch.int64)], torch.tensor([1, 4]))
    history.gather_frames([storage], [torch.zeros(2, 2, 5, dtype=torch.int64)], meta, 2, 1, 3)
    history.pack_blocks(storage.float(), torch.zeros(2, 1, 5), meta, 2, 1, 3)
    t = PrefixSumTree(300, backend_table(cpu, "torch"), fanout=4)
    prefix_tree.update_range(t.tree, t.offsets, 4, 0, torch.ones(300, dtype=torch.float64))
    prefix_tree.update(t.tree, t.offsets, 4, torch.tensor([3, 30]), torch.ones(2, dtype=torch.float64))
    monkeypatch.setattr(prefix_tree, "MANY_PROGRAMS_FROM", 1)  # one launch per level
    prefix_tree.update(t.tree, t.offsets, 4, torch.tensor([3, 30]), torch.ones(2, dtype=torch.float64))
    prefix_tree.sample(t.tree, t.offsets, 4, torch.rand(5, dtype=torch.float64), torch.zeros(5, dtype=torch.int64))
    starts = torch.tensor([0, 3, 4])
    out = torch.zeros(3, 2, 5, dtype=torch.int64)
    sequence.gather([(storage, out, 0)], starts, 2, 2, 3)
    sequence.gather_from_tables(sequence.tables([(storage, out, 1)], 3, 2, cpu), starts, 2, 2, 3)
    names = [name for name, _ in guarded]
    assert names == ["append", "gather_frames", "pack_blocks", "update", "update"] + ["update"] * (len(t.offsets) - 1) \
        + ["sample", "gather", "gather"]
    assert all(devices and set(devices) == {cpu} for _, devices in guarded), guarded  # nested guards: one device


# ---- bounded staging


class FakeEvent:
    """A CUDA event stand-in: recorded copies are pending until synchronized."""

    def __init__(self):
        self.pending = False

    def synchronize(self):
        self.pending = False


class FakeCudaStaging(Staging):
    """Staging towards a simulated ``cuda:1``: host tensors stand in for pinned and device buffers."""

    def __init__(self, **kw):
        super().__init__(torch.device("cuda", 1), **kw)
        self.guards = 0
        self.in_guard = False
        self.records = 0

    @contextlib.contextmanager
    def _guard(self):
        self.guards += 1
        self.in_guard = True
        try:
            yield
        finally:
            self.in_guard = False

    def _pinned(self, nbytes):
        return torch.empty(nbytes, dtype=torch.uint8)

    def _device_buffer(self, nbytes):
        assert self.in_guard, "a device allocation outside the device guard"
        return torch.empty(nbytes, dtype=torch.uint8)

    def _event(self):
        return FakeEvent()

    def _record(self, event):
        assert self.in_guard, "an event recorded outside the device guard"
        assert not event.pending, "a pinned slot was rewritten before its copy finished"
        event.pending = True
        self.records += 1


def test_staging_holds_at_most_its_cap_per_slot_and_sends_larger_inputs_in_pieces():
    cap, slots = 256, 3
    st = FakeCudaStaging(slots=slots, slot_bytes=cap)
    g = torch.Generator().manual_seed(0)
    inputs = [torch.zeros(0), torch.tensor(True), torch.arange(7, dtype=torch.int16),
              torch.rand(32, dtype=torch.float64, generator=g),  # exactly the cap
              torch.rand(33, dtype=torch.float64, generator=g),  # one byte-word past it: 2 pieces
              torch.randint(0, 255, (10 * cap + 3,), dtype=torch.uint8, generator=g),  # 11 pieces
              torch.rand(40, 9, dtype=torch.float32, generator=g).t(),  # strided, 5.6 pieces
              torch.rand(50, generator=g) > 0.5]
    for rep in range(3):
        for i, t in enumerate(inputs):
            out = st.to_device(t, f"k{i % 2}")
            assert out.dtype == t.dtype and out.shape == t.shape and torch.equal(out, t), (rep, i)
            pinned, device = st.held_bytes()
            assert pinned <= 3 * slots * cap and device <= 2 * slots * cap  # keys k0, k1 and the pieces ring
    assert st.guards == 3 * len(inputs)
    sizes = [t.numel() * t.element_size() for t in inputs]
    copies = sum(1 if n <= cap else -(-n // cap) for n in sizes)  # one per small input, one per piece
    assert sum(n > cap for n in sizes) == 3 and st.records == 3 * copies
    ring_sizes = [s[0].numel() for _, ring in st._ring.values() for s in ring if s is not None]
    assert max(ring_sizes) == cap


def test_a_small_input_stays_valid_for_the_next_slots_minus_one_calls():
    st = FakeCudaStaging(slots=4, slot_bytes=1024)
    outs = [st.to_device(torch.full((5,), i), "k") for i in range(4)]
    assert [int(o[0]) for o in outs] == [0, 1, 2, 3]
    big = torch.arange(1000, dtype=torch.int64)  # 8000 bytes: its own device tensor, always valid
    out = st.to_device(big, "k")
    for i in range(9):
        st.to_device(torch.arange(1000, dtype=torch.int64) + i, "k")
    assert torch.equal(out, big)


def test_the_default_cap_bounds_a_big_input():
    st = FakeCudaStaging()
    x = np.random.default_rng(0).integers(0, 255, 3 * st.slot_bytes + 5, dtype=np.uint8)
    out = st.to_device(torch.from_numpy(x), "pixels")
    assert np.array_equal(out.numpy(), x)
    assert st.held_bytes() == (st.slots * st.slot_bytes, 0)  # the pieces' pinned ring; no device slot
