"""Copies and processes: deepcopy, pickle, torch.save give independent, complete buffers (or refuse
saying what to use), and a fork while another thread writes hands the child a buffer between
calls."""

import copy
import io
import os
import pickle
import threading

import numpy as np
import pytest
import torch
from extras import needs
from fixtures import index_rows
from snapshots import assert_same_state, snapshot

from gpubuf import HistoryBuffer, PrioritizedTransitionBuffer, Transition, TransitionBuffer

E = 3


def rows(T: int, start: int) -> Transition:
    return index_rows(T, E, start, signed_obs=True, int_action=True, trunc_every=7, info=True)


def via_torch_save(buf):
    f = io.BytesIO()
    torch.save(buf, f)
    f.seek(0)
    return torch.load(f, weights_only=False)


COPIERS = {"deepcopy": copy.deepcopy, "copy": copy.copy,
           "pickle": lambda b: pickle.loads(pickle.dumps(b)), "torch.save": via_torch_save}


def same_batch(a, b) -> None:
    if isinstance(a, tuple):  # (batch, indices) of a prioritized buffer
        assert torch.equal(a[1], b[1])
        a, b = a[0], b[0]
    for (name, x), (_, y) in zip(dict(a).items(), dict(b).items(), strict=True):
        if isinstance(x, dict):
            for k in x:
                assert torch.equal(x[k], y[k]), f"{name}[{k}]"
        else:
            assert torch.equal(x, y), name


@pytest.mark.parametrize("how", COPIERS)
@pytest.mark.parametrize("prioritized", [False, True])
def test_replay_copies_are_independent_and_complete(how, prioritized, host_backend):
    cls = PrioritizedTransitionBuffer if prioritized else TransitionBuffer
    buf = cls(12 * E, 4, rows(1, 0), n_steps=2, device="cpu", seed=3)
    buf.insert(rows(5, 0))
    buf.insert(rows(2, 5))  # numpy inserts of one signature: the steady path from here on
    if prioritized:
        _, idx = buf.sample()
        buf.update_priorities(idx, torch.arange(1.0, 5.0))
        buf.update_beta(0.7)
    twin = COPIERS[how](buf)
    assert type(twin) is cls and twin is not buf
    before = snapshot(buf)
    assert_same_state(snapshot(twin), before)
    same_batch(twin.sample(), buf.sample())  # the generator's state came along
    buf.load_state_dict(before)  # undo the sample's draw on the original

    twin.insert(rows(3, 100))  # steady-path numpy inserts land in the copy...
    assert torch.equal(twin.state_dict()["data"]["reward"][7:10], torch.from_numpy(rows(3, 100).reward))
    assert len(twin) == len(buf) + 3 * E
    assert_same_state(snapshot(buf), before)  # ...and only there
    if prioritized:
        b, idx = twin.sample()
        twin.update_priorities(idx, torch.full((4,), 50.0))
        assert twin.max_priority == pytest.approx(50.0) and buf.max_priority < 50
        assert twin.beta == 0.7
    buf.insert(rows(1, 200))
    assert not torch.equal(twin.state_dict()["data"]["reward"], buf.state_dict()["data"]["reward"])
    twin.sample(), buf.sample()


@pytest.mark.parametrize("how", COPIERS)
def test_history_copies_keep_their_appends(how):
    hist = HistoryBuffer(E, 6, action_block=2, block_keys=("act",), device="cpu")
    for s in range(5):
        v = np.full((E, 1), s, dtype=np.float32)
        hist.append({"obs": v, "act": v})
    twin = COPIERS[how](hist)
    for k, t in hist.get(3).items():
        assert torch.equal(twin.get(3)[k], t)
    v = np.full((E, 1), 9, dtype=np.float32)
    twin.append({"obs": v, "act": v})  # the steady (lockstep) append path
    assert twin.get(1)["obs"].flatten().tolist() == [9.0] * E
    assert hist.get(1)["obs"].flatten().tolist() == [4.0] * E


def test_a_storage_dir_buffer_refuses_copies(tmp_path):
    buf = TransitionBuffer(8 * E, 2, rows(1, 0), device="cpu", storage_dir=tmp_path / "d")
    buf.insert(rows(2, 0))
    for how, fn in COPIERS.items():
        with pytest.raises(TypeError, match="storage_dir .*buffer.save\\(path\\).*state_dict"):
            fn(buf)
        assert len(buf) == 2 * E, how
    buf.close()


