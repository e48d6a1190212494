"""Checkpoints: state dicts that torch.load reads with its defaults, strict and atomic load_state_dict,
streaming atomic save/load (bounded memory, crash-safe, verified before the first write), fresh processes."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from fixtures import make_transition
from snapshots import assert_same_state, assert_unchanged, snapshot

from gpubuf import HistoryBuffer, PrioritizedTransitionBuffer, TransitionBuffer
from gpubuf._core.checkpoint import CheckpointError

HERE = os.path.dirname(os.path.abspath(__file__))


def history(device="cpu", dtype=np.uint8):
    buf = HistoryBuffer(3, 5, 2, ("action",), device=device)
    for t in range(7):
        buf.append({"pixels": np.full((3, 1, 2), t, dtype), "action": np.full((3, 1, 2), t, np.float32)})
    buf.reset([1])
    return buf


def replay(prioritized=False, device="cpu", n_rows=14):
    cls = PrioritizedTransitionBuffer if prioritized else TransitionBuffer
    buf = cls(30, 4, make_transition(0, 1, 3), n_steps=2, device=device, seed=5)
    buf.insert(make_transition(0, 10, 3, trunc_steps=(4,))).insert(make_transition(10, n_rows - 10, 3))
    if prioritized:
        buf.update_priorities([0, 5, 7], [2.0, 0.5, 9.0])
    buf.sample(with_next_obs=True)  # trees built, RNG advanced
    return buf


BUILDERS = {"history": history, "replay": replay, "prioritized": lambda **kw: replay(True, **kw)}


def fresh(name, device="cpu"):
    if name == "history":
        return HistoryBuffer(3, 5, 2, ("action",), device=device)
    cls = PrioritizedTransitionBuffer if name == "prioritized" else TransitionBuffer
    return cls(30, 4, make_transition(0, 1, 3), n_steps=2, device=device, seed=99)


def outputs(buf):
    """What a user reads next: histories, or three batches from the buffer's own generator."""
    if isinstance(buf, HistoryBuffer):
        return [buf.get(3, env_ids=[0, 2]), {"n": torch.tensor(buf.num_strided())}]
    out = []
    for wno in (False, True):
        b = buf.sample(with_next_obs=wno)
        out.append(b if isinstance(b, tuple) else (b,))
    return out


def assert_same_outputs(a, b):
    for x, y in zip(a, b, strict=True):
        if isinstance(x, dict):
            assert all(torch.equal(x[k], y[k]) for k in x)
        else:
            assert torch.equal(x[0].observation, y[0].observation)
            if len(x) > 1:
                assert torch.equal(x[1], y[1]) and torch.equal(x[0].PER_weights, y[0].PER_weights)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_state_dict_loads_with_torch_defaults_and_round_trips(name, tmp_path, backend, device):
    buf = BUILDERS[name](device=device)
    torch.save(buf.state_dict(), tmp_path / "s.pt")
    state = torch.load(tmp_path / "s.pt")  # weights_only=True: tensors and plain values only
    other = fresh(name, device)
    other.load_state_dict(state)
    assert_same_state(snapshot(other), snapshot(buf))
    assert_same_outputs(outputs(other), outputs(buf))


@pytest.mark.parametrize("name", list(BUILDERS))
def test_save_load_round_trip(name, tmp_path, backend, device):
    buf = BUILDERS[name](device=device)
    buf.save(tmp_path / "ckpt")
    assert os.listdir(tmp_path) == ["ckpt"]  # no temporary file left behind
    other = fresh(name, device)
    other.load(tmp_path / "ckpt")
    assert_same_state(snapshot(other), snapshot(buf))
    assert_same_outputs(outputs(other), outputs(buf))


FRESH_PROCESS = """
import sys, torch
sys.path.insert(0, {here!r})
from test_checkpoint import fresh, outputs
buf = fresh({name!r}, {device!r})
buf.load({path!r})
torch.save(outputs(buf), {out!r})
"""


@pytest.mark.parametrize("name", list(BUILDERS))
def test_checkpoint_resumes_in_a_fresh_process(name, tmp_path, backend, device):
    buf = BUILDERS[name](device=device)
    buf.save(tmp_path / "ckpt")
    code = FRESH_PROCESS.format(here=HERE, name=name, device=device, path=str(tmp_path / "ckpt"),
                                out=str(tmp_path / "out.pt"))
    # the child inherits GPUBUF_BACKEND, and TRITON_INTERPRET=1 where conftest set it (no CUDA)
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ))
    theirs = torch.load(tmp_path / "out.pt", weights_only=False)
    assert_same_outputs(theirs, outputs(buf))


# ------------------------------------------------------------------ strict, atomic load_state_dict


