"""TensorSource(capturable=True): a simulator step written with no host read.

It stores and returns what the eager source does (same rows, same Step values), checks values on the device (a step
that fails a check writes nothing and keeps the pending observations; the failure is raised once), and the loop of a
GPU simulator (simulator step -> source step -> sample -> loss -> priority update) traces whole under
``torch.compile(fullgraph=True)``, equal to the eager loop, for uniform and prioritized buffers, vector and pixel
observations.
"""

import copy

import gymnasium as gym
import numpy as np
import pytest
import torch
from torch_sim import E, M, TorchSim, assert_compiled_matches_eager, assert_same_buffers

from gpubuf import HistoryBuffer, PrioritizedTransitionBuffer, TensorSource, TransitionBuffer

pytestmark = pytest.mark.usefixtures("host_loops")

BOX = gym.spaces.Box(-0.5, 0.5, (2,), np.float32)
DISCRETE = gym.spaces.Discrete(3)


def obs_space(pixels):
    return gym.spaces.Box(0, 255, (3, 6, 6), np.uint8) if pixels else gym.spaces.Box(-10, 10, (2,), np.float32)


def make(capturable, prioritized=True, pixels=False, actions=BOX, device="cpu", **buf_kw):
    """``(source, buffer, simulator)``, reset; the source appends to a history too (``source.history``)."""
    src = TensorSource(E, obs_space(pixels), actions, final_obs=False, capturable=capturable, device=device,
                       history=HistoryBuffer(E, 6, 2, ("action",), device=device))
    cls = PrioritizedTransitionBuffer if prioritized else TransitionBuffer
    buf = cls(E * M, 4, src.transition_sample(), seed=0, device=device, **buf_kw)
    src.transitions = buf
    sim = TorchSim(pixels, device)
    src.reset(sim.obs())
    return src, buf, sim


def policy_step(src, sim, actions=BOX):
    """One loop step: the policy's actions (out of the box sometimes: the source clips them), the simulator, the
    source."""
    obs = sim.obs().float().reshape(E, -1)[:, :2]
    if actions is BOX:
        act = torch.tanh(obs @ torch.tensor([[0.9, -0.4], [0.3, 0.8]], device=obs.device))
        executed = act.clamp(-0.5, 0.5)
    else:
        act = (obs[:, 0] * 7).long().remainder(3)
        executed = torch.stack([act * 0.1, -act * 0.1], 1).float()
    r, te, tr = sim.step(executed)
    return src.step(act, sim.obs(), r, te, tr)


def assert_same_steps(a, b):
    for k in a.info:
        torch.testing.assert_close(a.info[k], b.info[k], rtol=0, atol=0, equal_nan=True)
    assert np.array_equal(a.env_ids, b.env_ids)
    assert np.array_equal(a.first, b.first.cpu().numpy())


@pytest.mark.parametrize("prioritized", [False, True])
@pytest.mark.parametrize("pixels", [False, True])
@pytest.mark.parametrize("actions", [BOX, DISCRETE], ids=["box", "discrete"])
def test_a_capturable_source_writes_and_returns_what_the_eager_one_does(prioritized, pixels, actions):
    a, ba, sa = make(False, prioritized, pixels, actions, n_steps=2)
    b, bb, sb = make(True, prioritized, pixels, actions, n_steps=2)
    for t in range(40):  # the 16-row ring wraps, episodes end every few steps
        assert_same_steps(policy_step(a, sa, actions), policy_step(b, sb, actions))
        if t == 20:  # a reset mid-run ends the episodes the same way
            a.reset(sa.obs())
            b.reset(sb.obs())
        if t % 9 == 0:
            assert_same_histories(a.history, b.history)
    assert_same_buffers(ba, bb)
    assert_same_histories(a.history, b.history)


