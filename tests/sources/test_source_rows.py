"""EnvPoolSource's row convention on real EnvPool envs (classic control and Atari, terminated and truncated
episodes), checked row by row against a twin env stepped with the same seed and actions, on both backends.

The convention: a step's row holds the observation before the step, the executed action, the reward and the
env's ``terminated``; when EnvPool auto-resets (the step returns a reset frame, ``elapsed_step == 0``), that
step's row holds the episode's last observation with ``info["is_last"]``, ``truncated`` set, reward 0 and the
action fill; the next row holds the reset frame.
"""

import dataclasses

import numpy as np
import pytest
import torch
from extras import needs

from gpubuf import HistoryBuffer, PrioritizedTransitionBuffer, TransitionBuffer
from gpubuf.sources.envpool import EnvPoolSource, action_fill

envpool = needs("envpool")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TASKS = {  # task: (num_envs, steps, max_episode_steps) whose random episodes both terminate and truncate
    "CartPole-v1": (4, 60, 15),
    "Breakout-v5": (8, 152, 150),
}
BATCH = {"CartPole-v1": 96, "Breakout-v5": 40}  # windows per sample (Atari frames are gathered slowly when interpreted)


def make(task, num_envs, max_steps=None, batch_size=None, seed=0):
    kw = {} if max_steps is None else {"max_episode_steps": max_steps}
    return envpool.make(task, env_type="gymnasium", num_envs=num_envs, batch_size=batch_size or num_envs, seed=seed,
                        **kw)


def run(task, device, buffer_cls=TransitionBuffer, n_steps=4, seed=0, **kw):
    """Step a source with random actions; returns it, its buffer and EnvPool's raw outputs as the source received
    them: obs (K+1, E, ...), action, reward, terminated, truncated, elapsed (K+1, E) (index 0: the reset)."""
    E, K, max_steps = TASKS[task]
    src = EnvPoolSource(make(task, E, max_steps, seed=seed), device=device, info_keys=("elapsed_step",))
    buf = buffer_cls(E * (K + 8), 16, src.transition_sample(), n_steps=n_steps, device=device, seed=1, **kw)
    src.transitions = buf
    rng = np.random.default_rng(seed)
    log = {k: [] for k in ("obs", "action", "reward", "terminated", "truncated", "elapsed")}
    step, act = src.reset(), np.zeros(E, np.int64)
    for k in range(K + 1):
        if k:
            act = rng.integers(0, src.n_actions, E)
            step = src.step(act)
        for key, value in zip(log, (step.info[src.stager.obs_key], act, step.info["reward"], step.info["terminated"],
                                    step.info["truncated"], step.info["elapsed_step"]), strict=True):
            log[key].append(value[:, 0].cpu().numpy() if isinstance(value, torch.Tensor) else value)
        np.testing.assert_array_equal(step.first, log["elapsed"][-1] == 0)
    log = {k: np.stack(v) for k, v in log.items()}
    assert (log["terminated"].any() and log["truncated"].any()), "the run must end episodes both ways"
    return src, buf, log


def expected_rows(log, fill):
    """The rows the convention prescribes, (K, E, ...), from the twin's raw log."""
    first = log["elapsed"][1:] == 0  # step k + 1 returned a reset frame: its action was ignored
    return {
        "observation": log["obs"][:-1],
        "action": np.where(first, fill, log["action"][1:]),
        "reward": np.where(first, 0.0, log["reward"][1:]),
        "terminated": log["terminated"][1:] & ~first,
        "truncated": first,
        "is_last": first,
        "elapsed": log["elapsed"][:-1],
    }


