"""A storage_dir survives its process: SIGKILL at any instant, one writer, space up front, validated re-open.

Every row the crash tests write holds one write id in every byte of every leaf, so a row that mixes two
writes shows (its observation, action and reward disagree, or its observation is not one value).
"""

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from gpubuf import PrioritizedTransitionBuffer, Transition, TransitionBuffer

E, M, D = 4, 32, 4096  # 16 KiB observations: a kill often lands inside a leaf's copy


def rows(T, wid, n_envs=E, width=D):
    """T rows whose every value is the write id ``wid`` (float32-exact)."""
    v = np.full((T, n_envs), wid, np.float32)
    return Transition(observation=np.repeat(v[..., None], width, -1), action=v.astype(np.int64), reward=v.copy(),
                      terminated=np.zeros((T, n_envs), bool), truncated=np.zeros((T, n_envs), bool))


def held_rows(buf):
    """(count, E) write ids of the rows the buffer holds, oldest first; raises if a row mixes writes."""
    state = buf.state_dict()
    pos, count = state["pos"], state["count"]
    order = [(pos - count + i) % buf.max_rows for i in range(count)]
    obs, act, rew = (state["data"][k][order] for k in ("observation", "action", "reward"))
    assert torch.equal(obs.amin(-1), obs.amax(-1)), "a row's observation mixes two writes"
    assert torch.equal(obs[..., 0], rew) and torch.equal(rew.long(), act), "a row's leaves come from two writes"
    return rew


_WRITER = textwrap.dedent("""
    import sys, numpy as np, torch
    sys.path.insert(0, {tests!r})
    from test_storage_dir_durability import E, M, rows
    from gpubuf import {cls}
    buf = {cls}(E * M, 8, rows(1, 0), n_steps=3, device="cpu", storage_dir={path!r})
    rng = np.random.default_rng({seed})
    other = {cls}(E * M, 8, rows(1, 0), n_steps=3, device="cpu").insert(rows(M, 10**6 + {seed}))
    loaded = other.state_dict()
    wid = 1 + {seed} * 10**4
    print("ready", flush=True)
    while True:
        op = rng.random()
        if op < 0.75:
            buf.insert(rows(int(rng.integers(1, M // 2)), wid))
            wid += 1
        elif op < 0.85:
            buf.flush()
        elif op < 0.92:
            buf.load_state_dict(loaded)
        elif {prioritized}:
            buf.update_priorities(rng.integers(0, E * M, 16), rng.random(16) * 5)
""")


@pytest.mark.parametrize("cls", [TransitionBuffer, PrioritizedTransitionBuffer])
def test_a_process_killed_at_any_instant_reopens_only_whole_rows(cls, tmp_path):
    path = tmp_path / "b"
    tests = os.path.dirname(__file__)
    rolled_back = 0
    for seed in range(8):
        code = _WRITER.format(tests=tests, cls=cls.__name__, path=str(path), seed=seed,
                              prioritized=cls is PrioritizedTransitionBuffer)
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert child.stdout.readline().strip() == b"ready", child.stderr.read().decode()
        time.sleep(0.02 + 0.03 * seed)  # many points of the writer's loop
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        # re-opened here: another process than the writer, which held the lock until it was killed
        buf = cls(E * M, 8, rows(1, 0), n_steps=3, device="cpu", storage_dir=path)
        ids = held_rows(buf)
        rolled_back += 0 < len(buf) < E * M
        if len(buf):
            batch = buf.sample(key=seed, batch_size=16, with_replacement=True)
            batch = batch[0] if isinstance(batch, tuple) else batch
            assert torch.equal(batch.observation.amin(-1), batch.observation.amax(-1))
            assert torch.equal(batch.observation[..., 0], batch.reward)
            assert set(batch.reward.unique().tolist()) <= set(ids.unique().tolist())
        buf.close()
    print(f"{rolled_back} of 8 kills re-opened with the rows in flight dropped")


