"""Arguments every path checks, naming the argument: ``frame_stride`` without ``frame_stack``, ``keys=`` of
``HistoryBuffer.get``, and ``device=`` at construction (``cpu:0`` is ``cpu``)."""

import numpy as np
import pytest
import torch
from fixtures import index_rows
from snapshots import assert_unchanged, snapshot

from gpubuf import HistoryBuffer, PrioritizedTransitionBuffer, Transition, TransitionBuffer
from gpubuf.ops import resolve_device

E, M = 2, 8


def rows(T: int, t0: int = 0) -> Transition:
    return index_rows(T, E, t0, obs_dim=3, by_env=False, term_every=3)


def replay(cls, device="cpu"):
    buf = cls(M * E, 4, rows(1), device=device, seed=0)
    buf.insert(rows(M))
    return buf


# ---- frame_stride needs frame_stack, on every path


CALLS = {
    "sample": lambda b, **kw: b.sample(**kw),
    "sample with replacement": lambda b, **kw: b.sample(with_replacement=True, **kw),
    "graph_sampler": lambda b, **kw: b.graph_sampler(**kw),
}


@pytest.mark.parametrize("cls", [TransitionBuffer, PrioritizedTransitionBuffer])
@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("extra", [{}, {"n_step_return": (3, 0.9)}, {"with_next_obs": True}])
@pytest.mark.parametrize("stride", [3, 0, 1.0, True, "1"])
def test_frame_stride_without_frame_stack_is_rejected(cls, call, extra, stride):
    buf = replay(cls)
    before, rng = snapshot(buf), buf.generator.get_state().clone()
    with pytest.raises(ValueError, match=r"frame_stride: needs frame_stack, got frame_stride="):
        CALLS[call](buf, frame_stride=stride, **extra)
    assert_unchanged(buf, before)
    assert torch.equal(buf.generator.get_state(), rng)
    CALLS[call](buf, frame_stride=1, **extra)  # the default is fine
    CALLS[call](buf, frame_stack=2, frame_stride=3, **extra)  # and a stride with stacks


# ---- keys= of HistoryBuffer.get


def history():
    buf = HistoryBuffer(3, 5, 2, ("action",), device="cpu")
    for t in range(4):
        buf.append({"pixels": np.full((3, 1, 2), t, np.uint8), "action": np.full((3, 1, 2), t, np.float32)})
    return buf


class Exploding:
    def __iter__(self):
        raise RuntimeError("boom")


KEYS = {
    "bare string": ("pixels", TypeError, r"keys: expected an iterable of key names such as \('pixels',\), got "
                                         "'pixels'"),
    "bytes": (b"pixels", TypeError, "keys: expected an iterable of key names"),
    "not iterable": (5, TypeError, "keys: expected an iterable of key names such as .*, got 5"),
    "unhashable entry": ([["pixels"]], TypeError, r"keys: expected str key names such as \('pixels',\), got "
                                                  r"\['pixels'\] \(list\)"),
    "dict entry": ([{}], TypeError, r"keys: expected str key names .* \(dict\)"),
    "int entry": (["pixels", 3], TypeError, r"keys: expected str key names .*got 3 \(int\)"),
    "bytes entry": ((b"pixels",), TypeError, r"keys: expected str key names .*\(bytes\)"),
    "unknown": (("pixels", "nope"), ValueError, r"keys: \['nope'\] are not stored; the keys are \['pixels', "
                                                r"'action'\]"),
    "iteration fails": (Exploding(), TypeError, r"keys: could not iterate Exploding \(boom\)"),
}


@pytest.mark.parametrize("env_ids", [None, [2, 0]])  # the lockstep path and the checked one
@pytest.mark.parametrize("case", list(KEYS))
def test_bad_keys_name_keys_and_change_nothing(env_ids, case):
    keys, exc, message = KEYS[case]
    buf = history()
    before = snapshot(buf)
    for _ in range(2):  # twice: a rejected call caches nothing that lets the second through
        with pytest.raises(exc, match=message):
            buf.get(3, env_ids=env_ids, keys=keys)
    assert_unchanged(buf, before)


