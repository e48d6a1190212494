"""Storage tiers: host storage apart from the sampling device, and memory-mapped storage directories that
a fresh process re-opens (rows, counters, flushed priorities and RNG)."""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from fixtures import index_rows

from gpubuf import GraphSampler, PrioritizedTransitionBuffer, Transition, TransitionBuffer
from gpubuf._core import checkpoint

E = 2


def rows(T, t0=0, trunc_at=()):
    """T rows; every float leaf holds value = step * E + env."""
    tr = index_rows(T, E, t0, obs_dim=3, int_action=True)
    tr.truncated = np.isin(np.arange(t0, t0 + T), trunc_at)[:, None].repeat(E, 1)
    return tr


def make(cls, path=None, device="cpu", **kw):
    return cls(E * 16, 4, rows(1), n_steps=3, device=device, seed=0, storage_dir=path, **kw)


def play(buf):
    """The same operations on any buffer; returns ``buf``."""
    buf.insert(rows(10, trunc_at=(6,)))
    if isinstance(buf, PrioritizedTransitionBuffer):
        buf.update_priorities(np.arange(8), np.linspace(0.5, 4, 8))
    buf.insert(rows(9, 10))  # wraps
    return buf


@pytest.mark.parametrize("cls", [TransitionBuffer, PrioritizedTransitionBuffer])
def test_a_storage_dir_buffer_behaves_like_one_in_memory(backend, cls, tmp_path, device):
    # sampling on ``device`` (the GPU when present: the files are host memory, the in-memory twin is on the GPU)
    mapped, plain = play(make(cls, tmp_path / "buf", device)), play(make(cls, device=device))
    for name, t in plain.state_dict()["data"].items():
        assert torch.equal(mapped.state_dict()["data"][name].cpu(), t.cpu())
    for boundaries in ("allow", "forbid"):
        assert torch.equal(mapped.sampling_mass(True, boundaries), plain.sampling_mass(True, boundaries))
    a, b = mapped.sample(key=3, with_next_obs=True), plain.sample(key=3, with_next_obs=True)
    a, b = (a[0], b[0]) if isinstance(a, tuple) else (a, b)
    assert torch.equal(a.observation, b.observation) and torch.equal(a.next_observation, b.next_observation)
    assert sorted(p.name for p in (tmp_path / "buf").iterdir()) == \
        ["counters.bin", "gpubuf.json"] + [f"leaf{i}.bin" for i in range(5)] + ["lock"]


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
    want.generator.set_state(rng)
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
    slot = 2 + 4 * int(counters[0])  # the active slot: (position, rows held, rows ever written, flushes)
    for bad in ((16, 3, 3), (5, 17, 17), (5, 4, 3)):  # position past the ring, rows past it, total below rows
        counters[slot:slot + 3] = bad
        counters.flush()
        with pytest.raises(ValueError, match="storage_dir: counters"):
            make(TransitionBuffer, tmp_path / "b")
    counters[slot:slot + 3] = (4, 4, 4)
    counters.flush()
    with open(tmp_path / "b" / "leaf0.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(ValueError, match="storage_dir: .*leaf0.bin is missing or does not hold"):
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
    assert batch.observation.device.type == "cuda" and buf.storage.data[("observation",)].device.type == "cpu"
    v = batch.observation[..., 0].cpu()
    assert (v[:, 1:] - v[:, :-1] == E).all()
    with pytest.raises(ValueError, match="buffer: a GraphSampler gathers on the sampling device"):
        GraphSampler(buf)


# ---- env-major leaf files: (E, M, *shape) on disk, the same starts, windows and state as in memory

E3, M7, N3 = 3, 7, 3  # odd sizes: an env/step mix-up shows in the values


def indexed(T, t0=0):
    """T rows of E3 envs; every leaf holds value = global step * E3 + env (obs: 3 copies, action: int64)."""
    tr = index_rows(T, E3, t0, obs_dim=3, int_action=True)
    tr.terminated = tr.reward % 5 == 4  # a few episode ends, so boundaries="mask" has flags to mark
    return tr


def make3(cls, path=None, device="cpu"):
    return cls(E3 * M7, 4, indexed(1), n_steps=N3, device=device, seed=7, storage_dir=path)


def fill3(buf):
    """Global steps 0..18 into 7 rows per env: rows 5, 6, 0, ... hold steps 12..18 (windows wrap the ring)."""
    for t0 in (0, 5, 10, 15):
        buf.insert(indexed(min(5, 19 - t0), t0))
        if t0 == 5 and isinstance(buf, PrioritizedTransitionBuffer):
            buf.update_priorities(np.arange(E3 * M7), np.linspace(0.5, 4, E3 * M7))
    return buf


def check_windows(obs, idx=None):
    """obs (B, n, 3): each window is one env's consecutive steps, starting at flat index idx (B,)."""
    v = obs[..., 0].to(torch.int64)
    assert (v[:, 1:] - v[:, :-1] == E3).all() and (obs == obs[..., :1]).all()
    if idx is not None:
        assert torch.equal(idx, (v[:, 0] // E3 % M7) * E3 + v[:, 0] % E3)


@pytest.mark.parametrize("cls", [TransitionBuffer, PrioritizedTransitionBuffer])
def test_env_major_windows_match_memory_index_for_index(backend, cls, tmp_path, device):
    mapped, plain = fill3(make3(cls, tmp_path / "b", device)), fill3(make3(cls, device=device))
    for name, t in plain.state_dict()["data"].items():
        assert torch.equal(mapped.state_dict()["data"][name].cpu(), t.cpu()), name
    for kw in ({}, {"with_next_obs": True}, {"boundaries": "mask"}, {"with_replacement": False, "batch_size": 12}):
        kw = {"batch_size": 64, "with_replacement": True, **kw}
        a, b = mapped.sample(key=11, **kw), plain.sample(key=11, **kw)
        (a, ia), (b, ib) = (a, b) if isinstance(a, tuple) else ((a, None), (b, None))
        assert ia is None or torch.equal(ia, ib)
        for f in ("observation", "action", "reward", "terminated", "next_observation", "is_first", "mask",
                  "PER_weights"):
            x, y = getattr(a, f), getattr(b, f)
            assert (x is None and y is None) or torch.equal(x, y), (kw, f)
        check_windows(a.observation, ia)
        assert torch.equal(a.action, a.observation[..., 0].to(torch.int64))
        if kw.get("with_next_obs"):
            assert torch.equal(a.next_observation, a.observation + E3)
    wraps = mapped.sample(key=2, batch_size=64, with_replacement=True)
    obs = (wraps[0] if isinstance(wraps, tuple) else wraps).observation
    assert ((obs[:, 0, 0].to(torch.int64) // E3 % M7) > M7 - N3).any()  # some windows run past ring row M-1


def test_the_leaf_files_are_env_major(tmp_path):
    buf = fill3(make3(TransitionBuffer, tmp_path / "b"))
    meta = json.loads((tmp_path / "b" / "gpubuf.json").read_text())
    assert meta["config"]["layout"] == "env-major"
    leaf = meta["leaves"]["observation"]
    assert leaf["shape"] == [E3, M7, 3] and leaf["dtype"] == "torch.float32"
    raw = np.fromfile(tmp_path / "b" / leaf["file"], dtype=np.float32)
    assert raw.size == E3 * M7 * 3
    steps = np.array([14, 15, 16, 17, 18, 12, 13])  # global step held by ring rows 0..6
    for e in range(E3):  # env e's rows are one stretch of the file, in ring order
        assert np.array_equal(raw[e * M7 * 3:(e + 1) * M7 * 3].reshape(M7, 3)[:, 0], steps * E3 + e)
    assert np.array_equal(raw.reshape(E3, M7, 3), buf.state_dict()["data"]["observation"].numpy().swapaxes(0, 1))


def test_a_directory_of_another_layout_is_rejected(tmp_path):
    make3(TransitionBuffer, tmp_path / "b").insert(indexed(2))
    meta_file = tmp_path / "b" / "gpubuf.json"
    meta = json.loads(meta_file.read_text())
    meta["config"]["layout"] = "time-major"
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="storage_dir: .* config 'layout' is 'time-major', not 'env-major'"):
        make3(TransitionBuffer, tmp_path / "b")
    del meta["config"]["layout"]  # written before the layout was recorded: time-major
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="storage_dir: .* config 'layout' is None, not 'env-major'"):
        make3(TransitionBuffer, tmp_path / "b")


_REOPEN = textwrap.dedent("""
    import sys
    import torch
    sys.path.insert(0, {tests!r})
    from test_storage_tiers import TransitionBuffer, make3
    buf = make3(TransitionBuffer, {path!r})
    torch.save([buf.sample(key=5, batch_size=32, with_next_obs=True).__dict__, buf.sample(batch_size=8).reward,
                len(buf)], {out!r})
""")


def test_a_fresh_process_reopens_the_same_windows(tmp_path):
    path, out = tmp_path / "b", tmp_path / "out.pt"
    buf = fill3(make3(TransitionBuffer, path))
    buf.close()  # flushes and lets the fresh process open the directory; buf can still be sampled
    code = _REOPEN.format(tests=str(__import__("pathlib").Path(__file__).parent), path=str(path), out=str(out))
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    theirs, reward, n = torch.load(out, weights_only=True)
    ours = buf.sample(key=5, batch_size=32, with_next_obs=True)
    assert n == len(buf) == E3 * M7 and torch.equal(reward, buf.sample(batch_size=8).reward)  # flushed RNG
    for f in ("observation", "action", "reward", "terminated", "next_observation"):
        assert torch.equal(theirs[f], getattr(ours, f)), f
    check_windows(theirs["observation"])


def test_graph_sampling_and_checkpoints_of_env_major_storage(host_backend, tmp_path):
    # host buffers: a GraphSampler of a CUDA buffer gathers on the GPU, which a storage_dir's files are not
    mapped, plain = fill3(make3(TransitionBuffer, tmp_path / "b")), fill3(make3(TransitionBuffer))
    outs = []
    for buf in (mapped, plain):
        g = torch.Generator().manual_seed(3)
        outs.append(buf.graph_sampler(16, with_next_obs=True, generator=g).sample())
    (a, ia), (b, ib) = outs
    assert torch.equal(ia, ib) and torch.equal(a.observation, b.observation)
    assert torch.equal(a.next_observation, b.next_observation)
    check_windows(a.observation, ia)
    # a checkpoint does not depend on the layout; tiny chunks stream the strided storage row block by row block
    checkpoint.save(mapped, tmp_path / "m.ckpt", chunk=40)
    checkpoint.save(plain, tmp_path / "p.ckpt")
    assert (tmp_path / "m.ckpt").read_bytes() == (tmp_path / "p.ckpt").read_bytes()
    target = make3(TransitionBuffer, tmp_path / "t")
    checkpoint.load(target, tmp_path / "p.ckpt", chunk=40)
    for name, t in plain.state_dict()["data"].items():
        assert torch.equal(target.state_dict()["data"][name], t), name
    assert torch.equal(target.sample(key=4, batch_size=16).observation, plain.sample(key=4, batch_size=16).observation)


def test_mapped_leaves_are_advised_random_and_each_sampled_window_is_prefetched(tmp_path, monkeypatch):
    import mmap

    from gpubuf.replay.storage import tiers

    if tiers._MADVISE is None:
        pytest.skip("no madvise on this platform")
    calls = []
    monkeypatch.setattr(tiers, "_MADVISE", lambda addr, n, advice: calls.append((addr, n, advice)) or 0)
    D = 1024  # float32 words per observation row: a window of 3 rows spans 3 pages

    def wide(T, t0=0):
        v = (np.arange(t0, t0 + T)[:, None] * E3 + np.arange(E3)).astype(np.float32)
        return Transition(observation=np.repeat(v[..., None], D, -1), action=None, reward=v, terminated=None,
                          truncated=None)

    buf = TransitionBuffer(E3 * M7, 8, wide(1), n_steps=N3, device="cpu", seed=3, storage_dir=tmp_path / "b")
    obs_file = buf.storage.dir.tensors["observation"]
    start, size = obs_file.data_ptr(), obs_file.numel() * 4
    assert any(a <= start and start + size <= a + n and adv == mmap.MADV_RANDOM for a, n, adv in calls)
    for t0 in (0, 5, 10):  # 15 steps into 7 rows per env: windows wrap the ring
        buf.insert(wide(5, t0))
    calls.clear()
    batch = buf.sample(key=0, batch_size=64)
    advised = [(a, a + n) for a, n, adv in calls if adv == mmap.MADV_WILLNEED]
    assert advised and all(lo % mmap.PAGESIZE == 0 for lo, _ in advised)
    assert all(hi <= start + size for _, hi in advised)
    v = batch.observation[:, :, 0].to(torch.int64)  # (B, n) = global step * E3 + env
    ring_row = (v // E3) % M7 + (v % E3) * M7  # where each row lies in the env-major file
    wrapped = False
    for window in ring_row.tolist():
        wrapped |= window[-1] < window[0]
        for r in window:  # every byte of every row of the window was advised
            lo, hi = start + r * D * 4, start + (r + 1) * D * 4
            assert any(a <= lo and hi <= b for a, b in advised), (window, r)
    assert wrapped


def test_damaged_bookkeeping_is_named_not_read_as_an_empty_buffer(tmp_path):
    buf = make(PrioritizedTransitionBuffer, tmp_path / "b").insert(rows(4))
    buf.close()
    d = tmp_path / "b"
    (d / "counters.bin").rename(tmp_path / "counters.bin")  # without it the rows cannot be placed
    with pytest.raises(ValueError, match="storage_dir: .*counters.bin is missing or is not the row journal"):
        make(PrioritizedTransitionBuffer, d)
    (tmp_path / "counters.bin").rename(d / "counters.bin")
    state = torch.load(d / "state.pt", weights_only=True)
    for broken in (b"garbage", {k: v for k, v in state.items() if k != "priority"},
                   {**state, "rng": torch.zeros(3, dtype=torch.uint8)}):
        if isinstance(broken, bytes):
            (d / "state.pt").write_bytes(broken)
        else:
            torch.save(broken, d / "state.pt")
        with pytest.raises(ValueError, match="storage_dir: .*state.pt cannot be restored"):
            make(PrioritizedTransitionBuffer, d)
    torch.save(state, d / "state.pt")
    assert len(make(PrioritizedTransitionBuffer, d)) == len(buf)  # repaired: it re-opens
    meta = (d / "gpubuf.json").read_text()
    (d / "gpubuf.json").write_text("[1]")
    with pytest.raises(ValueError, match="storage_dir: .*gpubuf.json is not a gpubuf buffer description"):
        make(PrioritizedTransitionBuffer, d)
    (d / "gpubuf.json").write_text(meta)
    (d / "leaf1.bin").unlink()
    with pytest.raises(ValueError, match="storage_dir: .*leaf1.bin is missing"):
        make(PrioritizedTransitionBuffer, d)
    with pytest.raises(ValueError, match="storage_dir: expected a directory path, got ''"):
        make(TransitionBuffer, "")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="storage_dir: cannot create"):
        make(TransitionBuffer, tmp_path / "file" / "sub")


def test_zero_size_leaves_and_info_key_order_re_open(tmp_path):
    def data(T, order):
        info = {"a": np.full((T, E), 1.5, np.float32), "b": np.full((T, E), 7, np.int32), "none": np.zeros((T, E, 0))}
        return Transition(**{**vars(rows(T)), "info": {k: info[k] for k in order}})

    buf = TransitionBuffer(E * 8, 4, data(1, ["a", "b", "none"]), device="cpu", seed=0, storage_dir=tmp_path / "b")
    buf.insert(data(5, ["a", "b", "none"])).close()
    again = TransitionBuffer(E * 8, 4, data(1, ["none", "b", "a"]), device="cpu", seed=0,
                             storage_dir=tmp_path / "b")  # the same leaves, listed in another order
    assert len(again) == len(buf)
    batch = again.sample(key=1)
    assert batch.info["a"].unique().tolist() == [1.5] and batch.info["b"].unique().tolist() == [7]
    assert batch.info["none"].shape == (4, 0)