@pytest.mark.parametrize("task", list(TASKS))
def test_rows_and_windows_follow_the_convention(backend, device, task):
    src, buf, log = run(task, device, n_steps=6)
    K = log["elapsed"].shape[0] - 1
    want = expected_rows(log, action_fill(src.action_dtype))
    data = buf.state_dict()["data"]
    got = {"observation": data["observation"], "action": data["action"], "reward": data["reward"],
           "terminated": data["terminated"], "truncated": data["truncated"], "is_last": data["info['is_last']"],
           "elapsed": data["info['elapsed_step']"]}
    for key, value in want.items():
        np.testing.assert_array_equal(got[key][:K].cpu().numpy(), value, err_msg=key)
    # every episode end (terminated or truncated) is followed by exactly one row holding its last observation
    np.testing.assert_array_equal((log["terminated"] | log["truncated"])[1:-1], want["is_last"][1:])

    # "mask": is_first exactly on the env's reset frames, the last observation inside its episode's mask
    interpreted = backend == "triton" and device == "cpu"  # Triton's interpreter: seconds per sample
    for with_replacement in (True,) if interpreted else (True, False):
        batch, idx = buf.sample(key=3, batch_size=BATCH[task], boundaries="mask", with_replacement=with_replacement,
                                return_indices=True)
        check_mask_windows(batch, idx, buf, want)

    # "forbid": no reset frame after a window's first row; with next observations, transitions only
    for with_next_obs in (True,) if interpreted else (False, True):
        batch, idx = buf.sample(key=4, batch_size=BATCH[task], boundaries="forbid", with_next_obs=with_next_obs,
                                return_indices=True)
        elapsed, last = batch.info["elapsed_step"].cpu().numpy(), batch.info["is_last"].cpu().numpy()
        assert not (elapsed[:, 1:] == 0).any() and not last[:, :-1].any()
        assert batch.mask.all() and batch.is_first[:, 0].all() and not batch.is_first[:, 1:].any()
        np.testing.assert_array_equal(batch.has_transition.cpu().numpy(), ~last)
        if with_next_obs:
            assert not last.any()
            env, row, _ = (t.cpu().numpy() for t in buf.locate(idx))
            nxt = batch.next_observation.cpu().numpy()
            frames = log["obs"][row[:, None] + np.arange(1, 7), env[:, None]]  # the frame each action led to
            np.testing.assert_array_equal(nxt, frames)  # terminal frames included


def check_mask_windows(batch, idx, buf, want):
    n = buf.n_steps
    elapsed = batch.info["elapsed_step"].cpu().numpy()
    is_first, mask = batch.is_first.cpu().numpy(), batch.mask.cpu().numpy()
    last = batch.info["is_last"].cpu().numpy()
    assert is_first[:, 0].all() and not last[:, 0].any()  # an is_last row never starts a window
    np.testing.assert_array_equal(is_first[:, 1:], elapsed[:, 1:] == 0)  # exactly the env's reset frames
    np.testing.assert_array_equal(mask, np.cumsum(is_first, 1) == 1)  # the start's episode ...
    assert (mask & last).any(), "no window held a last observation inside its mask"  # ... to its last frame
    assert (last[:, :-1] == is_first[:, 1:]).all()  # one last-observation row, then the reset frame
    np.testing.assert_array_equal(batch.has_transition.cpu().numpy(), ~last)  # a last observation: no transition
    env, row, step = (t.cpu().numpy() for t in buf.locate(idx))
    np.testing.assert_array_equal(step, row)  # no wrap: a row's number is its ring row
    rows = row[:, None] + np.arange(n)
    envs = np.broadcast_to(env[:, None], rows.shape)
    np.testing.assert_array_equal(batch.action.cpu().numpy(), want["action"][rows, envs])  # executed, or the fill


def test_prioritized_mask_windows_mark_exactly_the_reset_frames(backend, device):
    src, buf, log = run("CartPole-v1", device, PrioritizedTransitionBuffer, n_steps=6)
    want = expected_rows(log, action_fill(src.action_dtype))
    for with_replacement in (False,) if backend == "triton" and device == "cpu" else (True, False):
        batch, idx = buf.sample(key=3, batch_size=64, boundaries="mask", with_replacement=with_replacement)
        check_mask_windows(batch, idx, buf, want)


def test_single_row_windows_never_start_at_a_last_observation(device):
    src, buf, _ = run("CartPole-v1", device, n_steps=1)
    for boundaries in ("allow", "mask", "forbid"):
        batch = buf.sample(key=5, batch_size=400, boundaries=boundaries)
        assert not batch.info["is_last"].any()
    n_last = int(buf.state_dict()["data"]["info['is_last']"].sum())
    left = buf.num_valid()
    assert left == len(buf) - n_last  # every held row starts a window, but a last observation
    batch = buf.sample(key=6, batch_size=left, with_replacement=False)  # every start that is not a last observation
    assert not batch.info["is_last"].any()
    with pytest.raises(ValueError, match=f"batch_size: {left + 1} exceeds the {left} valid starts"):
        buf.sample(batch_size=left + 1, with_replacement=False)