def assert_same_histories(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert torch.equal(sa["counts"], sb["counts"]) and torch.equal(sa["heads"], sb["heads"])
    for key in sa["data"]:
        torch.testing.assert_close(sa["data"][key], sb["data"][key], rtol=0, atol=0, equal_nan=True)
    for n in (1, 3):
        ga, gb = a.get(n), b.get(n)
        assert (ga is None) == (gb is None)
        for key in ga or ():
            torch.testing.assert_close(ga[key], gb[key], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("bad, words", [
    ("nan action", None),
    ("discrete out of range", None),
    ("flag not 0/1", None),
    ("reward overflows float32", None),
    ("wrong obs shape", "obs: expected a dense tensor shaped"),
    ("numpy reward", "reward: expected a dense tensor"),
    ("float flags", "terminated: expected bools"),
    ("final_obs given", "final_obs, infos, extra"),
])
def test_a_bad_step_writes_nothing(bad, words):
    discrete = bad == "discrete out of range"
    src, buf, sim = make(True, actions=DISCRETE if discrete else BOX)
    for _ in range(3):
        policy_step(src, sim, DISCRETE if discrete else BOX)
    before, pending = buf.state_dict(), src._rows.pending_obs.clone()  # noqa: SLF001 (the source's pending rows)
    history = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in src.history.state_dict().items()
               if k != "data"}
    act = torch.zeros(E, dtype=torch.int64) if discrete else torch.zeros(E, 2)
    obs, r, te, tr = sim.obs() + 1, torch.zeros(E), torch.zeros(E, dtype=torch.bool), torch.zeros(E, dtype=torch.bool)
    kw = {}
    if bad == "nan action":
        act[1, 0] = float("nan")
    elif discrete:
        act[2] = 3
    elif bad == "flag not 0/1":
        te = torch.tensor([0, 2, 1])
    elif bad == "reward overflows float32":
        r = torch.tensor([0.0, 1e300, 0.0], dtype=torch.float64)
    elif bad == "wrong obs shape":
        obs = obs[:, :1]
    elif bad == "numpy reward":
        r = r.numpy()
    elif bad == "float flags":
        te = te.float()
    else:
        kw = {"final_obs": obs}
    if words is None:
        src.step(act, obs, r, te, tr)
        with pytest.raises(ValueError, match="1 insert\\(s\\) since the last check wrote nothing"):
            len(buf)
        with pytest.raises(ValueError, match="1 append\\(s\\) since the last check wrote nothing"):
            src.history.get(1)
    else:
        with pytest.raises((ValueError, TypeError), match=words):
            src.step(act, obs, r, te, tr, **kw)
    after = buf.state_dict()
    assert after["count"] == before["count"] and torch.equal(after["data"]["reward"], before["data"]["reward"])
    assert torch.equal(src._rows.pending_obs, pending)  # noqa: SLF001
    now = src.history.state_dict()
    assert torch.equal(now["counts"], history["counts"]) and torch.equal(now["heads"], history["heads"])


def test_a_step_the_history_refuses_writes_nothing_anywhere():
    """The reset fixed the history's observations as int64: a float step is refused before any write (as the eager
    source refuses it)."""
    src = TensorSource(E, obs_space(False), BOX, final_obs=False, capturable=True,
                       history=HistoryBuffer(E, 4, device="cpu"))
    src.transitions = PrioritizedTransitionBuffer(E * M, 4, src.transition_sample(), seed=0)
    src.reset(torch.zeros(E, 2, dtype=torch.int64))
    with pytest.raises(TypeError, match="observation: cannot store torch.float32"):
        src.step(torch.zeros(E, 2), torch.full((E, 2), 0.25), torch.zeros(E), torch.zeros(E, dtype=torch.bool),
                 torch.zeros(E, dtype=torch.bool))
    assert len(src.transitions) == 0 and src.history.num_strided() == [1] * E
    assert torch.equal(src._rows.pending_obs, torch.zeros(E, 2))  # noqa: SLF001


@pytest.mark.parametrize("capturable", [False, True])
def test_integer_reset_frames_do_not_truncate_later_float_observations(capturable):
    src = TensorSource(E, obs_space(False), BOX, final_obs=False, capturable=capturable)
    buf = TransitionBuffer(E * M, 4, src.transition_sample(), seed=0)
    src.transitions = buf
    src.reset(torch.zeros(E, 2, dtype=torch.int64))
    for t in range(3):
        src.step(torch.zeros(E, 2), torch.full((E, 2), t + 0.25), torch.zeros(E), torch.zeros(E, dtype=torch.bool),
                 torch.zeros(E, dtype=torch.bool))
    assert buf.state_dict()["data"]["observation"][1:3, 0, 0].tolist() == [0.25, 1.25]


def test_a_sparse_observation_is_refused_before_any_write():
    src, buf, sim = make(True)
    before = len(buf)
    with pytest.raises(ValueError, match="obs: expected a dense tensor"):
        src.step(torch.zeros(E, 2), sim.obs().to_sparse(), torch.zeros(E), torch.zeros(E, dtype=torch.bool),
                 torch.zeros(E, dtype=torch.bool))
    assert len(buf) == before


def test_inputs_that_require_grad_are_stored_detached_and_steps_keep_the_eager_dtypes():
    a, ba, sa = make(False)
    b, bb, sb = make(True)
    w = torch.ones((), requires_grad=True)
    for source, sim in ((a, sa), (b, sb)):
        obs = sim.obs().double()
        step = source.step(torch.zeros(E, 2), obs * w, torch.zeros(E) * w, torch.zeros(E, dtype=torch.bool),
                           torch.zeros(E, dtype=torch.bool))
        assert step.info["observation"].dtype == torch.float64
    assert not any(t.requires_grad for t in bb.state_dict()["data"].values())
    assert not any(t.requires_grad for t in b.history.state_dict()["data"].values())
    assert_same_buffers(ba, bb)


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64, torch.int8])
def test_discrete_actions_of_any_integer_dtype(dtype):
    a, ba, sa = make(False, actions=DISCRETE)
    b, bb, sb = make(True, actions=DISCRETE)
    for source, sim in ((a, sa), (b, sb)):
        source.step(torch.tensor([0, 2, 1], dtype=dtype), sim.obs(), torch.zeros(E),
                    torch.zeros(E, dtype=torch.bool), torch.zeros(E, dtype=torch.bool))
    assert_same_buffers(ba, bb)
    b.step(torch.tensor([0, 3, 1], dtype=dtype), sb.obs(), torch.zeros(E), torch.zeros(E, dtype=torch.bool),
           torch.zeros(E, dtype=torch.bool))
    with pytest.raises(ValueError, match="wrote nothing"):
        len(bb)


