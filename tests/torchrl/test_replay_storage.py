"""gpubuf.torchrl.ReplayStorage in torchrl's replay buffers: the same call sequences as on torchrl's
``LazyTensorStorage`` / ``LazyMemmapStorage`` give the same rows; a ``storage_dir`` re-opens with its rows in a fresh
process, survives SIGKILL mid-extend with whole rows only, and refuses what its journal could not keep."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from extras import needs

torchrl = needs("torchrl.data")
from tensordict import TensorDict  # noqa: E402
from torchrl.data import (  # noqa: E402
    LazyMemmapStorage,
    LazyTensorStorage,
    RandomSampler,
    ReplayBuffer,
    TensorDictReplayBuffer,
)

from gpubuf.torchrl import PrioritizedSampler, ReplayStorage, SliceSampler  # noqa: E402

CAP = 37


def rows(start: int, n: int) -> TensorDict:
    """Row r: obs = r (and r + 0.5), an episode id of 9-row episodes, a nested done flag."""
    r = torch.arange(start, start + n)
    return TensorDict({"obs": torch.stack([r, r], 1).float() + torch.tensor([0.0, 0.5]), "episode": r // 9,
                       ("next", "done"): (r % 9 == 8).unsqueeze(1)}, batch_size=[n])


SAMPLERS = {
    "random": lambda: RandomSampler(),
    "prioritized": lambda: PrioritizedSampler(CAP, alpha=0.7, beta=0.5),
    "slices": lambda: SliceSampler(slice_len=3, traj_key="episode"),
}


def pair(sampler: str, tier: str, tmp_path):
    """(gpubuf's buffer, torchrl's buffer) over the same sampler kind."""
    if tier == "dir":
        ours, theirs = ReplayStorage(CAP, storage_dir=tmp_path / "ours"), LazyMemmapStorage(
            CAP, scratch_dir=tmp_path / "theirs")
    else:
        ours, theirs = ReplayStorage(CAP), LazyTensorStorage(CAP)
    return [TensorDictReplayBuffer(storage=s, sampler=SAMPLERS[sampler](), batch_size=6) for s in (ours, theirs)]


def sample_both(rbs, seed):
    out = []
    for rb in rbs:
        np.random.seed(seed)
        torch.manual_seed(seed)
        out.append(rb.sample())
    return out


def assert_same(a, b):
    assert sorted(map(str, a.keys(True, True))) == sorted(map(str, b.keys(True, True)))
    for key in a.keys(True, True):
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("tier", ["memory", "dir"])
@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
def test_the_call_sequence_of_a_torchrl_buffer_matches_torchrls_storage(sampler, tier, tmp_path):
    rbs = pair(sampler, tier, tmp_path)
    start = 0
    for step in range(9):  # the ring wraps twice
        n = [5, 11, 1, 17][step % 4]
        for rb in rbs:
            rb.extend(rows(start, n)) if n > 1 else rb.add(rows(start, 1)[0])
        start += n
        assert len(rbs[0]) == len(rbs[1])
        assert_same(*sample_both(rbs, step))
        if sampler == "prioritized":
            for rb in rbs:
                rb.update_priority(torch.arange(4), torch.tensor([0.1, 2.0, 3.0, 0.5]))
    assert_same(rbs[0][:], rbs[1][:])
    assert [r["obs"][0].item() for r in rbs[0].storage] == [r["obs"][0].item() for r in rbs[1].storage]

    for rb in rbs:  # a transform on top
        rb.append_transform(lambda td: td.set("twice", td["obs"] * 2))
    assert_same(*sample_both(rbs, 100))

    again = pair(sampler, tier, tmp_path / "again")  # state_dict into new buffers
    for rb, other in zip(rbs, again, strict=True):
        other.load_state_dict(rb.state_dict())
    assert_same(*sample_both(again, 101))
    for rb in again:
        rb.extend(rows(start, 4))
    assert_same(*sample_both(again, 102))

    for i, rb in enumerate(rbs):  # dumps / loads through disk, into fresh buffers
        rb.dumps(tmp_path / f"dump{i}")
    loaded = pair(sampler, tier, tmp_path / "loaded")
    for i, rb in enumerate(loaded):
        rb.loads(tmp_path / f"dump{i}")
    assert_same(*sample_both(loaded, 103))

    for rb in rbs:
        rb.empty()
        assert len(rb) == 0
        rb.extend(rows(1000, 12))
    assert_same(*sample_both(rbs, 104))


def test_a_storage_dir_reopens_in_a_fresh_process_and_goes_on_after_its_newest_row(tmp_path):
    rb = TensorDictReplayBuffer(storage=ReplayStorage(CAP, storage_dir=tmp_path / "d"), batch_size=4)
    reference = TensorDictReplayBuffer(storage=LazyTensorStorage(CAP), batch_size=4)
    for n in (20, 30, 9):
        for b in (rb, reference):
            b.extend(rows(sum((20, 30, 9)[:(20, 30, 9).index(n)]), n))
    rb.storage.flush()
    rb.storage.close()
    script = textwrap.dedent(f"""
        import torch
        from tensordict import TensorDict
        from torchrl.data import TensorDictReplayBuffer
        from gpubuf.torchrl import ReplayStorage
        rb = TensorDictReplayBuffer(storage=ReplayStorage({CAP}, storage_dir={str(tmp_path / "d")!r}), batch_size=4)
        r = torch.arange(59, 64)
        rb.extend(TensorDict({{"obs": torch.stack([r, r], 1).float() + torch.tensor([0.0, 0.5]), "episode": r // 9,
                               ("next", "done"): (r % 9 == 8).unsqueeze(1)}}, batch_size=[5]))
        print(len(rb), rb.storage[:]["obs"][:, 0].tolist())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "RL_WARNINGS": "0"})
    assert out.returncode == 0, out.stderr
    reference.extend(rows(59, 5))
    length, stored = out.stdout.strip().splitlines()[-1].split(" ", 1)
    assert int(length) == len(reference)
    assert eval(stored) == reference.storage[:]["obs"][:, 0].tolist()