def stepped_once(E: int, n_steps: int, device):
    """``(source, buffer, step)``: a CartPole source storing ``elapsed_step`` into an attached vectorized buffer, reset
    and stepped once (action 1)."""
    src = EnvPoolSource(make("CartPole-v1", E), device=device, info_keys=("elapsed_step",))
    buf = TransitionBuffer(E * 32, 4, src.transition_sample(), n_steps=n_steps, device=device)
    src.transitions = buf
    src.reset()
    return src, buf, src.step(np.ones(E, np.int64))


def test_a_reset_after_rows_ends_every_episode_with_its_last_observation(device):
    E = 3
    src, buf, step = stepped_once(E, 3, device)
    src.reset()
    src.step(np.zeros(E, np.int64))
    data = buf.state_dict()["data"]
    assert len(buf) == 3 * E
    assert data["info['is_last']"][:3].tolist() == [[False] * E, [True] * E, [False] * E]
    assert (data["info['elapsed_step']"][:3] == torch.tensor([[0], [1], [0]])).all()
    torch.testing.assert_close(data["observation"][1], step.info["observation"][:, 0].to(data["observation"].device))
    assert (data["action"][1] == -1).all() and data["truncated"][1].all() and not data["terminated"][1].any()
    src.reset()
    assert len(buf) == 4 * E and data["info['is_last']"][3].all()
    src.reset()  # no step since the last reset: no episode to end
    assert len(buf) == 4 * E


# ------------------------------------------------------------------ executed actions


def test_continuous_actions_are_stored_as_the_env_executes_them(device):
    hist = HistoryBuffer(2, 8, device=device)
    src = EnvPoolSource(make("Pendulum-v1", 2), device=device, history=hist)
    buf = TransitionBuffer(2 * 16, 2, src.transition_sample(), device=device)
    src.transitions = buf
    twin = make("Pendulum-v1", 2)
    src.reset()
    twin.reset()
    for sent, executed in (([5.0, -7.0], [2.0, -2.0]), ([1.5, -2.0], [1.5, -2.0]), ([1e30, 0.25], [2.0, 0.25])):
        step = src.step(np.array(sent, np.float32)[:, None])
        obs, *_ = twin.step(np.array(executed, np.float32)[:, None])
        np.testing.assert_array_equal(step.info["observation"][:, 0].cpu().numpy(), obs)  # what 2.0 does
        np.testing.assert_array_equal(step.info["action"][:, 0, 0].cpu().numpy(), executed)
    echo = hist.get(4)["action"][:, :, 0].cpu().numpy()  # (2, 4): the reset frame's NaN, then what was executed
    np.testing.assert_array_equal(echo, [[np.nan, 2.0, 1.5, 2.0], [np.nan, -2.0, -2.0, 0.25]])
    stored = buf.state_dict()["data"]["action"][:2, :, 0].cpu().numpy()  # rows of the first two steps
    np.testing.assert_array_equal(stored, [[2.0, -2.0], [1.5, -2.0]])


# ------------------------------------------------------------------ extra data and info fields


def breakout_source(device, tmp_path=None, **kw):
    src = EnvPoolSource(make("Breakout-v5", 2), obs_key="pixels", device=device, info_keys=("elapsed_step", "lives"))
    sample = src.transition_sample(extra={"logp": np.float32(0), "t": np.zeros(2, np.int64)})
    buf = TransitionBuffer(2 * 16, 4, sample, n_steps=2, device=device, seed=0, **kw)
    src.transitions = buf
    return src, buf


