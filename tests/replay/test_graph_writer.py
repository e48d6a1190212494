"""GraphWriter: inserts with the bookkeeping on the device, and the whole step as one graph.

A graph writer's insert writes what ``buffer.insert`` writes (rows, flags, counters, priorities, validity, marks) with
device ops only; the host's copy catches up at the buffer's next eager call. The whole step of a GPU-simulator loop
(simulator step with same-step resets -> insert -> sample -> loss -> priority update) traces under
``torch.compile(fullgraph=True)`` with no graph break and no recompile across ring wraps and episode ends, and computes
what the eager step computes; a buffer filled by ``buffer.insert`` with the same rows and updates ends equal.
"""

import copy
import os
import pickle
import threading

import numpy as np
import pytest
import torch
from fixtures import make_transition
from torch_sim import E, M, TorchSim, assert_compiled_matches_eager, assert_same_buffers

from gpubuf import PrioritizedTransitionBuffer, RateLimiter, Transition, TransitionBuffer, Unit
from gpubuf._core.inputs import cast_keeps_values, check_cast, lossless
from gpubuf.replay.sampling.selectors import Recency

pytestmark = pytest.mark.usefixtures("host_loops")  # with the compiled host loops and with the torch twins



def rows_with_ends(g0, T, vectorized=True, last=False):
    """T rows from global step g0: truncations and terminations at some steps, is_last rows when ``last``."""
    e = E if vectorized else 1
    tr = make_transition(g0, T, e, trunc_steps=[s for s in range(g0, g0 + T) if s % 7 == 3], vectorized=vectorized)
    steps = torch.arange(g0, g0 + T)
    term = (steps % 5 == 1)
    tr.terminated = term[:, None].expand(T, e).clone() if vectorized else term.clone()
    if vectorized:
        tr.terminated[:, 0] = False  # envs differ
    if last:
        is_last = steps % 6 == 4
        tr.info = {**tr.info, "is_last": is_last[:, None].expand(T, e).clone() if vectorized else is_last.clone()}
    return tr


@pytest.mark.parametrize("prioritized", [False, True])
@pytest.mark.parametrize("n_steps", [1, 3])
@pytest.mark.parametrize("layout", ["vectorized", "single", "is_last"])
def test_graph_inserts_write_what_insert_writes(prioritized, n_steps, layout):
    vec, last = layout != "single", layout == "is_last"
    cls = PrioritizedTransitionBuffer if prioritized else TransitionBuffer
    e = E if vec else 1
    sample = rows_with_ends(0, 1, vec, last)
    a, b = (cls(e * M, 4, sample, vectorized_env=vec, n_steps=n_steps, seed=0) for _ in range(2))
    if prioritized:  # new rows take a raised max_priority
        for buf in (a, b):
            buf.insert(rows_with_ends(0, 2, vec, last))
            buf.update_priorities([0, 1], [3.0, 0.5])
    w = b.graph_writer()
    g = 2
    for t in range(25):  # 1-3 rows per insert: the 16-row ring wraps about four times
        T = 1 + t % 3
        rows = rows_with_ends(g, T, vec, last)
        a.insert(rows)
        w.insert(rows)
        g += T
        if t % 6 == 5:
            assert_same_buffers(a, b)
    assert_same_buffers(a, b)
    ba, bb = (x.sample(batch_size=8, unit=Unit.window(), key=3) for x in (a, b))
    assert torch.equal(ba.indices, bb.indices) and torch.equal(ba.observation, bb.observation)


def test_eager_inserts_between_graph_inserts_keep_both_copies_equal():
    a = PrioritizedTransitionBuffer(E * M, 4, rows_with_ends(0, 1), n_steps=2, seed=0)
    b = PrioritizedTransitionBuffer(E * M, 4, rows_with_ends(0, 1), n_steps=2, seed=0)
    w = b.graph_writer()
    for t in range(12):
        rows = rows_with_ends(2 * t, 2)
        a.insert(rows)
        (w.insert if t % 3 else b.insert)(rows)
        if t % 4 == 1:
            idx = torch.tensor([t, t + 5])
            a.update_priorities(idx, torch.tensor([2.0, 0.1 * t]))
            b.update_priorities(idx, torch.tensor([2.0, 0.1 * t]))
    assert_same_buffers(a, b)


