"""Storage tiers: host storage apart from the sampling device, and memory-mapped storage directories that
a fresh process re-opens (rows, counters, flushed priorities and RNG)."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from gpubuf import GraphSampler, PrioritizedTransitionBuffer, Transition, TransitionBuffer

E = 2


def rows(T, t0=0, trunc_at=()):
    """T rows; every float leaf holds value = step * E + env."""
    v = (np.arange(t0, t0 + T)[:, None] * E + np.arange(E)).astype(np.float32)
    trunc = np.isin(np.arange(t0, t0 + T), trunc_at)[:, None].repeat(E, 1)
    return Transition(observation=v[..., None].repeat(3, -1), action=v.astype(np.int64), reward=v.copy(),
                      terminated=np.zeros((T, E), bool), truncated=trunc)


def make(cls, path=None, **kw):
    return cls(E * 16, 4, rows(1), n_steps=3, device="cpu", seed=0, storage_dir=path, **kw)


def play(buf):
    """The same operations on any buffer; returns ``buf``."""
    buf.insert(rows(10, trunc_at=(6,)))
    if isinstance(buf, PrioritizedTransitionBuffer):
        buf.update_priorities(np.arange(8), np.linspace(0.5, 4, 8))
    buf.insert(rows(9, 10))  # wraps
    return buf


@pytest.mark.parametrize("cls", [TransitionBuffer, PrioritizedTransitionBuffer])
def test_a_storage_dir_buffer_behaves_like_one_in_memory(backend, cls, tmp_path):
    mapped, plain = play(make(cls, tmp_path / "buf")), play(make(cls))
    for name, t in plain.state_dict()["data"].items():
        assert torch.equal(mapped.state_dict()["data"][name], t)
    for boundaries in ("allow", "forbid"):
        assert torch.equal(mapped.sampling_mass(True, boundaries), plain.sampling_mass(True, boundaries))
    a, b = mapped.sample(key=3, with_next_obs=True), plain.sample(key=3, with_next_obs=True)
    a, b = (a[0], b[0]) if isinstance(a, tuple) else (a, b)
    assert torch.equal(a.observation, b.observation) and torch.equal(a.next_observation, b.next_observation)
    assert sorted(p.name for p in (tmp_path / "buf").iterdir()) == \
        ["counters.bin", "gpubuf.json"] + [f"leaf{i}.bin" for i in range(5)]


_CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    sys.path.insert(0, {tests!r})
    from test_storage_tiers import PrioritizedTransitionBuffer, make, play, rows
    buf = play(make(PrioritizedTransitionBuffer, {path!r}))
    buf.flush()
    buf.insert(rows(3, 19))  # after the flush: re-opened at max_priority
    buf.sample(key=1)
""")


def test_a_fresh_process_reopens_rows_counters_and_flushed_priorities(tmp_path):
    path = tmp_path / "buf"
    code = _CHILD.format(tests=str(__import__("pathlib").Path(__file__).parent), path=str(path))
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    reopened = make(PrioritizedTransitionBuffer, path)
    want = play(make(PrioritizedTransitionBuffer))
    rng = want.state_dict()["rng"].clone()  # the flushed RNG state
    want.insert(rows(3, 19))
    assert len(reopened) == len(want) and reopened.num_valid(True) == want.num_valid(True)
    assert reopened.max_priority == want.max_priority
    assert torch.equal(reopened.sampling_mass(), want.sampling_mass())
    assert torch.equal(reopened.state_dict()["trunc"], want.state_dict()["trunc"])
    want._gen.set_state(rng)
    assert torch.equal(reopened.sample()[1], want.sample()[1])


def test_reopening_without_a_flush_keeps_rows_and_gives_them_max_priority(tmp_path):
    buf = play(make(PrioritizedTransitionBuffer, tmp_path / "b"))
    del buf
    again = make(PrioritizedTransitionBuffer, tmp_path / "b")
    assert len(again) == E * 16 and again.max_priority == 1.0
    mass = again.sampling_mass()
    assert set(mass[mass > 0].tolist()) == {1.0}


def test_a_loaded_state_is_what_the_directory_reopens(tmp_path):
    source = play(make(TransitionBuffer))
    target = make(TransitionBuffer, tmp_path / "b")
    target.load_state_dict(source.state_dict())
    del target
    again = make(TransitionBuffer, tmp_path / "b")
    assert len(again) == len(source) and torch.equal(again.sample(key=2).reward, source.sample(key=2).reward)


def test_a_mismatched_or_broken_directory_is_named(tmp_path):
    make(TransitionBuffer, tmp_path / "b").insert(rows(4))
    with pytest.raises(ValueError, match="storage_dir: .* 'n_steps' is 3, not 2"):
        TransitionBuffer(E * 16, 4, rows(1), n_steps=2, device="cpu", storage_dir=tmp_path / "b")
    with pytest.raises(ValueError, match="storage_dir: .* 'buffer' is 'TransitionBuffer'"):
        make(PrioritizedTransitionBuffer, tmp_path / "b")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="storage_dir: .* is not a directory"):
        make(TransitionBuffer, tmp_path / "file")
    with pytest.raises(TypeError, match="storage_dir: expected a path"):
        make(TransitionBuffer, 3.5)
    counters = np.memmap(tmp_path / "b" / "counters.bin", dtype=np.int64, mode="r+")
    counters[:] = (5, 3, 3)  # a partly filled buffer writes at row == count
    counters.flush()
    with pytest.raises(ValueError, match="storage_dir: counters"):
        make(TransitionBuffer, tmp_path / "b")
    counters[:] = (4, 4, 4)
    counters.flush()
    with open(tmp_path / "b" / "leaf0.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(ValueError, match="storage_dir: .*leaf0.bin does not hold"):
        make(TransitionBuffer, tmp_path / "b")


def test_storage_device_is_checked():
    with pytest.raises(ValueError, match="storage_device: expected None, 'cpu'"):
        TransitionBuffer(E * 16, 4, rows(1), device="cpu", storage_device="meta")
    with pytest.raises(ValueError, match="storage_device: a storage_dir maps files"):
        TransitionBuffer(E * 16, 4, rows(1), device="cpu", storage_device="meta", storage_dir="/tmp/x")
    buf = TransitionBuffer(E * 16, 4, rows(1), device="cpu", storage_device="cpu")
    assert buf.storage_device == torch.device("cpu")
    assert make(TransitionBuffer).flush() is not None  # nothing to flush without a directory


@pytest.mark.cuda
def test_host_storage_serves_cuda_batches():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    buf = TransitionBuffer(E * 16, 4, rows(1), n_steps=3, device="cuda", storage_device="cpu", seed=0)
    buf.insert(rows(12))
    batch = buf.sample(batch_size=8)
    assert batch.observation.device.type == "cuda" and buf._data[("observation",)].device.type == "cpu"
    v = batch.observation[..., 0].cpu()
    assert (v[:, 1:] - v[:, :-1] == E).all()
    with pytest.raises(ValueError, match="buffer: a GraphSampler gathers on the sampling device"):
        GraphSampler(buf)