def test_a_second_writer_is_refused_naming_the_directory_and_holder(tmp_path):
    path = tmp_path / "b"
    first = TransitionBuffer(E * M, 8, rows(1, 0, width=3), device="cpu", storage_dir=path).insert(rows(5, 7, width=3))
    files = {p.name: p.read_bytes() for p in path.iterdir()}
    with pytest.raises(ValueError, match=f"storage_dir: '{path}' is open for writing by pid {os.getpid()} on "):
        TransitionBuffer(E * M, 8, rows(1, 0, width=3), device="cpu", storage_dir=path)
    code = (f"from gpubuf import TransitionBuffer\nimport sys\nsys.path.insert(0, {os.path.dirname(__file__)!r})\n"
            f"from test_storage_dir_durability import rows\n"
            f"TransitionBuffer({E * M}, 8, rows(1, 0, width=3), device='cpu', storage_dir={str(path)!r})")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert other.returncode != 0 and f"is open for writing by pid {os.getpid()}" in other.stderr
    assert {p.name: p.read_bytes() for p in path.iterdir()} == files  # nothing written by either
    first.close()
    first.close()  # twice: harmless
    with pytest.raises(ValueError, match="was closed"):
        first.insert(rows(1, 8, width=3))
    assert first.sample(batch_size=2).reward.tolist() == [7.0, 7.0]  # a closed buffer still samples
    with TransitionBuffer(E * M, 8, rows(1, 0, width=3), device="cpu", storage_dir=path) as again:
        assert len(again) == 5 * E
        again.insert(rows(1, 9, width=3))
    del again
    gc.collect()
    assert len(TransitionBuffer(E * M, 8, rows(1, 0, width=3), device="cpu", storage_dir=path)) == 6 * E


def test_a_disk_without_room_is_an_error_before_anything_is_written(tmp_path):
    path = tmp_path / "big"
    huge = 2**50 // (E * 4)  # rows of one float32 value: a PiB of files
    with pytest.raises(ValueError, match=r"storage_dir: the buffer's files need \d+ bytes, but the disk holding .* "
                                         r"has \d+ bytes free"):
        TransitionBuffer(huge * E, 8, rows(1, 0, width=1), device="cpu", storage_dir=path)
    assert not path.exists()
    (tmp_path / "kept").mkdir()
    with pytest.raises(ValueError, match="bytes free"):
        TransitionBuffer(huge * E, 8, rows(1, 0, width=1), device="cpu", storage_dir=tmp_path / "kept")
    assert list((tmp_path / "kept").iterdir()) == []  # an existing directory is left as it was


def test_files_are_allocated_not_sparse(tmp_path):
    TransitionBuffer(E * 1024, 8, rows(1, 0, width=256), device="cpu", storage_dir=tmp_path / "b").close()
    leaf = tmp_path / "b" / "leaf0.bin"
    assert leaf.stat().st_blocks * 512 >= leaf.stat().st_size == E * 1024 * 256 * 4


def _flushed(tmp_path, cls=PrioritizedTransitionBuffer):
    buf = cls(E * M, 8, rows(1, 0, width=3), device="cpu", storage_dir=tmp_path / "b").insert(rows(5, 3, width=3))
    if cls is PrioritizedTransitionBuffer:
        buf.update_priorities([0, 1], [2.0, 3.0])
    buf.close()
    return tmp_path / "b"


def _reopen(path, cls=PrioritizedTransitionBuffer):
    return cls(E * M, 8, rows(1, 0, width=3), device="cpu", storage_dir=path)


