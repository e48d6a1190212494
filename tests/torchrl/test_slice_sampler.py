"""gpubuf.torchrl.SliceSampler inside torchrl's replay buffers: the same call sequences as torchrl's own
``SliceSampler`` give the same rows and the same ``info`` entries, seed for seed; its draws follow the exact
probabilities (an episode uniformly, then a start uniformly where the slice fits)."""

import numpy as np
import pytest
import torch
from extras import needs

torchrl = needs("torchrl.data")
from scipy import stats  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from torchrl.data import LazyMemmapStorage, LazyTensorStorage, ReplayBuffer, TensorDictReplayBuffer  # noqa: E402
from torchrl.data.replay_buffers.samplers import SliceSampler as TorchRLSliceSampler  # noqa: E402
from torchrl.data.replay_buffers.utils import _derive_end_flags, _end_to_start_stop  # noqa: E402

from gpubuf.torchrl import SliceSampler  # noqa: E402
from gpubuf.torchrl.slices import boundaries  # noqa: E402


def episodes(first_row: int, first_id: int, n: int, g: torch.Generator, longest: int = 12, init: bool = False):
    """``n`` rows of consecutive episodes of random lengths (1..longest): obs = row number, episode id, done flags
    at each episode's last row, terminated on some of them, and is_init at each episode's first row."""
    lengths, total = [], 0
    while total < n:
        lengths.append(int(torch.randint(1, longest + 1, (1,), generator=g)))
        total += lengths[-1]
    ids = torch.repeat_interleave(torch.arange(first_id, first_id + len(lengths)), torch.tensor(lengths))[:n]
    last = torch.cat([ids[1:] != ids[:-1], torch.tensor([True])])
    td = TensorDict({"obs": torch.arange(first_row, first_row + n, dtype=torch.float32), "episode": ids,
                     ("next", "done"): last.unsqueeze(1),
                     ("next", "terminated"): (last & (ids % 2 == 0)).unsqueeze(1)}, batch_size=[n])
    if init:
        td["is_init"] = torch.cat([torch.tensor([True]), ids[1:] != ids[:-1]]).unsqueeze(1)
    return td, int(ids[-1]) + 1


def extended_steps(rbs, g: torch.Generator, steps: int = 14, init: bool = False):
    """Yields each step's number after extending every buffer with the same random episodes (the ring wraps
    several times, cutting episodes at the cursor)."""
    row, next_id = 0, 0
    for step in range(steps):
        n = int(torch.randint(1, 30, (1,), generator=g))
        td, next_id = episodes(row, next_id, n, g, init=init)
        row += n
        for rb in rbs:
            rb.extend(td)
        yield step


CONFIGS = {
    "traj_key": dict(slice_len=4, traj_key="episode"),
    "end_key": dict(slice_len=4, end_key=("next", "done")),
    "auto": dict(slice_len=3),
    "num_slices": dict(num_slices=2),
    "not_strict": dict(slice_len=5, traj_key="episode", strict_length=False),
    "cached": dict(slice_len=4, traj_key="episode", cache_values=True),
    "no_truncated_key": dict(slice_len=4, traj_key="episode", truncated_key=None),
    "init_key": dict(slice_len=4, traj_key="episode"),
    "span": dict(slice_len=4, traj_key="episode", span=True),
}


def assert_same_sample(a, b):
    assert sorted(map(str, a.keys(True, True))) == sorted(map(str, b.keys(True, True)))
    for key in a.keys(True, True):
        assert a[key].shape == b[key].shape, key
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("storage", [LazyTensorStorage, LazyMemmapStorage])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_call_sequence_of_a_slice_buffer_matches_torchrls_sampler(name, storage, tmp_path):
    rbs = [TensorDictReplayBuffer(storage=storage(57) if storage is LazyTensorStorage else
                                  storage(57, scratch_dir=tmp_path / cls.__module__), sampler=cls(**CONFIGS[name]),
                                  batch_size=12)
           for cls in (SliceSampler, TorchRLSliceSampler)]
    for step in extended_steps(rbs, torch.Generator().manual_seed(len(name)), init=name == "init_key"):
        out = []
        for rb in rbs:
            torch.manual_seed(step)
            try:
                out.append(rb.sample())
            except (RuntimeError, IndexError) as e:  # e.g. no episode long enough yet: the same error from both
                out.append(f"{type(e).__name__}: {e}")
        if isinstance(out[0], str) or isinstance(out[1], str):
            assert out[0] == out[1]
            continue
        assert_same_sample(*out)
        seeded = [rb.sampler for rb in rbs]
        for s in seeded:
            s._rng = torch.Generator().manual_seed(100 + step)  # noqa: SLF001 (what rb.set_rng does)
        assert_same_sample(*(rb.sample() for rb in rbs))
        for s in seeded:
            s._rng = None  # noqa: SLF001