WRITER = textwrap.dedent("""
    import sys, torch
    from tensordict import TensorDict
    from torchrl.data import TensorDictReplayBuffer
    from gpubuf.torchrl import ReplayStorage
    rb = TensorDictReplayBuffer(storage=ReplayStorage(64, storage_dir=sys.argv[1]), batch_size=4)
    k = rb.storage._ring[2]
    print("ready", flush=True)
    while True:
        n = 1 + k % 23
        r = torch.arange(k, k + n)
        rb.extend(TensorDict({"obs": r.double().view(n, 1).expand(n, 65536).clone()}, batch_size=[n]))
        k += n
""")


def test_sigkill_mid_extend_leaves_whole_rows_only(tmp_path):
    """Rows of 65536 equal values (the row's number) written by extends of 1-23 rows; killed at random instants, the
    directory re-opens serving (torchrl's view: ``storage[:]``) whole rows only, the newest ones written, and goes on
    after the newest."""
    path = str(tmp_path / "d")
    rng = np.random.default_rng(0)
    for _ in range(8):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, path], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "RL_WARNINGS": "0"})
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.05, 0.4))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        storage = ReplayStorage(64, storage_dir=path)
        rb = TensorDictReplayBuffer(storage=storage, batch_size=4)
        head, held, total = storage._ring  # noqa: SLF001
        assert held == min(total, 64) == len(rb) and total > 0
        served = rb[:]["obs"]
        assert torch.equal(served, served[:, :1].expand_as(served)), "a torn row"
        assert sorted(served[:, 0].long().tolist()) == list(range(total - held, total))
        assert rb.extend(rows_of(total, 2)).tolist() == [head, (head + 1) % 64]
        storage.close()


def rows_of(k: int, n: int) -> TensorDict:
    r = torch.arange(k, k + n)
    return TensorDict({"obs": r.double().view(n, 1).expand(n, 65536).clone()}, batch_size=[n])