@pytest.mark.parametrize("env_ids", [None, [2, 0]])
def test_good_keys_in_any_iterable(env_ids):
    buf = history()
    full = buf.get(3, env_ids=env_ids)
    for keys in (["pixels"], ("pixels",), {"pixels"}, iter(["pixels"]), (k for k in ["pixels"]),
                 {"pixels": None}, ["pixels", "pixels"]):
        got = buf.get(3, env_ids=env_ids, keys=keys)
        assert list(got) == ["pixels"] and torch.equal(got["pixels"], full["pixels"])
    assert buf.get(3, env_ids=env_ids, keys=[]) == {}


# ---- device= at construction


def builders(device):
    return {
        "HistoryBuffer": lambda: HistoryBuffer(2, 3, device=device),
        "TransitionBuffer": lambda: TransitionBuffer(M * E, 4, rows(1), device=device),
        "PrioritizedTransitionBuffer": lambda: PrioritizedTransitionBuffer(M * E, 4, rows(1), device=device),
        "storage_device": lambda: TransitionBuffer(M * E, 4, rows(1), device="cpu", storage_device=device),
        "resolve_device": lambda: resolve_device(device),
    }


BAD = ["meta", "cuda:99", "cpu:1", "nonsense", 3.5]
if not torch.cuda.is_available():
    BAD += ["cuda", "cuda:0", torch.device("cuda")]


@pytest.mark.parametrize("device", BAD, ids=str)
@pytest.mark.parametrize("what", list(builders(None)))
def test_an_unusable_device_is_refused_at_construction(device, what):
    with pytest.raises(ValueError, match="device: "):
        builders(device)[what]()


def test_device_messages_say_why():
    with pytest.raises(ValueError, match="device: meta tensors hold no data"):
        HistoryBuffer(2, 3, device="meta")
    with pytest.raises(ValueError, match=r"device: 'cuda:99' does not exist|device: CUDA is not available"):
        TransitionBuffer(M * E, 4, rows(1), device="cuda:99")
    with pytest.raises(ValueError, match=r"device: the host is one device, 'cpu' \(or 'cpu:0'\), got 'cpu:1'"):
        PrioritizedTransitionBuffer(M * E, 4, rows(1), device="cpu:1")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_without_cuda_says_so():
    with pytest.raises(ValueError, match="device: CUDA is not available on this machine, got 'cuda'"):
        HistoryBuffer(2, 3, device="cuda")


@pytest.mark.parametrize("device", ["cpu:0", torch.device("cpu", 0), "cpu", None])
def test_cpu_0_is_cpu_and_out_tensors_on_it_are_accepted(device):
    if device is None and torch.cuda.is_available():
        pytest.skip("None is cuda here")
    cpu = torch.device("cpu")
    hist = history_on(device)
    assert hist.device == cpu
    want = hist.get(3)
    for env_ids in (None, [0, 1, 2]):
        out = {k: torch.empty_like(v, device="cpu:0") for k, v in want.items()}
        got = hist.get(3, env_ids=env_ids, out=out)
        assert all(got[k] is out[k] and torch.equal(got[k], want[k]) for k in want)
    buf = replay(TransitionBuffer, device=device)
    per = replay(PrioritizedTransitionBuffer, device=device)
    assert buf.device == per.device == buf.storage_device == cpu
    batch = buf.sample(key=3)
    out = Transition(observation=torch.empty_like(batch.observation, device="cpu:0"),
                     action=torch.empty_like(batch.action), reward=torch.empty_like(batch.reward),
                     terminated=torch.empty_like(batch.terminated), truncated=torch.empty_like(batch.truncated))
    got = buf.sample(key=3, out=out)
    assert got is out and torch.equal(out.observation, batch.observation)
    assert per.sample(out=per.sample()[0])[0].observation.device == cpu
    assert buf.graph_sampler().sample()[0].observation.device == cpu


def history_on(device):
    buf = HistoryBuffer(3, 5, 2, ("action",), device=device)
    for t in range(4):
        buf.append({"pixels": np.full((3, 1, 2), t, np.uint8), "action": np.full((3, 1, 2), t, np.float32)})
    return buf