def test_a_plain_replay_buffer_returns_the_same_index_tuple_and_info():
    out = []
    for cls in (SliceSampler, TorchRLSliceSampler):
        rb = ReplayBuffer(storage=LazyTensorStorage(40), sampler=cls(slice_len=4, traj_key="episode"), batch_size=8)
        rb.extend(episodes(0, 0, 40, torch.Generator().manual_seed(1))[0])
        torch.manual_seed(4)
        out.append(rb.sample(return_info=True))
    (a, ia), (b, ib) = out
    assert_same_sample(a, b)
    assert isinstance(ia["index"], tuple) and len(ia["index"]) == 1
    assert torch.equal(ia["index"][0], ib["index"][0])
    for key in ib:
        if key != "index":
            assert torch.equal(ia[key], ib[key]), key


@pytest.mark.parametrize("ids", [True, False])
@pytest.mark.parametrize("full", [False, True])
def test_boundaries_are_torchrls_on_random_signals(ids, full):
    g = torch.Generator().manual_seed(int(ids) * 2 + int(full))
    for T in (1, 2, 3, 17, 64):
        for _ in range(20):
            signal = (torch.randint(0, 3, (T,), generator=g).cumsum(0) if ids
                      else torch.rand(T, generator=g) < 0.2 * int(torch.randint(0, 2, (1,), generator=g)))
            cursor = int(torch.randint(0, T, (1,), generator=g)) if full else None
            kw = {"trajectory": signal} if ids else {"end": signal}
            end, length = _derive_end_flags(at_capacity=full, cursor=cursor, **kw)
            want = _end_to_start_stop(end=end, length=length)
            got = boundaries(signal.numpy(), ids, full, cursor)
            for w, x in zip((want[0][:, 0], want[1][:, 0], want[2]), got, strict=True):
                assert torch.equal(w, torch.from_numpy(x))


def test_draws_follow_the_exact_probabilities():
    """Each (episode, start) pair with probability 1 / K / (L - slice + 1); episodes shorter than the slice never."""
    lengths = [3, 9, 2, 6, 14, 5]
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(len(ids)), sampler=SliceSampler(slice_len=5,
                                traj_key="episode"), batch_size=5 * 64)
    rb.extend(TensorDict({"episode": ids, "obs": torch.arange(len(ids))}, batch_size=[len(ids)]))
    starts = np.cumsum([0] + lengths[:-1])
    cells = {(e, starts[e] + r): 1 / 4 / (L - 4) for e, L in enumerate(lengths) if L >= 5 for r in range(L - 4)}
    counts = dict.fromkeys(cells, 0)
    torch.manual_seed(0)
    for _ in range(60):
        obs = rb.sample()["obs"].view(-1, 5)
        assert torch.equal(obs - obs[:, :1], torch.arange(5).expand_as(obs))  # consecutive rows of one episode
        for first in obs[:, 0].tolist():
            counts[(int(ids[first]), first)] += 1
    total = sum(counts.values())
    assert stats.chisquare(list(counts.values()), [p * total for p in cells.values()]).pvalue > 1e-4


def test_errors_are_torchrls():
    for cls in (SliceSampler, TorchRLSliceSampler):
        rb = TensorDictReplayBuffer(storage=LazyTensorStorage(30), sampler=cls(slice_len=8, traj_key="episode"),
                                    batch_size=16)
        with pytest.raises(RuntimeError, match="non-initialized storage"):
            rb.sample()
        rb.extend(TensorDict({"episode": torch.arange(30) // 5}, batch_size=[30]))
        with pytest.raises(RuntimeError, match=r"sufficient length \(length range: 5 - 5 / required=8\)\)\."):
            rb.sample()
        with pytest.raises(RuntimeError, match="batch-size must be divisible by the slice length"):
            rb.sample(12)
        rb.empty()
        with pytest.raises(RuntimeError, match="empty"):
            rb.sample()