def test_an_extend_that_raises_writes_no_row_and_the_next_goes_on_at_the_head(tmp_path):
    """Rows of another shape, or without a stored key: refused before any row is touched, torchrl's writer put
    back, so the buffer goes on as if the extend had not been made."""
    rb = ReplayBuffer(storage=ReplayStorage(8, storage_dir=tmp_path / "d"), batch_size=4)
    reference = ReplayBuffer(storage=LazyTensorStorage(8), batch_size=4)
    for b in (rb, reference):
        b.extend(TensorDict({"a": torch.arange(6.0), "b": torch.arange(6.0)}, [6]))
    with pytest.raises(RuntimeError):
        rb.extend(TensorDict({"a": torch.full((4,), 100.0), "b": torch.full((4, 3), 100.0)}, [4]))
    with pytest.raises(ValueError, match=r"data: a storage_dir writes whole rows, got rows without \[\('b',\)\]"):
        rb.extend(TensorDict({"a": torch.full((4,), 100.0)}, [4]))
    assert rb[:]["a"].tolist() == list(range(6)) and len(rb) == 6
    for b in (rb, reference):
        b.extend(TensorDict({"a": torch.arange(50.0, 55.0), "b": torch.arange(50.0, 55.0)}, [5]))
    assert rb[:]["a"].tolist() == reference[:]["a"].tolist() and len(rb) == len(reference) == 8
    rb.storage.close()
    again = ReplayStorage(8, storage_dir=tmp_path / "d")
    assert len(again) == 8 and again[:]["a"].tolist() == reference[:]["a"].tolist()


KILLED_AFTER_ONE_BLOCK = textwrap.dedent("""
    import os, sys, torch
    from tensordict import TensorDict
    from torchrl.data import ReplayBuffer
    from gpubuf.torchrl import ReplayStorage
    copy = ReplayStorage._copy_staged

    def copy_then_die(self, *args):  # the process dies once the first block is in place
        copy(self, *args)
        os._exit(9)

    ReplayStorage._copy_staged = copy_then_die
    rb = ReplayBuffer(storage=ReplayStorage(5000, storage_dir=sys.argv[1]), batch_size=4)
    rb.extend(TensorDict({"a": torch.arange(6000.0)}, [6000]))
""")


def test_a_process_dying_inside_an_extend_longer_than_the_ring_leaves_the_rows_torchrl_serves_written(tmp_path):
    """6000 rows into an empty ring of 5000 (two staged blocks): dead after the first, the ring re-opens holding
    its first 4096 rows, each the kept data row that lands there (data row j on row j % 5000, j >= 1000)."""
    run = subprocess.run([sys.executable, "-c", KILLED_AFTER_ONE_BLOCK, str(tmp_path / "d")], timeout=120,
                         env={**os.environ, "RL_WARNINGS": "0"})
    assert run.returncode == 9
    rb = ReplayBuffer(storage=ReplayStorage(5000, storage_dir=tmp_path / "d"), batch_size=4)
    assert len(rb) == 4096
    want = [float(i + 5000 if i < 1000 else i) for i in range(4096)]  # row i holds the kept data row landing there
    assert rb[:]["a"].tolist() == want
    assert rb.extend(TensorDict({"a": torch.tensor([-1.0, -2.0])}, [2])).tolist() == [4096, 4097]


def test_an_extend_longer_than_the_ring_keeps_its_last_rows_as_torchrl_does(tmp_path):
    rbs = [ReplayBuffer(storage=s, batch_size=4) for s in (ReplayStorage(8, storage_dir=tmp_path / "d"),
                                                           LazyTensorStorage(8))]
    for n in (3, 19, 5, 8):
        for rb in rbs:
            rb.extend(TensorDict({"a": torch.arange(100.0, 100.0 + n)}, [n]))
        assert rbs[0][:]["a"].tolist() == rbs[1][:]["a"].tolist()
        assert rbs[0]._writer._cursor == rbs[1]._writer._cursor  # noqa: SLF001