def test_what_a_capturable_source_refuses():
    with pytest.raises(ValueError, match="final_obs: a capturable TensorSource"):
        TensorSource(E, obs_space(False), BOX, final_obs=True, capturable=True)
    with pytest.raises(ValueError, match="info_keys: a capturable TensorSource"):
        TensorSource(E, obs_space(False), BOX, final_obs=False, capturable=True, info_keys={"x": np.float32(0)})
    src, buf, sim = make(True)
    src.transitions = TransitionBuffer(E * M, 4, src.transition_sample(), seed=0)  # attached after the reset
    with pytest.raises(RuntimeError, match="reset\\(\\) again"):
        policy_step(src, sim)


@pytest.mark.parametrize("prioritized, pixels, gs_kw", [
    (False, False, {"with_next_obs": True}),
    (True, False, {"with_next_obs": True}),
    (True, True, {"frame_stack": 3, "n_step_return": (3, 0.9)}),
    (False, True, {"minibatches": 2, "boundaries": "forbid"}),
], ids=["uniform vector", "per vector", "per pixels stacks returns", "uniform pixels minibatches"])
def test_the_loop_with_the_source_traces_whole_and_matches_the_eager_loop(prioritized, pixels, gs_kw):
    torch._dynamo.reset()  # noqa: SLF001

    def build():
        src, buf, sim = make(True, prioritized, pixels)
        for _ in range(5):
            policy_step(src, sim)
        gs = buf.graph_sampler(batch_size=4, **gs_kw)

        def step():
            s = policy_step(src, sim)
            out, idx = gs.sample()
            td = out.reward.float().reshape(*idx.shape, -1)[..., 0] - 0.01 * s.info["reward"].mean()
            if prioritized:
                gs.update_priorities(idx, td.detach())
            return (td**2).mean(), idx.clone()

        return buf, step

    eager_buf, eager = build()
    buf, step = build()
    explanation = torch._dynamo.explain(build()[1])()  # noqa: SLF001
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert_compiled_matches_eager(torch.compile(step, backend="eager", fullgraph=True), eager, 40)
    assert_same_buffers(buf, eager_buf)


@pytest.mark.cuda
def test_a_capturable_source_step_never_syncs():
    src, buf, sim = make(True, device="cuda")
    plain = copy.deepcopy(buf)
    for _ in range(3):
        policy_step(src, sim)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            policy_step(src, sim)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(buf) == 8 * E and len(plain) == 0