def test_state_copies_and_loads_after_graph_inserts():
    b = PrioritizedTransitionBuffer(E * M, 4, rows_with_ends(0, 1), n_steps=2, seed=0)
    w = b.graph_writer()
    for t in range(10):
        w.insert(rows_with_ends(3 * t, 3))
    for c in (copy.deepcopy(b), pickle.loads(pickle.dumps(b))):
        assert_same_buffers(b, c)
    fresh = PrioritizedTransitionBuffer(E * M, 4, rows_with_ends(0, 1), n_steps=2, seed=0)
    fresh.load_state_dict(b.state_dict())
    assert_same_buffers(b, fresh)
    b.load_state_dict(PrioritizedTransitionBuffer(E * M, 4, rows_with_ends(0, 1), n_steps=2).state_dict())
    assert len(b) == 0
    w.insert(rows_with_ends(0, 2))  # after a load, the device copy starts from the loaded state
    assert len(b) == 2 * E
    with pytest.raises(TypeError, match="cannot be copied"):
        copy.deepcopy(w)


def test_a_value_its_dtype_cannot_hold_writes_nothing_and_is_raised_once():
    buf = TransitionBuffer(E * M, 4, rows_with_ends(0, 1), seed=0)
    w = buf.graph_writer()
    w.insert(rows_with_ends(0, 2))
    before = buf.state_dict()
    bad = rows_with_ends(2, 2)
    bad.reward = bad.reward.to(torch.float64)
    bad.reward[1, 2] = 1e300  # beyond float32: refused by the device check
    w.insert(bad)
    ok = rows_with_ends(2, 2)
    ok.reward = ok.reward.to(torch.float64)  # in range: stored as buffer.insert stores it
    w.insert(ok)
    with pytest.raises(ValueError, match="1 insert\\(s\\) since the last check wrote nothing"):
        w.check()
    w.check()  # raised once
    after = buf.state_dict()
    assert after["count"] == before["count"] + 2
    ref = TransitionBuffer(E * M, 4, rows_with_ends(0, 1), seed=0)
    ref.insert(rows_with_ends(0, 2))
    ref.insert(rows_with_ends(2, 2))
    assert_same_buffers(buf, ref)
    w.insert(bad)
    with pytest.raises(ValueError, match="wrote nothing"):
        len(buf)  # the buffer's next eager call raises it too


@pytest.mark.parametrize("bad, error, words", [
    ("missing leaf", ValueError, "expected the leaves"),
    ("numpy leaf", ValueError, "reward: expected a tensor"),
    ("wrong shape", ValueError, "observation: expected shape"),
    ("rows differ", ValueError, "reward: expected shape \\(2,"),
    ("float into int", TypeError, "cannot store torch.float32 in the stored dtype torch.int64"),
    ("too many rows", ValueError, "1 <= T <= 16"),
])
def test_bad_inserts_raise_naming_the_leaf_and_write_nothing(bad, error, words):
    buf = TransitionBuffer(E * M, 4, rows_with_ends(0, 1), seed=0)
    w = buf.graph_writer()
    w.insert(rows_with_ends(0, 2))
    before = buf.state_dict()
    rows = rows_with_ends(2, 2)
    if bad == "missing leaf":
        rows.reward = None
    elif bad == "numpy leaf":
        rows.reward = rows.reward.numpy()
    elif bad == "wrong shape":
        rows.observation = rows.observation[..., :1]
    elif bad == "rows differ":
        rows.reward = rows_with_ends(2, 3).reward
    elif bad == "float into int":
        rows.info = {"step": rows.info["step"].float()}
    else:
        rows = rows_with_ends(2, M + 1)
    with pytest.raises(error, match=words):
        w.insert(rows)
    after = buf.state_dict()
    assert after["count"] == before["count"] and torch.equal(after["data"]["reward"], before["data"]["reward"])