def test_refusals_name_what_they_refuse_and_write_nothing(tmp_path):
    with pytest.raises(ValueError, match="max_size: expected an int >= 1, got 0"):
        ReplayStorage(0)
    with pytest.raises(ValueError, match="storage_device: a storage_dir keeps rows on the host"):
        ReplayStorage(10, storage_dir=tmp_path / "x", storage_device="meta")
    with pytest.raises(TypeError, match="data: expected a TensorDict, got Tensor"):
        ReplayBuffer(storage=ReplayStorage(10)).extend(torch.zeros(3, 2))

    rb = TensorDictReplayBuffer(storage=ReplayStorage(CAP, storage_dir=tmp_path / "d"), batch_size=4)
    rb.extend(rows(0, 10))
    before = rb.storage[:].clone()
    with pytest.raises(ValueError, match=r"takes rows at its head \(from row 10\), got rows \[3\] in place"):
        rb[3] = rows(500, 1)[0]  # an in-place rewrite of a held row
    assert torch.equal(rb.storage[:]["obs"], before["obs"]) and rb.storage._ring == (10, 10, 10)  # noqa: SLF001
    with pytest.raises(ValueError, match="is open for writing by"):
        ReplayStorage(CAP, storage_dir=tmp_path / "d")
    rb.extend(rows(10, 3))  # the refusals left it writable
    assert len(rb) == 13

    pid = os.fork()
    if pid == 0:  # a forked child may read, not write
        code = 1
        try:
            rb.extend(rows(13, 2))
        except RuntimeError as err:
            code = 0 if "may not write it" in str(err) else 2
        os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0
    assert len(rb) == 13 and rb.storage._ring == (13, 13, 13)  # noqa: SLF001
    pid = os.fork()
    if pid == 0:  # nor empty it, leaving the owner's length alone
        try:
            rb.storage._empty()  # noqa: SLF001
        except RuntimeError:
            os._exit(0)
        os._exit(1)
    assert os.waitpid(pid, 0)[1] == 0
    assert len(rb) == 13
    with pytest.raises(ValueError, match="state: expected 37 rows"):  # a refused load changes nothing
        rb.storage.load_state_dict(ReplayBuffer(storage=LazyTensorStorage(5)).storage.state_dict() | {
            "_storage": TensorDict({"obs": torch.zeros(5, 2)}, [5]).state_dict(), "initialized": True, "_len": 5})
    with pytest.raises(TypeError, match="cannot be pickled or copied"):
        import pickle

        pickle.dumps(rb.storage)
    rb.storage.close()
    assert len(ReplayStorage(CAP, storage_dir=tmp_path / "d")) == 13

    with pytest.raises(ValueError, match="cannot re-open as this storage: it holds 37 rows, not max_size=40"):
        ReplayStorage(40, storage_dir=tmp_path / "d")


LOSSY = [(torch.int64, torch.tensor([1.7]), "float into an integer dtype"),
         (torch.int64, torch.tensor([float("nan")]), "float into an integer dtype"),
         (torch.uint8, torch.tensor([300]), r"values \[300, 300\] do not fit \[0, 255\]"),
         (torch.uint8, torch.tensor([-1]), r"values \[-1, -1\] do not fit \[0, 255\]"),
         (torch.bool, torch.tensor([2]), r"values \[2, 2\] do not fit \[0, 1\]"),
         (torch.float32, torch.tensor([1e300], dtype=torch.float64), "exceeds the largest torch.float32")]