def test_extra_leaves_and_info_fields_round_trip(device, tmp_path):
    src, buf = breakout_source(device, storage_dir=tmp_path / "dir")
    src.reset()
    for k in range(6):
        extra = {"logp": torch.full((2,), -0.5 * k), "t": np.stack([[k, 10 * k], [k + 1, 0]])}
        src.step(np.array([1, 3]), extra=extra)
    data = buf.state_dict()["data"]
    np.testing.assert_array_equal(data["info['logp']"][:6, 0].cpu().numpy(), -0.5 * np.arange(6))
    np.testing.assert_array_equal(data["info['t']"][:6, 1].cpu().numpy(), np.stack([np.arange(1, 7), [0] * 6], 1))
    np.testing.assert_array_equal(data["info['elapsed_step']"][:6, 0].cpu().numpy(), np.arange(6))
    assert (data["info['lives']"][:6] == 5).all() and data["info['lives']"].dtype == torch.int32
    batch, idx = buf.sample(key=1, batch_size=8, return_indices=True)
    assert batch.info["t"].shape == (8, 2, 2) and batch.info["logp"].dtype == torch.float32
    _, row, _ = buf.locate(idx)
    np.testing.assert_array_equal(batch.info["logp"][:, 0].cpu().numpy(), -0.5 * row.cpu().numpy())
    state = {k: v.clone() for k, v in buf.state_dict()["data"].items()}
    # a checkpoint restores every leaf
    path = tmp_path / "b.ckpt"
    buf.save(path)
    _, other = breakout_source(device)
    other.load(path)
    for key, value in other.state_dict()["data"].items():
        assert torch.equal(value.cpu(), state[key].cpu()), key
    again = other.sample(key=1, batch_size=8)
    for key in ("logp", "t", "lives", "elapsed_step", "is_last"):
        assert torch.equal(again.info[key], batch.info[key]), key
    # the storage directory re-opens with them
    buf.flush()
    if hasattr(buf, "close"):
        buf.close()
    del buf
    _, reopened = breakout_source(device, storage_dir=tmp_path / "dir")
    for key, value in reopened.state_dict()["data"].items():
        assert torch.equal(value.cpu(), state[key].cpu()), key


def test_extra_leaves_ride_along_in_async_transitions(device):
    """Each env's extra data is stored with the transition of the action it was sent with."""
    src = EnvPoolSource(make("CartPole-v1", 4, batch_size=2), device=device, info_keys=("elapsed_step",))
    sample = src.transition_sample(vectorized=False, extra={"env": np.int64(0), "k": np.int64(0)})
    buf = TransitionBuffer(64, 4, sample, vectorized_env=False, device=device)
    src.transitions = buf
    step = src.reset()
    sent, stored = {}, []
    for k in range(12):
        ids = step.env_ids
        src.send(np.ones(len(ids), np.int64), ids, extra={"env": ids, "k": np.full(len(ids), k)})
        sent.update({int(e): k for e in ids})
        step = src.recv()
        stored += [(int(e), sent[int(e)]) for e in step.env_ids[~step.first]]
    data = buf.state_dict()["data"]
    got = list(zip(data["info['env']"][:len(buf)].tolist(), data["info['k']"][:len(buf)].tolist(), strict=True))
    assert got == stored and len(got) > 10


def test_bad_extra_is_rejected_before_anything_is_sent_or_written(device):
    src, buf = breakout_source(device)
    hist = HistoryBuffer(2, 4, device=device)
    src.history = hist
    twin = make("Breakout-v5", 2)
    src.reset()
    twin.reset()
    good = {"logp": np.zeros(2, np.float32), "t": np.zeros((2, 2), np.int64)}
    src.step(np.array([1, 1]), extra=good)
    twin.step(np.array([1, 1], np.int32))
    rows, counts = len(buf), hist.num_strided()
    cases = [
        (None, ValueError, r"extra: expected the keys of the transitions buffer's own info leaves \['logp', 't'\]"),
        ({"logp": good["logp"]}, ValueError, r"got \['logp'\]"),
        ({**good, "x": good["logp"]}, ValueError, r"got \['logp', 't', 'x'\]"),
        ({**good, "logp": np.zeros(3, np.float32)}, ValueError, r"extra\['logp'\]: expected shape \(2,\), got \(3,\)"),
        ({**good, "t": np.zeros((2, 2), np.float32)}, TypeError, r"extra\['t'\]: cannot store torch.float32"),
        ({**good, "logp": np.full(2, 1e300)}, TypeError, r"extra\['logp'\]: cannot store torch.float64"),
        ([1, 2], TypeError, "extra: expected a dict of per-env arrays, got list"),
    ]
    for extra, exc, message in cases:
        with pytest.raises(exc, match=message):
            src.step(np.array([2, 2]), extra=extra)
        assert len(buf) == rows and hist.num_strided() == counts
    step = src.step(np.array([3, 0]), extra=good)
    obs, *_ = twin.step(np.array([3, 0], np.int32))
    np.testing.assert_array_equal(step.info["pixels"][:, 0].cpu().numpy(), obs)  # nothing was sent meanwhile
    plain = EnvPoolSource(make("CartPole-v1", 2), device=device)
    plain.reset()
    with pytest.raises(ValueError, match=r"extra: expected the keys of a transitions buffer built from "
                                         r"transition_sample\(extra=...\) \[\], got \['a'\]"):
        plain.step(np.zeros(2, np.int64), extra={"a": np.zeros(2)})