@pytest.mark.parametrize("what", ["storage_dir", "rate_limiter", "selector"])
def test_a_buffer_that_decides_on_the_host_refuses_a_graph_writer(what, tmp_path):
    kw = {"storage_dir": tmp_path / "d"} if what == "storage_dir" else \
        {"rate_limiter": RateLimiter(1.0, 1, -10, 10)} if what == "rate_limiter" else \
        {"selector": Recency()}
    buf = TransitionBuffer(E * M, 4, rows_with_ends(0, 1), **kw)
    with pytest.raises(ValueError, match="buffer: a GraphWriter writes from device state only"):
        buf.graph_writer()
    buf.close()


@pytest.mark.parametrize("shape", ["column of a wider tensor", "expanded scalar", "a view of the storage"])
def test_inputs_of_any_layout_are_written_whole_as_insert_writes_them(shape):
    """A leaf with a size-1 dim of another stride, an expanded scalar, or a view of the rows being overwritten: what
    ``buffer.insert`` stores, and nothing half-written (every leaf is staged before any write)."""
    a, b = (TransitionBuffer(2 * 4, 4, make_transition(0, 1, 2), seed=0) for _ in range(2))
    w = b.graph_writer()
    for t in range(4):  # full: the next insert overwrites row 0
        a.insert(make_transition(t, 1, 2))
        w.insert(make_transition(t, 1, 2))
    rows = make_transition(9, 1, 2)
    if shape == "column of a wider tensor":
        rows.reward = torch.tensor([[7.0, 0.0, 8.0, 0.0]])[:, ::2]  # (1, 2), stride 2
    elif shape == "expanded scalar":
        rows.reward = torch.tensor(7.0).expand(1, 2)
    else:
        rows.observation = b.storage.data[("observation",)][1:2].clone()
        for buf in (a, b):  # the rows being overwritten are read by the leaf
            rows.reward = buf.storage.data[("reward",)][0:1]
            (buf.insert if buf is a else w.insert)(rows)
        assert_same_buffers(a, b)
        return
    a.insert(rows)
    w.insert(rows)
    assert_same_buffers(a, b)


@pytest.mark.parametrize("valid, words", [(torch.tensor([True]), "valid: expected a bool tensor shaped"),
                                          (True, "valid: expected"), (torch.tensor(1), "valid: expected")])
def test_a_bad_valid_flag_raises_naming_it_and_writes_nothing(valid, words):
    b = TransitionBuffer(E * M, 4, rows_with_ends(0, 1), seed=0)
    w = b.graph_writer()
    w.insert(rows_with_ends(0, 2))
    before = b.state_dict()["data"]["observation"].clone()
    with pytest.raises(ValueError, match=words):
        w.insert(rows_with_ends(2, 2), valid=valid)
    assert torch.equal(b.state_dict()["data"]["observation"], before) and len(b) == 2 * E


def test_a_sparse_leaf_is_refused_before_any_write():
    b = TransitionBuffer(E * M, 4, rows_with_ends(0, 1), seed=0)
    w = b.graph_writer()
    w.insert(rows_with_ends(0, 2))
    before = b.state_dict()["data"]["observation"].clone()
    rows = rows_with_ends(2, 2)
    rows.reward = rows.reward.to_sparse()
    with pytest.raises(ValueError, match="reward: expected a tensor"):
        w.insert(rows)
    assert torch.equal(b.state_dict()["data"]["observation"], before) and len(b) == 2 * E