@pytest.mark.parametrize("tier", ["memory", "dir"])
@pytest.mark.parametrize(("dtype", "bad", "why"), LOSSY, ids=lambda x: str(x) if isinstance(x, torch.dtype) else None)
def test_every_tier_refuses_a_cast_that_changes_values_with_nothing_written(tier, dtype, bad, why, tmp_path):
    """A row whose value the stored dtype cannot hold (an ``add`` or an ``extend``) raises ``TypeError`` naming the
    key, with no row written and torchrl's writer put back; a cast that keeps every value (``int32`` into ``int64``,
    ``float32`` into ``float64``) is stored, in every tier alike."""
    storage = ReplayStorage(8, storage_dir=tmp_path / "d") if tier == "dir" else ReplayStorage(8)
    rb = ReplayBuffer(storage=storage, batch_size=2)
    rb.extend(TensorDict({"k": torch.ones(3, dtype=dtype), ("n", "x"): torch.zeros(3)}, [3]))
    for call, data in ((rb.add, TensorDict({"k": bad[0], ("n", "x"): torch.tensor(0.0)}, [])),
                       (rb.extend, TensorDict({"k": bad, ("n", "x"): torch.zeros(1)}, [1]))):
        with pytest.raises(TypeError, match=rf"data\['k'\]: cannot store .* in the stored dtype {dtype} .*{why}"):
            call(data)
        assert len(rb) == 3 and rb[:]["k"].tolist() == torch.ones(3, dtype=dtype).tolist()
    if tier == "memory":  # an in-place rewrite refused: the writer, which it did not move, stays where it is
        with pytest.raises(TypeError, match=r"data\['k'\]: cannot store"):
            rb[2] = TensorDict({"k": bad[0], ("n", "x"): torch.tensor(0.0)}, [])
        assert rb._writer._cursor == 3 and rb[:]["k"].tolist() == torch.ones(3, dtype=dtype).tolist()  # noqa: SLF001
    with pytest.raises(TypeError, match=r"data\[\('n', 'x'\)\]: cannot store torch.float64 .* torch.float32"):
        huge = torch.tensor([1e300], dtype=torch.float64)
        rb.extend(TensorDict({"k": torch.ones(1, dtype=dtype), ("n", "x"): huge}, [1]))
    rb.extend(TensorDict({"k": torch.zeros(2, dtype=torch.bool), ("n", "x"): torch.tensor([0.5, 2.0])}, [2]))
    rb.add(TensorDict({"k": torch.tensor(False), ("n", "x"): torch.tensor(3.0, dtype=torch.float64)}, []))
    assert rb.extend(TensorDict({"k": torch.zeros(1, dtype=dtype), ("n", "x"): torch.zeros(1)}, [1])).tolist() == [6]
    assert rb[:]["n", "x"].tolist() == [0.0, 0.0, 0.0, 0.5, 2.0, 3.0, 0.0] and len(rb) == 7
    assert rb[:]["k"].dtype == dtype


@pytest.mark.parametrize("tier", ["device", "dir"])
def test_storage_dtypes_narrow_keys_on_every_write_and_refuse_what_they_cannot_hold(tier, tmp_path):
    kw = {"storage_dir": tmp_path / "d"} if tier == "dir" else {}
    narrow = {"obs": torch.bfloat16, ("next", "done"): torch.bool, "episode": torch.int16}
    rb = TensorDictReplayBuffer(storage=ReplayStorage(CAP, storage_dtypes=narrow, **kw), batch_size=4)
    first = rows(0, 5)
    first["obs"] = first["obs"] * 1.37  # values that round in bfloat16
    rb.extend(first)
    rb.extend(rows(5, 7))
    stored = rb.storage[:12]
    assert stored["obs"].dtype == torch.bfloat16 and stored["episode"].dtype == torch.int16
    want = torch.cat([first["obs"], rows(5, 7)["obs"]]).to(torch.bfloat16)
    assert torch.equal(stored["obs"], want)  # the first rows too were cast on write
    bad = rows(12, 3)
    bad["episode"][1] = 40000
    with pytest.raises(TypeError, match=r"data\['episode'\].*do not fit"):
        rb.extend(bad)
    assert len(rb) == 12
    if tier == "dir":
        rb.storage.flush()
        del rb
        with pytest.raises(ValueError, match="storage_dtypes .* differ from its stored keys' dtypes"):
            ReplayStorage(CAP, storage_dir=tmp_path / "d", storage_dtypes={"obs": torch.float16})


def test_bad_storage_dtypes_are_refused_naming_the_key():
    with pytest.raises(TypeError, match="storage_dtypes: expected a dict"):
        ReplayStorage(CAP, storage_dtypes=[("obs", torch.bfloat16)])
    rb = ReplayBuffer(storage=ReplayStorage(CAP, storage_dtypes={"episode": torch.float16}), batch_size=2)
    with pytest.raises(ValueError, match=r"storage_dtypes\[\('episode',\)\]: a float dtype"):
        rb.extend(rows(0, 3))
    rb = ReplayBuffer(storage=ReplayStorage(CAP, storage_dtypes={"nope": torch.float16}), batch_size=2)
    with pytest.raises(ValueError, match=r"storage_dtypes: \('nope',\) is not a leaf of the first row"):
        rb.extend(rows(0, 3))