def test_bound_objects_refuse_copies():
    buf = TransitionBuffer(8 * E, 2, rows(1, 0), device="cpu")
    buf.insert(rows(3, 0))
    sampler = buf.graph_sampler()
    for fn in COPIERS.values():
        with pytest.raises(TypeError, match="GraphSampler: cannot be copied or pickled.*graph_sampler"):
            fn(sampler)
    envpool = needs("envpool")
    from gpubuf import EnvPoolSource

    src = EnvPoolSource(envpool.make("CartPole-v1", env_type="gymnasium", num_envs=2), device="cpu")
    for fn in COPIERS.values():
        with pytest.raises(TypeError, match="EnvPoolSource: cannot be copied or pickled: it drives"):
            fn(src)


def test_a_fork_during_another_threads_writes_gets_a_whole_buffer():
    """Children forked while a thread inserts and another samples find the buffer between calls:
    whole rows, and masses equal to those rebuilt from the rows."""
    buf = PrioritizedTransitionBuffer(16 * E, 4, rows(1, 0), n_steps=2, device="cpu", seed=0)
    buf.insert(rows(4, 0))
    stop = threading.Event()

    def actor():
        s = 4
        while not stop.is_set():
            buf.insert(rows(2, s))
            s += 2

    t = threading.Thread(target=actor, daemon=True)
    t.start()
    try:
        for _ in range(8):
            pid = os.fork()
            if pid == 0:  # the child: check, then leave without running the parent's cleanup
                code = 1
                try:
                    state = buf.state_dict()
                    data = state["data"]
                    ok = all(torch.equal(data["reward"], data[k].to(torch.float32)) for k in
                             ("action", "info['id']"))
                    fresh = type(buf)(**buf.copy_args())
                    fresh.load_state_dict(state)
                    ok = ok and torch.equal(fresh.sampling_mass() > 0, buf.sampling_mass() > 0)
                    code = 0 if ok else 1
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
    finally:
        stop.set()
        t.join(10)


def _report(buffer, queue) -> None:
    """In a spawned child: what the buffer it was handed holds and samples."""
    queue.put((len(buffer), buffer.sample(key=5).reward.tolist()))


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_buffer_as_the_argument_of_a_spawned_process(method):
    """multiprocessing pickles a Process's arguments with its tensor sharing; the buffer's pickle
    carries its state as bytes, so the child gets it whole."""
    import multiprocessing

    buf = TransitionBuffer(12 * E, 4, rows(1, 0), device="cpu", seed=3)
    buf.insert(rows(6, 0))
    ctx = multiprocessing.get_context(method)
    queue = ctx.Queue()
    child = ctx.Process(target=_report, args=(buf, queue))
    child.start()
    try:
        got = queue.get(timeout=180)
    finally:
        child.join(60)
    assert child.exitcode == 0
    assert got == (len(buf), buf.sample(key=5).reward.tolist())


def test_a_checkpoint_past_the_file_size_limit_names_its_path(tmp_path):
    """save() under RLIMIT_FSIZE (SIGXFSZ ignored, so the write fails with EFBIG): an OSError naming
    the checkpoint, no partial file left, the previous checkpoint intact."""
    import json
    import subprocess
    import sys

    code = f"""
import json, os, resource, signal, sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
from test_copies import rows
from gpubuf import TransitionBuffer
buf = TransitionBuffer(256 * 3, 4, rows(1, 0), device="cpu")
buf.insert(rows(200, 0))
path = {str(tmp_path / "ck")!r}
TransitionBuffer(8 * 3, 4, rows(1, 0), device="cpu").save(path)  # a small previous checkpoint
size = os.path.getsize(path)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (size + 100, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    buf.save(path)
    out = {{"saved": True}}
except OSError as err:
    out = {{"errno": err.errno, "message": str(err), "filename": err.filename}}
out["left"] = sorted(os.listdir({str(tmp_path)!r}))
out["same_size"] = os.path.getsize(path) == size
print(json.dumps(out))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["errno"] == 27 and out["filename"] == str(tmp_path / "ck"), out
    assert f"checkpoint: cannot write '{tmp_path / 'ck'}' (File too large)" in out["message"]
    assert out["left"] == ["ck"] and out["same_size"]