def test_graph_sampler_calls_do_not_bring_the_host_up_to_date():
    b = PrioritizedTransitionBuffer(E * M, 4, rows_with_ends(0, 1), seed=0)
    w = b.graph_writer()
    w.insert(rows_with_ends(0, 3))
    gs = b.graph_sampler(4)
    w.insert(rows_with_ends(3, 2))
    _, idx = gs.sample()
    gs.update_priorities(idx, torch.ones(4))
    assert b.ring.total == 3  # behind until an eager call of the buffer
    assert len(b) == 5 * E and b.ring.total == 5


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_while_the_host_is_behind_sees_every_graph_insert():
    b = PrioritizedTransitionBuffer(E * M, 4, rows_with_ends(0, 1), n_steps=2, seed=0)
    w = b.graph_writer()
    for t in range(7):
        w.insert(rows_with_ends(2 * t, 2))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its host copy catches up from its own copy of the device state
        try:
            os.write(write, f"{len(b)},{b.num_valid(True, 'forbid')}".encode())
        finally:
            os._exit(0)
    os.close(write)
    got = os.read(read, 100).decode()
    os.waitpid(pid, 0)
    assert got == f"{len(b)},{b.num_valid(True, 'forbid')}" and len(b) == 14 * E


def test_two_threads_writing_through_graph_writers_lose_no_row():
    buf = TransitionBuffer(E * 64, 4, rows_with_ends(0, 1), seed=0)
    writers = [buf.graph_writer(), buf.graph_writer()]

    def run(w):
        for t in range(10):
            w.insert(rows_with_ends(t, 1))

    threads = [threading.Thread(target=run, args=(w,)) for w in writers]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(buf) == 20 * E and buf.ring.total == 20


CASTS = [(torch.float64, torch.float32, [0.5, -3e38, float("nan"), float("inf")]),
         (torch.float64, torch.float32, [1e39]),
         (torch.float32, torch.float16, [60000.0, -1.0]),
         (torch.float32, torch.float16, [70000.0]),
         (torch.float32, torch.float8_e4m3fn, [1.0, float("inf")]),
         (torch.int64, torch.int32, [-2**31, 2**31 - 1]),
         (torch.int64, torch.int32, [2**31]),
         (torch.int64, torch.uint8, [-1]),
         (torch.int32, torch.float32, [2**24, -2**24]),
         (torch.int32, torch.float32, [2**24 + 1]),
         (torch.int16, torch.bool, [0, 1]),
         (torch.int16, torch.bool, [2]),
         (torch.uint32, torch.int32, [5, 2**31 - 1]),
         (torch.uint32, torch.int32, [2**31]),
         (torch.uint16, torch.int8, [200]),
         (torch.uint64, torch.int64, [2**63 - 1]),
         (torch.uint64, torch.int64, [2**63]),
         (torch.uint64, torch.float64, [2**53 + 1])]


@pytest.mark.parametrize("src, dst, values", CASTS)
def test_the_device_cast_check_is_the_host_check(src, dst, values):
    t = torch.tensor(values, dtype=src)
    assert not lossless(src, dst)
    try:
        check_cast(t, dst, "x")
        host = True
    except TypeError:
        host = False
    assert bool(cast_keeps_values(t, dst)) == host


# ---------------------------------------------------------------------------------------------- the whole step


# name -> (prioritized, pixels, buffer kwargs, graph_sampler kwargs)
WHOLE = {
    "uniform vector": (False, False, {}, {}),
    "per vector windows": (True, False, {"n_steps": 3}, {"with_next_obs": True}),
    "per pixels stacks returns": (True, True, {}, {"frame_stack": 3, "n_step_return": (3, 0.9)}),
    "uniform pixels minibatches": (False, True, {"n_steps": 2}, {"minibatches": 2, "boundaries": "forbid"}),
}