@pytest.mark.parametrize("info_keys, exc, message", [
    ("lives", TypeError, "info_keys: expected a tuple of EnvPool info field names"),
    (("nope",), ValueError, r"info_keys: 'nope' is not one of this env's fields \[.*'lives'"),
    (("lives", "lives"), ValueError, "info_keys: 'lives' is listed twice"),
    (("is_last",), ValueError, "info_keys: expected field names other than"),
    (("pixels",), ValueError, "info_keys: expected field names other than"),
    ((3,), ValueError, "info_keys: expected field names other than"),
])
def test_bad_info_keys_are_rejected(info_keys, exc, message):
    with pytest.raises(exc, match=message):
        EnvPoolSource(make("Breakout-v5", 1), obs_key="pixels", info_keys=info_keys)


def test_bad_extra_examples_are_rejected():
    src = EnvPoolSource(make("CartPole-v1", 1), info_keys=("elapsed_step",))
    with pytest.raises(ValueError, match="extra: expected names other than"):
        src.transition_sample(extra={"elapsed_step": 0})
    with pytest.raises(ValueError, match="extra: expected names other than"):
        src.transition_sample(extra={"is_last": False})
    with pytest.raises(TypeError, match="extra: expected a dict of example values, got list"):
        src.transition_sample(extra=[0])


# ------------------------------------------------------------------ attaching the transitions buffer


def _sample(src, vectorized=True, **changes):
    """``src.transition_sample(vectorized)`` with some leaves replaced (``info_<key>`` for an info leaf)."""
    sample = src.transition_sample(vectorized)
    info = {**sample.info, **{k[5:]: v for k, v in changes.items() if k.startswith("info_")}}
    return dataclasses.replace(sample, info=info, **{k: v for k, v in changes.items() if not k.startswith("info_")})


@pytest.mark.parametrize("vectorized, change, message", [
    (True, lambda s: _sample(EnvPoolSource(make("CartPole-v1", 2))),
     r"transitions: the buffer has no leaf info\['elapsed_step'\]"),
    (True, lambda s: _sample(s, observation=torch.zeros(1, 2, 4, dtype=torch.float64)),
     r"transitions: leaf observation is torch.float64 \(4,\) per row, this source's rows hold torch.float32 \(4,\)"),
    (True, lambda s: _sample(s, info_elapsed_step=torch.zeros(1, 2, dtype=torch.int64)),
     r"transitions: leaf info\['elapsed_step'\] is torch.int64 \(\) per row, this source's rows hold torch.int32"),
    (True, lambda s: _sample(EnvPoolSource(make("Acrobot-v1", 2), info_keys=("elapsed_step",))),
     r"transitions: leaf observation is torch.float32 \(6,\) per row, this source's rows hold torch.float32 \(4,\)"),
    (True, lambda s: _sample(s, next_observation=torch.zeros(1, 2, 4)),
     r"transitions: the buffer has a leaf next_observation, which this source's rows do not hold"),
    (True, lambda s: _sample(EnvPoolSource(make("CartPole-v1", 3), info_keys=("elapsed_step",))),
     "transitions: expected a TransitionBuffer over 2 envs"),
    (False, lambda s: _sample(s, False, info_is_last=torch.zeros(1, dtype=torch.bool)),
     r"transitions: the buffer has a leaf info\['is_last'\], which this source's rows do not hold"),
    (False, lambda s: _sample(s, False, next_observation=None),
     r"transitions: the buffer has no leaf next_observation"),
])
def test_a_buffer_unlike_the_rows_is_rejected_before_anything_steps(device, vectorized, change, message):
    """At construction and on attaching, a ValueError names the leaf; the env, the history and the source's state
    are left as they were (it keeps stepping, and a matching buffer attached then stores every row)."""
    src = EnvPoolSource(make("CartPole-v1", 2), device=device, info_keys=("elapsed_step",))
    sample = change(src)
    buf = TransitionBuffer(64, 4, sample, vectorized_env=vectorized, device=device)
    hist = HistoryBuffer(2, 8, device=device)
    with pytest.raises(ValueError, match=message):
        EnvPoolSource(make("CartPole-v1", 2), device=device, info_keys=("elapsed_step",), transitions=buf)
    src.history = hist
    twin = make("CartPole-v1", 2)
    src.reset()
    twin.reset()
    src.step(np.ones(2, np.int64))
    twin.step(np.ones(2, np.int32))
    with pytest.raises(ValueError, match=message):
        src.transitions = buf
    assert src.transitions is None and len(buf) == 0 and hist.num_strided() == [2, 2]
    step = src.step(np.zeros(2, np.int64))
    obs, *_ = twin.step(np.zeros(2, np.int32))
    np.testing.assert_array_equal(step.info["observation"][:, 0].cpu().numpy(), obs)  # nothing was sent meanwhile
    assert hist.num_strided() == [3, 3]
    good = TransitionBuffer(64, 4, src.transition_sample(vectorized), vectorized_env=vectorized, device=device)
    src.transitions = good
    src.step(np.zeros(2, np.int64))
    assert len(good) == 2  # the pending row: one transition per env