@pytest.mark.parametrize("change, match", [
    (lambda s: s["priority"].__setitem__(1, float("nan")), "priority"),
    (lambda s: s["priority"].__setitem__(1, -1.0), "priority"),
    (lambda s: s["priority"].__setitem__(1, float("inf")), "priority"),
    (lambda s: s["priority"].__setitem__(1, 99.0), "priority"),  # above max_priority
    (lambda s: s["priority"].__setitem__(3, 0.0), "priority"),  # a held start without mass
    (lambda s: s.__setitem__("max_priority", float("nan")), "max_priority"),
    (lambda s: s.__setitem__("max_priority", 0.5), "max_priority"),
    (lambda s: s.__setitem__("beta", -1.0), "beta"),
    (lambda s: s.__setitem__("total", -3), "total"),
    (lambda s: s.__setitem__("rng", torch.zeros(5, dtype=torch.uint8)), "state"),
    (lambda s: s.__setitem__("rng", None), "rng: expected a uint8 generator state"),
    (lambda s: s.__setitem__("total", 10**6),  # past the rows written
     r"saved by flush 1 with 1000000 rows ever written, which the row journal .*counters.bin \(1 flushes, 5 rows"),
    (lambda s: s.__setitem__("flush", 7), r"saved by flush 7 .*counters.bin \(1 flushes"),
    (lambda s: s.__delitem__("priority"), "KeyError"),
])
def test_reopen_validates_the_flushed_state_like_a_load(tmp_path, change, match):
    path = _flushed(tmp_path)
    state = torch.load(path / "state.pt", weights_only=True)
    good = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    change(state)
    torch.save(state, path / "state.pt")
    files = {p.name: p.read_bytes() for p in path.iterdir() if p.name != "lock"}
    with pytest.raises(ValueError, match=f"storage_dir: .*state.pt cannot be restored .*{match}") as failed:
        _reopen(path)
    assert {p.name: p.read_bytes() for p in path.iterdir() if p.name != "lock"} == files
    torch.save(good, path / "state.pt")  # repaired: it re-opens at once (the failed buffer released the lock)
    assert failed.value is not None and len(_reopen(path)) == 5 * E