def _cut(state, *path):
    state = dict(state)
    if len(path) == 1:
        del state[path[0]]
    else:
        state[path[0]] = {k: v for k, v in state[path[0]].items() if k != path[1]}
    return state


def _with(state, key, value):
    return {**state, key: value}


BROKEN = {
    "history: no counts": ("history", lambda s: _cut(s, "counts"), ValueError, r"missing keys \['counts'\]"),
    "history: float32 data into uint8": ("history", lambda s: {**s, "data": {**s["data"], "pixels":
                                         s["data"]["pixels"].float()}}, ValueError,
                                         r"state_dict\['data'\]\['pixels'\]: expected a torch.uint8 tensor"),
    "history: data cut to one row": ("history", lambda s: {**s, "data": {**s["data"], "pixels":
                                     s["data"]["pixels"][:1]}}, ValueError,
                                     r"state_dict\['data'\]\['pixels'\]: expected a torch.uint8 tensor of shape "
                                     r"\(15, 2\)"),
    "history: count too large": ("history", lambda s: _with(s, "counts", s["counts"] + 9), ValueError,
                                 r"state_dict\['counts'\]: expected entry counts in \[0, 5\]"),
    "history: head out of range": ("history", lambda s: _with(s, "heads", s["heads"] - 9), ValueError,
                                   r"state_dict\['heads'\]"),
    "history: other max_len": ("history", lambda s: _with(s, "max_len", 6), ValueError,
                               "state_dict: max_len is 6, this buffer has 5"),
    "history: a replay state": ("history", lambda s: replay().state_dict(), ValueError,
                                r"state_dict\['buffer'\]: this is a HistoryBuffer, the state is of a TransitionBuffer"),
    "replay: no rng": ("replay", lambda s: _cut(s, "rng"), ValueError, r"missing keys \['rng'\]"),
    "replay: prioritized state": ("replay", lambda s: replay(True).state_dict(), ValueError,
                                  "this is a TransitionBuffer, the state is of a PrioritizedTransitionBuffer"),
    "replay: a data leaf missing": ("replay", lambda s: _cut(s, "data", "reward"), ValueError,
                                    r"state_dict\['data'\]: missing keys \['reward'\]"),
    "replay: count past capacity": ("replay", lambda s: _with(s, "count", 11), ValueError,
                                    r"state_dict\['count'\]: expected an int in \[0, 10\]"),
    "replay: pos past the ring": ("replay", lambda s: {**s, "pos": 10}, ValueError,
                                  r"state_dict\['pos'\]: expected an int in \[0, 9\]"),
    "replay: rng not a state": ("replay", lambda s: _with(s, "rng", torch.zeros_like(s["rng"])), ValueError,
                                r"state_dict\['rng'\]: not a generator state"),
    "replay: float count": ("replay", lambda s: _with(s, "count", 3.0), ValueError, r"state_dict\['count'\]"),
    "prioritized: no priority": ("prioritized", lambda s: _cut(s, "priority"), ValueError,
                                 r"missing keys \['priority'\]"),
    "prioritized: other uniform buffer": ("prioritized", lambda s: replay().state_dict(), ValueError,
                                          "the state is of a TransitionBuffer"),
    "prioritized: NaN priority": ("prioritized", lambda s: _with(s, "priority", s["priority"].clone().fill_(
                                  float("nan"))), ValueError, r"state_dict\['priority'\]: expected priorities"),
    "prioritized: zero priority of a written start": ("prioritized", lambda s: _with(s, "priority", torch.zeros_like(
        s["priority"])), ValueError, r"state_dict\['priority'\]"),
    "prioritized: negative priority of an unwritten start": ("prioritized", lambda s: _with(s, "priority", s[
        "priority"].clone().index_fill_(0, torch.tensor([29], device=s["priority"].device), -1.0)), ValueError,
        r"state_dict\['priority'\]: .* of the others in \[0, max_priority\]"),
    "prioritized: other alpha": ("prioritized", lambda s: _with(s, "alpha", 0.7), ValueError,
                                 "state_dict: alpha is 0.7, this buffer has 0.6"),
    "prioritized: max_priority below 1": ("prioritized", lambda s: _with(s, "max_priority", 0.5), ValueError,
                                          r"state_dict\['max_priority'\]"),
    "not a dict": ("replay", lambda s: [1, 2], TypeError, "state_dict: expected a dict"),
    "history: meta data tensor": ("history", lambda s: {**s, "data": {**s["data"], "action": torch.empty(
        s["data"]["action"].shape, device="meta")}}, ValueError,
        r"state_dict\['data'\]\['action'\]: expected a dense tensor with data, got a torch.strided tensor on meta"),
    "replay: sparse data tensor": ("replay", lambda s: {**s, "data": {**s["data"], "reward": s["data"][
        "reward"].to_sparse()}}, ValueError, r"state_dict\['data'\]\['reward'\]: expected a dense tensor"),
    "replay: trunc disagrees with the data": ("replay", lambda s: _with(s, "trunc", ~s["trunc"]), ValueError,
                                              r"state_dict\['trunc'\]: does not match the stored `truncated` rows"),
    "replay: other leaf shapes": ("replay", lambda s: _with(s, "shapes", {**s["shapes"], "reward": (2,)}),
                                  ValueError, r"state_dict: shapes is"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_load_state_dict_rejects_a_broken_state_and_writes_nothing(case, backend, device):
    name, breaks, exc, match = BROKEN[case]
    good = BUILDERS[name](device=device)
    buf = BUILDERS[name](device=device)
    buf.insert(make_transition(50, 3, 3)) if name != "history" else buf.append(
        {"pixels": np.full((3, 1, 2), 50, np.uint8), "action": np.full((3, 1, 2), 50, np.float32)})
    before, reads = snapshot(buf), outputs(BUILDERS[name](device=device))
    with pytest.raises(exc, match=match):
        buf.load_state_dict(breaks(snapshot(good)))
    assert_unchanged(buf, before)
    assert reads  # the buffer still samples
    assert outputs(buf)


def test_an_empty_history_takes_the_state_keys():
    buf = history(dtype=np.int16)
    other = HistoryBuffer(3, 5, 2, ("action",))
    other.load_state_dict(buf.state_dict())
    assert other.keys == ("pixels", "action") and other.state_dict()["data"]["pixels"].dtype == torch.int16
    assert_same_outputs(outputs(other), outputs(buf))


@pytest.mark.parametrize("breaks, match", [
    (lambda s: {**s, "counts": torch.ones_like(s["counts"]), "shapes": {}, "data": {}},
     r"state_dict\['counts'\]: a state without keys holds no entries"),
    (lambda s: {**s, "shapes": {1: (2,)}, "data": {1: s["data"]["pixels"]}},
     r"state_dict\['shapes'\]: expected str keys"),
    (lambda s: {**s, "shapes": {**s["shapes"], "pixels": (True, 1)}},
     r"state_dict\['shapes'\]\['pixels'\]: expected a shape, got \(True, 1\)"),
    (lambda s: {**s, "data": {**s["data"], "action": s["data"]["action"].to(torch.complex64)}},
     r"state_dict\['data'\]\['action'\]: a block key holds .* got torch.complex64"),
])
def test_an_empty_history_rejects_a_state_it_cannot_take(breaks, match):
    state = snapshot(history())
    buf = HistoryBuffer(3, 5, 2, ("action",))
    with pytest.raises(ValueError, match=match):
        buf.load_state_dict(breaks(state))
    assert buf.keys == () and buf.get(1) is None


# ------------------------------------------------------------------ checkpoint files


def _header(raw: bytes) -> tuple[int, int]:
    import struct
    at, length, _, _ = struct.unpack("<QQI4x16s", raw[-40:])
    return at, length


def test_an_edited_header_is_rejected_before_any_write(tmp_path):
    """The header carries the configuration and the tensor table: it has its own CRC-32."""
    buf = replay(True)
    buf.save(tmp_path / "ckpt")
    raw = (tmp_path / "ckpt").read_bytes()
    at, length = _header(raw)
    header = raw[at:at + length]
    target = replay(True, n_rows=12)
    before = snapshot(target)
    edited = header.replace(b'["beta", 0.4]', b'["beta", 0.9]')
    assert edited != header and len(edited) == len(header)
    (tmp_path / "bad").write_bytes(raw[:at] + edited + raw[at + length:])
    with pytest.raises(CheckpointError, match="the header fails its CRC-32"):
        target.load(tmp_path / "bad")
    assert_unchanged(target, before)


def test_a_header_pointing_past_its_tensor_table_is_a_checkpoint_error(tmp_path):
    import json
    import struct
    import zlib
    buf = history()
    buf.save(tmp_path / "ckpt")
    raw = (tmp_path / "ckpt").read_bytes()
    at, length = _header(raw)
    header = json.loads(raw[at:at + length])
    pairs = header["state"]["__dict__"]
    pairs[[k for k, _ in pairs].index("counts")][1] = {"__tensor__": 99}
    new = json.dumps(header).encode()
    footer = struct.pack("<QQI4x16s", at, len(new), zlib.crc32(new), raw[-16:])
    (tmp_path / "bad").write_bytes(raw[:at] + new + footer)
    with pytest.raises(CheckpointError, match="refers to a tensor it does not list"):
        HistoryBuffer(3, 5, 2, ("action",)).load(tmp_path / "bad")


def test_any_key_name_round_trips_through_a_checkpoint(tmp_path):
    buf = HistoryBuffer(2, 3, device="cpu")
    keys = ["__tensor__", "__dict__", "a b", "é"]
    buf.append({k: np.full((2, 1), i, np.int32) for i, k in enumerate(keys)})
    buf.save(tmp_path / "ckpt")
    other = HistoryBuffer(2, 3, device="cpu")
    other.load(tmp_path / "ckpt")
    assert other.keys == tuple(keys)
    assert all(torch.equal(other.get(1)[k], buf.get(1)[k]) for k in keys)


def test_a_checkpoint_gets_the_mode_open_would_give_it(tmp_path):
    buf = history()
    old = os.umask(0o022)
    try:
        buf.save(tmp_path / "ckpt")
        assert os.stat(tmp_path / "ckpt").st_mode & 0o777 == 0o644
        os.chmod(tmp_path / "ckpt", 0o600)
        buf.save(tmp_path / "ckpt")  # replacing a file keeps its mode
        assert os.stat(tmp_path / "ckpt").st_mode & 0o777 == 0o600
    finally:
        os.umask(old)


def test_a_corrupt_or_truncated_file_is_rejected_before_any_write(tmp_path):
    buf = replay(True)
    buf.save(tmp_path / "ckpt")
    raw = (tmp_path / "ckpt").read_bytes()
    target = replay(True, n_rows=12)
    before = snapshot(target)
    flipped = bytearray(raw)
    flipped[200] ^= 0xFF  # inside the first tensor's bytes
    for bad, why in ((raw[:-40], "footer"), (bytes(flipped), "CRC-32"), (b"hello" * 20, "magic"),
                     (raw[:100] + raw[100:][::-1], "footer")):
        (tmp_path / "bad").write_bytes(bad)
        with pytest.raises(CheckpointError, match=why):
            target.load(tmp_path / "bad")
        assert_unchanged(target, before)


SAVER = """
import sys, numpy as np
from gpubuf import HistoryBuffer
buf = HistoryBuffer(64, 16, device="cpu")
buf.append({{"pixels": np.full((64, 1, 256, 1024), 7, np.uint8)}})  # 256 MiB of storage
print("ready", flush=True)
buf.save({path!r})
print("saved", flush=True)
"""


def test_a_crash_mid_save_leaves_the_previous_checkpoint_intact(tmp_path):
    buf = history()
    buf.save(tmp_path / "ckpt")
    original = (tmp_path / "ckpt").read_bytes()
    proc = subprocess.Popen([sys.executable, "-c", SAVER.format(path=str(tmp_path / "ckpt"))],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    partial = None
    deadline = time.time() + 60
    while partial is None and time.time() < deadline:  # kill as soon as the new file is being written
        names = [n for n in os.listdir(tmp_path) if n.endswith(".partial")]
        if names and os.path.getsize(tmp_path / names[0]) > 2**20:
            partial = names[0]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert partial is not None, "the saver never started writing"
    assert os.path.getsize(tmp_path / partial) < 2**28, "killed after the write finished: nothing was tested"
    assert (tmp_path / "ckpt").read_bytes() == original  # the previous checkpoint, untouched
    other = HistoryBuffer(3, 5, 2, ("action",))
    other.load(tmp_path / "ckpt")
    assert_same_outputs(outputs(other), outputs(buf))


PEAK = """
import numpy as np
from gpubuf import HistoryBuffer

def rss():
    d = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(d["VmRSS"].split()[0]) * 1024, int(d["VmHWM"].split()[0]) * 1024

buf = HistoryBuffer(64, 16, device="cpu")
for t in range(16):
    buf.append({{"pixels": np.full((64, 1, 256, 1024), t, np.uint8)}})  # 256 MiB of storage, every page touched
ops = {{"save": lambda: buf.save({path!r}), "load": lambda: buf.load({path!r}),
        "load_own_state": lambda: buf.load_state_dict(buf.state_dict())}}
for op, run in ops.items():
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak
    now, _ = rss()
    run()
    print(op, rss()[1] - now)
"""


def test_save_and_load_stream_with_bounded_extra_memory(tmp_path):
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("the kernel does not let a process reset its peak RSS")
    out = subprocess.run([sys.executable, "-c", PEAK.format(path=str(tmp_path / "ckpt"))], check=True,
                         capture_output=True, text=True).stdout
    extra = {op: int(v) for op, v in (line.split() for line in out.splitlines())}
    assert set(extra) == {"save", "load", "load_own_state"}
    for op, grew in extra.items():  # storage is 256 MiB; a clone would add as much
        assert grew < 48 * 2**20, f"{op} grew the peak RSS by {grew / 2**20:.1f} MiB"