def build_step(prioritized, pixels, buf_kw, gs_kw, device="cpu"):
    """``(buffer, step)``: the loop's step over a fresh simulator and buffer; ``step()`` returns the loss, the drawn
    starts, the rows inserted and the TD errors (so a plain buffer can replay them)."""
    sim = TorchSim(pixels, device)
    obs = sim.obs()
    zeros = torch.zeros(1, E, device=device)
    sample = Transition(observation=obs[None], action=zeros[..., None].expand(1, E, 2), reward=zeros,
                        terminated=zeros.bool(), truncated=zeros.bool())
    cls = PrioritizedTransitionBuffer if prioritized else TransitionBuffer
    buf = cls(E * M, 4, sample, seed=0, device=device, **buf_kw)
    writer = buf.graph_writer()
    policy = torch.tensor([[0.2, -0.1], [0.05, 0.3]], device=device)

    def step():
        obs = sim.obs()
        feat = obs.float().reshape(E, -1)[:, :2] / (100.0 if pixels else 1.0)
        action = torch.tanh(feat @ policy)
        reward, terminated, truncated = sim.step(action)
        rows = Transition(observation=obs[None], action=action[None], reward=reward[None],
                          terminated=terminated[None], truncated=truncated[None])
        writer.insert(rows)
        out, idx = gs.sample()
        x = out.observation.float().reshape(*idx.shape, -1).mean(-1)
        td = x * 0.01 + out.reward.float().reshape(*idx.shape, -1).mean(-1)
        if prioritized:
            gs.update_priorities(idx, td.detach())
        weights = out.PER_weights if prioritized else torch.ones_like(td)
        return (td**2 * weights).mean(), idx.clone(), rows, td.detach().clone()

    for _ in range(5):  # rows to draw from before the first sample
        obs = sim.obs()
        r, te, tr = sim.step(torch.zeros(E, 2, device=device))
        writer.insert(Transition(observation=obs[None], action=torch.zeros(1, E, 2, device=device), reward=r[None],
                                 terminated=te[None], truncated=tr[None]))
    gs = buf.graph_sampler(batch_size=4, **gs_kw)
    return buf, step


@pytest.mark.parametrize("name", list(WHOLE))
def test_the_whole_step_traces_as_one_graph_and_matches_the_eager_step(name):
    torch._dynamo.reset()
    eager_buf, eager = build_step(*WHOLE[name])
    buf, step = build_step(*WHOLE[name])
    explanation = torch._dynamo.explain(build_step(*WHOLE[name])[1])()
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    plain = copy.deepcopy(buf)  # filled by buffer.insert and buffer.update_priorities with the same rows
    compiled = torch.compile(step, backend="eager", fullgraph=True)

    def replayed(got):  # the same rows and updates, by insert and update_priorities
        plain.insert(got[2])
        if plain.sampler.prioritized:
            plain.update_priorities(got[1].reshape(-1), got[3].reshape(-1))

    # 5 + 40 rows: the 16-row ring wraps more than twice, episodes end every few steps
    assert_compiled_matches_eager(compiled, eager, 40, replayed)
    assert buf.ring.total == 5  # the host's copy is behind until an eager call
    assert_same_buffers(buf, eager_buf)
    assert buf.ring.total == 45
    assert_same_buffers(buf, plain)
    if buf.sampler.prioritized:
        assert buf.max_priority > 1


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_the_whole_step_compiles_with_the_backends_that_functionalize_it(backend):
    torch._dynamo.reset()
    buf, step = build_step(*WHOLE["per pixels stacks returns"])
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(30):
            loss, idx, _, _ = compiled()
            assert torch.isfinite(loss)
    assert len(buf) == 35 * E - (35 - M) * E
    assert bool((buf.sampling_mass()[idx] > 0).all())
    assert np.isfinite(buf.max_priority)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["per vector windows", "per pixels stacks returns"])
def test_the_whole_step_is_one_cuda_graph_and_its_eager_calls_never_sync(name):
    """Simulator step -> insert -> sample -> loss -> priority update captured in one CUDA graph; each replay's rows and
    updates, replayed into a plain buffer by ``insert`` and ``update_priorities``, leave it equal. The eager step
    runs under ``torch.cuda.set_sync_debug_mode("error")``."""
    from gpubuf.ops import capture_graph

    buf, step = build_step(*WHOLE[name], device="cuda")
    plain = copy.deepcopy(buf)

    def replayed(out):
        plain.insert(out[2])
        plain.update_priorities(out[1].reshape(-1), out[3].reshape(-1))

    def recorded():
        out = step()
        if not torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()
            replayed(out)
        return out

    graph, out = capture_graph(recorded)
    for _ in range(30):  # the 16-row ring wraps, episodes end
        graph.replay()
        torch.cuda.synchronize()
        replayed(out)
    assert_same_buffers(buf, plain)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