def test_reopen_refuses_two_leaves_in_one_file(tmp_path):
    path = _flushed(tmp_path)
    meta = json.loads((path / "gpubuf.json").read_text())
    meta["leaves"]["reward"]["file"] = meta["leaves"]["action"]["file"]
    (path / "gpubuf.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="gpubuf.json names the file 'leaf[0-9].bin' for leaf 'reward' and for leaf "
                                         "'action'; every leaf needs a file of its own"):
        _reopen(path)
    meta["leaves"]["reward"]["file"] = "counters.bin"
    (path / "gpubuf.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="'counters.bin' for leaf 'reward' and for the directory's bookkeeping"):
        _reopen(path)


def test_a_killed_load_reopens_empty_and_a_torn_insert_without_its_rows(tmp_path):
    """The journal's two states, written as a killed process leaves them (no helper of the buffer is used)."""
    path = _flushed(tmp_path, TransitionBuffer)
    buf = _reopen(path, TransitionBuffer)
    buf.insert(rows(M - 5, 4, width=3))  # full, writing at row 0: 5 rows of id 3, then M - 5 of id 4
    buf.close()
    words = np.memmap(path / "counters.bin", dtype=np.int64, mode="r+")
    spare, flushes = 1 - int(words[0]), int(words[2 + 4 * int(words[0]) + 3])
    words[2 + 4 * spare:6 + 4 * spare] = (0, M - 4, M, flushes)  # the pre-write state of an insert of 4 rows at 0
    words[0] = spare
    words.flush()
    leaf = np.memmap(path / "leaf0.bin", dtype=np.float32, mode="r+").reshape(E, M, 3)
    leaf[:, 0:2] = 99  # two of its rows written (observations only) when it was killed
    leaf.flush()
    again = _reopen(path, TransitionBuffer)
    assert len(again) == (M - 4) * E and set(held_rows(again).unique().tolist()) == {3.0, 4.0}


def test_an_os_crash_after_unflushed_writes_reopens_empty_with_a_warning(tmp_path):
    path = _flushed(tmp_path, TransitionBuffer)
    buf = _reopen(path, TransitionBuffer).insert(rows(2, 8, width=3))
    del buf
    gc.collect()
    words = np.memmap(path / "counters.bin", dtype=np.int64, mode="r+")
    assert words[1] == 1  # dirty: written since the flush
    clean = _reopen(path, TransitionBuffer)  # same boot: a killed process, the rows are whole
    assert len(clean) == 7 * E
    del clean
    gc.collect()
    words[10:12] = (12345, 678)  # as if written under another boot
    words.flush()
    with pytest.warns(UserWarning, match="restarted since; the unflushed writes may be partial"):
        crashed = _reopen(path, TransitionBuffer)
    assert len(crashed) == 0
    crashed.insert(rows(3, 9, width=3))
    assert held_rows(crashed).unique().tolist() == [9.0]


def as_before_the_journal(path, counters):
    """Make the flushed directory ``path`` one that a buffer written before the row journal left: three counters
    ``(position, rows held, rows ever written)``, a description that names no journal, a state without a flush
    number."""
    (path / "counters.bin").write_bytes(np.array(counters, np.int64).tobytes())
    meta = json.loads((path / "gpubuf.json").read_text())
    del meta["journal"]
    (path / "gpubuf.json").write_text(json.dumps(meta, indent=1))
    if (path / "state.pt").exists():
        state = torch.load(path / "state.pt", weights_only=True)
        del state["flush"]
        torch.save(state, path / "state.pt")


def test_a_directory_without_the_journal_is_upgraded(tmp_path):
    path = _flushed(tmp_path, TransitionBuffer)
    rng = torch.load(path / "state.pt", weights_only=True)["rng"]
    as_before_the_journal(path, (5, 5, 5))
    buf = _reopen(path, TransitionBuffer)
    assert len(buf) == 5 * E and held_rows(buf).unique().tolist() == [3.0]
    assert torch.equal(buf.generator.get_state(), rng)  # its flushed state restored
    assert (path / "counters.bin").stat().st_size == 12 * 8  # converted to the journal once it opened
    buf.insert(rows(2, 4, width=3)).close()
    again = _reopen(path, TransitionBuffer)
    assert len(again) == 7 * E and held_rows(again).unique().tolist() == [3.0, 4.0]


def test_a_state_holding_rows_before_a_later_position_loads_and_samples_only_them():
    source = TransitionBuffer(E * 10, 4, rows(1, 0, width=3), device="cpu").insert(rows(10, 1, width=3))
    state = source.state_dict()
    state["data"] = {k: v.clone() for k, v in state["data"].items()}
    for k in ("observation", "reward", "action"):
        state["data"][k][:2] = 0  # rows 0, 1: not held (the 5 rows before row 7 are)
        state["data"][k][7:] = 0
    target = TransitionBuffer(E * 10, 4, rows(1, 0, width=3), device="cpu")
    target.load_state_dict({**state, "pos": 7, "count": 5})
    assert len(target) == 5 * E and target.num_valid() == 5 * E
    assert target.sample(batch_size=200).reward.unique().tolist() == [1.0]
    assert held_rows(target).unique().tolist() == [1.0]


@pytest.mark.parametrize("value", ["gpu", 5, object()])
def test_tier_arguments_name_themselves(value):
    with pytest.raises((ValueError, TypeError), match="^storage_device: "):
        TransitionBuffer(E * M, 8, rows(1, 0, width=3), device="cpu", storage_device=value)
    with pytest.raises((ValueError, TypeError), match="^storage_device: "):
        TransitionBuffer(E * M, 8, rows(1, 0, width=3), device="cpu", storage_device=value, storage_dir="/tmp/none")


def test_a_state_file_that_is_not_a_flushed_state_or_a_broken_journal_is_named(tmp_path):
    path = _flushed(tmp_path)
    torch.save(torch.zeros(3), path / "state.pt")
    with pytest.raises(ValueError, match="state.pt cannot be restored .*expected the dict a flush saves, got Tensor"):
        _reopen(path)
    (path / "state.pt").unlink()
    with pytest.raises(ValueError,
                       match="state.pt cannot be restored .*missing, while the row journal .*counters.bin counts 1 "):
        _reopen(path)
    path = _flushed(tmp_path / "again")
    words = np.memmap(path / "counters.bin", dtype=np.int64, mode="r+")
    words[0] = 2
    words.flush()
    with pytest.raises(ValueError, match=r"storage_dir: counters in .*counters.bin \(active slot 2, dirty 0\)"):
        _reopen(path)


@pytest.mark.parametrize("name", ["state.pt.tmp", "counters.tmp", "gpubuf.tmp", "lock", "x.bin", "leaf1.bin.tmp"])
def test_a_leaf_file_name_outside_the_leaf_pattern_is_refused(tmp_path, name):
    path = _flushed(tmp_path)
    meta = json.loads((path / "gpubuf.json").read_text())
    old = meta["leaves"]["reward"]["file"]
    (path / old).rename(path / name)
    meta["leaves"]["reward"]["file"] = name
    (path / "gpubuf.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=f"storage_dir: .*gpubuf.json names the file '{name}' for leaf 'reward'"):
        _reopen(path)


def test_leaf_files_linked_to_one_file_or_elsewhere_are_refused(tmp_path):
    path = _flushed(tmp_path)
    meta = json.loads((path / "gpubuf.json").read_text())
    a, b = meta["leaves"]["reward"]["file"], meta["leaves"]["terminated"]["file"]
    size = (path / b).stat().st_size
    outside = tmp_path / "outside.bin"
    outside.write_bytes(bytes(size))
    (path / b).unlink()
    os.symlink(outside, path / b)
    with pytest.raises(ValueError, match=f"{b} is a symbolic link"):
        _reopen(path)
    (path / b).unlink()
    os.link(path / a, path / b)  # reward and terminated both 4 bytes per value here? sizes checked next anyway
    with pytest.raises(ValueError, match="are one file \\(hard links\\)"):
        _reopen(path)


def test_a_load_cut_short_after_saving_its_state_reopens_empty_and_later_rows_at_max_priority(tmp_path):
    """The journal as a process killed inside the load's flush leaves it: the state file already holds the loaded
    state (one flush ahead), the journal still the empty pre-load commit."""
    path = _flushed(tmp_path)  # 5 rows of id 3, max_priority 3 + eps
    buf = _reopen(path)
    words = np.memmap(path / "counters.bin", dtype=np.int64, mode="r")
    total, flushes = (int(v) for v in words[2 + 4 * int(words[0]) + 2:2 + 4 * int(words[0]) + 4])
    source = PrioritizedTransitionBuffer(E * M, 8, rows(1, 0, width=3), device="cpu").insert(rows(M, 11, width=3))
    source.update_priorities(np.arange(E * M), np.full(E * M, 9.0))
    buf.load_state_dict(source.state_dict())  # flush number flushes + 1
    del buf
    gc.collect()
    words = np.memmap(path / "counters.bin", dtype=np.int64, mode="r+")
    spare = 1 - int(words[0])
    words[2 + 4 * spare:6 + 4 * spare] = (0, 0, total, flushes)  # the pre-load commit: empty
    words[0] = spare
    words.flush()
    again = _reopen(path)
    assert len(again) == 0  # the rows in flight are not held
    again.insert(rows(2, 12, width=3))
    del again
    gc.collect()  # killed before any flush
    last = _reopen(path)
    assert len(last) == 2 * E and held_rows(last).unique().tolist() == [12.0]
    mass = last.sampling_mass()
    assert torch.allclose(mass[mass > 0], torch.tensor(last.max_priority, dtype=torch.float64) ** last.alpha)


def test_a_closed_buffer_refuses_priority_and_beta_updates(tmp_path):
    path = _flushed(tmp_path)
    buf = _reopen(path)
    buf.close()
    for call in (lambda: buf.update_priorities([0], [5.0]), lambda: buf.update_beta(0.9)):
        with pytest.raises(ValueError, match="was closed"):
            call()
    assert buf.max_priority < 5 and buf.beta == 0.4