@pytest.mark.parametrize("vectorized", [True, False], ids=["vectorized", "rows"])
@pytest.mark.parametrize("attach_after", [0, 3], ids=["after_reset", "mid_run"])
def test_a_buffer_attached_later_stores_the_pending_row(device, vectorized, attach_after):
    """A buffer attached after ``reset()`` (or after some steps) stores exactly the rows of one attached from the
    start from that point on: its first row is the observation the source already returned, and ``locate``
    numbers it 0."""
    E, K, kw = 2, 14, {"info_keys": ("elapsed_step",)}
    early = EnvPoolSource(make("CartPole-v1", E, max_steps=5), device=device, **kw)
    late = EnvPoolSource(make("CartPole-v1", E, max_steps=5), device=device, **kw)
    full, part = (TransitionBuffer(E * 32, 4, s.transition_sample(vectorized), vectorized_env=vectorized,
                                   device=device) for s in (early, late))
    early.transitions = full
    early.reset()
    late.reset()
    rng = np.random.default_rng(3)
    first_rows = None
    for k in range(K):
        if k == attach_after:
            first_rows = len(full)
            late.transitions = part
        act = rng.integers(0, 2, E)
        early.step(act)
        late.step(act)
    assert len(part) == len(full) - first_rows > 0
    a, b = full.state_dict()["data"], part.state_dict()["data"]
    R = len(part) // E if vectorized else len(part)
    start = first_rows // E if vectorized else first_rows
    for key in a:
        torch.testing.assert_close(b[key][:R], a[key][start:start + R], equal_nan=True, msg=key)
    if vectorized:
        assert (b["info['elapsed_step']"][0].cpu() == attach_after).all()  # the pending observation
        batch, idx = part.sample(key=0, batch_size=part.num_valid(), with_replacement=False, return_indices=True)
        _, _, step = part.locate(idx)  # row `step` shows the env after attach_after + step steps (episodes of 6 rows)
        assert ((step.cpu() + attach_after) % 6 == batch.info["elapsed_step"].cpu()).all()


def test_detaching_ends_the_episodes_so_re_attaching_never_joins_two_stretches(device):
    E = 2
    src, buf, step = stepped_once(E, 2, device)
    src.transitions = None  # the pending observation ends each episode
    assert len(buf) == 2 * E
    src.step(np.zeros(E, np.int64))
    src.transitions = buf
    src.transitions = buf  # attaching it again changes nothing
    src.step(np.zeros(E, np.int64))
    data = buf.state_dict()["data"]
    assert len(buf) == 3 * E
    assert data["info['is_last']"][:3].tolist() == [[False] * E, [True] * E, [False] * E]
    assert data["info['elapsed_step']"][:3].tolist() == [[0] * E, [1] * E, [2] * E]
    torch.testing.assert_close(data["observation"][1], step.info["observation"][:, 0].to(data["observation"].device))
    assert (data["action"][1] == -1).all() and data["truncated"][1].all()
    batch = buf.sample(key=0, batch_size=buf.num_valid(boundaries="mask"), with_replacement=False, boundaries="mask")
    assert not batch.info["is_last"][:, 0].any()  # no window starts at the end of the first stretch
