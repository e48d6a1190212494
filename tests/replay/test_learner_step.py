"""A learner step without the host: ``GraphSampler.sample`` -> the user's loss -> ``GraphSampler.update_priorities``.

On the CPU the whole step traces under ``torch.compile(fullgraph=True)`` with no graph break and no recompile while
the buffer fills and wraps, and computes what the eager step computes; on CUDA it is captured in one graph. The
priority update is checked on the device: invalid values are never written, and the failure is raised at the
documented host-visible points. ``minibatches=K`` serves K updates from one draw, with per-minibatch PER weights.
"""

import copy
import os
import pickle
import threading

import numpy as np
import pytest
import torch
from fixtures import make_transition
from scipy import stats

from gpubuf import PrioritizedTransitionBuffer, TransitionBuffer
from gpubuf.ops import capture_graph

pytestmark = pytest.mark.usefixtures("host_loops")  # with the compiled host loops and with the torch twins

E, M = 3, 64
# name -> (prioritized, buffer kwargs, graph_sampler kwargs)
STEPS = {
    "uniform": (False, {}, {}),
    "per": (True, {}, {}),
    "per windows": (True, {"n_steps": 3}, {"with_next_obs": True}),
    "per stacks": (True, {}, {"frame_stack": 3}),
    "per returns": (True, {}, {"n_step_return": (3, 0.9)}),
    "per stacks returns minibatches": (True, {}, {"frame_stack": 2, "n_step_return": (2, 0.5), "minibatches": 3}),
    "uniform minibatches": (False, {"n_steps": 2}, {"minibatches": 2}),
}


def build(prioritized, buf_kw, gs_kw):
    cls = PrioritizedTransitionBuffer if prioritized else TransitionBuffer
    buf = cls(E * M, 8, make_transition(0, 1, E), seed=0, **buf_kw)
    buf.insert(make_transition(0, 20, E, trunc_steps=(7,)))
    gs = buf.graph_sampler(batch_size=8, **gs_kw)  # the default generator: a compiled step cannot hold another
    return buf, gs


def learner_step(gs, w: torch.Tensor):
    """The user's step: a loss from the batch, then the priorities from its TD errors."""

    def step():
        out, idx = gs.sample()
        feat = torch.cat([out.observation.float().reshape(*idx.shape, -1),
                          out.reward.float().reshape(*idx.shape, -1)], -1)
        td = feat.mean(-1) * w - 1.0
        weights = out.PER_weights if gs.prioritized else torch.ones_like(td)
        if gs.prioritized:
            gs.update_priorities(idx, td.detach())
        return (td**2 * weights).mean(), idx.clone()

    return step


@pytest.mark.parametrize("name", list(STEPS))
def test_the_step_compiles_whole_and_matches_the_eager_step_as_the_buffer_wraps(name):
    torch._dynamo.reset()
    eager_buf, eager_gs = build(*STEPS[name])
    buf, gs = build(*STEPS[name])
    w = torch.tensor(0.01)
    eager, step = learner_step(eager_gs, w), learner_step(gs, w)
    explanation = torch._dynamo.explain(learner_step(build(*STEPS[name])[1], w))()
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    compiled = torch.compile(step, backend="eager", fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for t in range(60):  # 20 + 60 * 2 rows: the ring of 64 rows wraps twice
            rows = make_transition(20 + 2 * t, 2, E)
            eager_buf.insert(rows)
            buf.insert(rows)
            torch.manual_seed(t)
            want, want_idx = eager()
            torch.manual_seed(t)
            got, got_idx = compiled()
            torch.testing.assert_close(got, want)
            assert torch.equal(got_idx, want_idx)
    if gs.prioritized:
        assert torch.equal(buf.sampler.priority, eager_buf.sampler.priority)
        # the eager CPU step's compiled loops and the traced torch ops round powers apart (within 1e-15)
        torch.testing.assert_close(buf.sampling_mass(), eager_buf.sampling_mass(), rtol=1e-14, atol=0)
        assert buf.max_priority == eager_buf.max_priority > 1


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", list(STEPS))
def test_the_step_compiles_with_the_backends_that_functionalize_it(name, backend):
    """AOTAutograd (under inductor too) refuses graph inputs that alias and are written; the traced step sees the
    windows as views of the gathered memory, so none do."""
    torch._dynamo.reset()
    buf, gs = build(*STEPS[name])
    compiled = torch.compile(learner_step(gs, torch.tensor(0.01)), backend=backend, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for t in range(30):
            buf.insert(make_transition(20 + 2 * t, 2, E))
            loss, idx = compiled()
            assert torch.isfinite(loss)
            nxt = "windows" in name or "returns" in name  # the kind the sampler draws
            assert bool((buf.sampling_mass(with_next_obs=nxt)[idx] > 0).all())
    assert not gs.prioritized or buf.max_priority > 1


def test_device_updates_write_what_the_checked_update_writes():
    """Same starts (with duplicates) and TD errors: the same priorities, tree and max_priority."""
    a, gs = build(True, {"alpha": 0.7}, {})
    b, _ = build(True, {"alpha": 0.7}, {})
    g = torch.Generator().manual_seed(5)
    for _ in range(5):
        idx = torch.randint(0, E * M, (40,), generator=g)
        td = torch.randn(40, generator=g) * 3
        gs.update_priorities(idx, td)
        b.update_priorities(idx, td)
        a.insert(make_transition(100, 3, E))  # new starts get max_priority from the device
        b.insert(make_transition(100, 3, E))
    gs.check_updates()
    assert torch.equal(a.sampler.priority, b.sampler.priority)
    assert torch.equal(a.sampling_mass(), b.sampling_mass())
    assert a.max_priority == b.max_priority


@pytest.mark.parametrize("bad, error, words", [
    ("nan", ValueError, "NaN or infinite"),
    ("inf", ValueError, "NaN or infinite"),
    ("index", IndexError, "outside"),
    ("negative index", IndexError, "outside"),
    ("overflow", ValueError, "overflows float64"),
])
def test_an_invalid_device_update_writes_nothing_and_is_raised_at_the_next_check(bad, error, words):
    buf, gs = build(True, {"alpha": 9.0}, {})
    gs.update_priorities(torch.arange(8), torch.full((8,), 2.0))
    before = (buf.sampler.priority.clone(), buf.sampling_mass(), buf.max_priority)
    idx, td = torch.arange(8), torch.ones(8)
    if bad == "nan":
        td[3] = float("nan")
    elif bad == "inf":
        td[0] = float("inf")
    elif bad == "index":
        idx[5] = E * M
    elif bad == "negative index":
        idx[2] = -1
    else:
        td[1] = 1e36  # (1e36) ** 9 over every start
    gs.update_priorities(idx, td)  # no exception here: nothing is read back
    gs.update_priorities(idx, td)
    assert torch.equal(buf.sampler.priority, before[0])  # nothing of either update written
    assert torch.equal(buf.sampling_mass(), before[1])
    with pytest.raises(error, match=f"2 device-side update.*{words}"):
        gs.check_updates()
    gs.check_updates()  # raised once: cleared
    assert buf.max_priority == before[2]
    gs.update_priorities(torch.arange(8), torch.full((8,), 3.0))  # later valid updates are written
    assert buf.max_priority == pytest.approx(3.0 + 1e-6)


@pytest.mark.parametrize("where", ["max_priority", "state_dict", "deepcopy", "flush"])
def test_a_dropped_device_update_surfaces_where_the_buffer_reads_the_device(where, tmp_path):
    kw = {"storage_dir": tmp_path / "d"} if where == "flush" else {}
    buf, gs = build(True, kw, {})
    gs.update_priorities(torch.arange(4), torch.tensor([1.0, float("nan"), 1.0, 1.0]))
    calls = {"max_priority": lambda: buf.max_priority, "state_dict": buf.state_dict,
             "deepcopy": lambda: copy.deepcopy(buf), "flush": buf.flush}
    with pytest.raises(ValueError, match="NaN"):
        calls[where]()
    calls[where]()  # then it goes through
    if where == "flush":
        buf.close()


def test_new_starts_get_the_device_max_priority_without_a_read():
    buf, gs = build(True, {}, {})
    gs.update_priorities(torch.tensor([0, 1]), torch.tensor([50.0, -70.0]))
    buf.insert(make_transition(20, 1, E))
    newest = buf.sampler.priority.view(M, E)[20]
    assert torch.equal(newest, torch.full((E,), 70.0 + 1e-6, dtype=torch.float32))
    buf.update_priorities([2], [100.0])  # the checked host path raises the device copy too
    buf.insert(make_transition(21, 1, E))
    assert float(buf.sampler.priority.view(M, E)[21, 0]) == pytest.approx(100.0)
    assert buf.max_priority == pytest.approx(100.0)


def test_minibatches_draw_with_the_exact_probabilities_and_weigh_per_minibatch():
    K, B = 4, 25
    buf = PrioritizedTransitionBuffer(2 * 20, 8, make_transition(0, 1, 2), alpha=0.7, beta=0.6, seed=0)
    buf.insert(make_transition(0, 20, 2))
    g = torch.Generator().manual_seed(3)
    buf.update_priorities(torch.arange(40), torch.rand(40, generator=g) * 4)
    p = buf.sampling_mass()
    gs = buf.graph_sampler(batch_size=B, minibatches=K, generator=torch.Generator().manual_seed(7))
    counts = np.zeros(40)
    for _ in range(300):
        out, idx = gs.sample()
        assert idx.shape == (K, B) and out.observation.shape == (K, B, 2) and out.PER_weights.shape == (K, B)
        np.add.at(counts, idx.numpy().ravel(), 1)
    assert stats.chisquare(counts, (p / p.sum()).numpy() * counts.sum()).pvalue > 1e-4
    m = p[idx]
    torch.testing.assert_close(out.PER_weights, (m / m.min(1, keepdim=True).values).pow(-0.6).float())
    assert torch.equal(out.observation[..., 0], (idx // 2 * 2 + idx % 2).float())  # value = step * E + env


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "2"])
def test_a_bad_minibatches_is_named(bad):
    buf, _ = build(True, {}, {})
    with pytest.raises(ValueError, match="minibatches: expected an int >= 1"):
        buf.graph_sampler(batch_size=8, minibatches=bad)


def test_minibatches_takes_any_integer_and_a_batch_too_large_names_both():
    buf, _ = build(True, {}, {})
    assert buf.graph_sampler(batch_size=8, minibatches=np.int64(2)).indices.shape == (2, 8)
    with pytest.raises(MemoryError, match="batch_size, minibatches"):
        buf.graph_sampler(batch_size=8, minibatches=10**12)


def test_td_errors_straight_from_a_loss_are_detached():
    buf, gs = build(True, {}, {})
    td = torch.full((4,), 2.0, requires_grad=True) * 1.5
    gs.update_priorities(torch.arange(4), td)
    gs.check_updates()
    assert not buf.sampler.priority.requires_grad
    assert buf.sampler.priority[:4].tolist() == [pytest.approx(3.0 + 1e-6)] * 4
    buf.insert(make_transition(20, 2, E))  # still usable
    gs.update_priorities(*gs.sample()[1:], torch.ones(8))


def test_the_device_and_host_checks_share_the_mass_bound():
    """A priority just below the largest whose mass stays finite is written by both paths; just above, by neither."""
    buf, gs = build(True, {"alpha": 50.0}, {})
    limit = buf.sampler.mass_limit
    below = np.float32(limit)
    while float(below) + 1e-6 >= limit or float(np.float32(below + np.float32(1e-6))) >= limit:
        below = np.nextafter(below, np.float32(0))
    above = np.nextafter(np.float32(limit), np.float32(np.inf))
    gs.update_priorities(torch.tensor([0]), torch.tensor([float(below)]))
    gs.check_updates()
    buf.update_priorities([1], [float(below)])
    assert buf.sampler.priority[0] == buf.sampler.priority[1] > 1
    gs.update_priorities(torch.tensor([2]), torch.tensor([float(above)]))
    with pytest.raises(ValueError, match="overflows"):
        gs.check_updates()
    with pytest.raises(ValueError, match="overflows"):
        buf.update_priorities([3], [float(above)])


@pytest.mark.parametrize("indices, td, words", [
    ([0, 1], torch.ones(2), "indices: expected a non-empty integer tensor"),
    (torch.tensor([0.0, 1.0]), torch.ones(2), "indices: expected a non-empty integer tensor"),
    (torch.tensor([0, 1]), torch.tensor([1, 2]), "td_errors: expected a non-empty real tensor"),
    (torch.tensor([0, 1]), torch.ones(3), "td_errors: expected the shape of indices"),
    (torch.zeros(0, dtype=torch.int64), torch.ones(0), "indices: expected a non-empty"),
    (torch.tensor([0, 1]), np.ones(2), "td_errors: expected a non-empty real tensor"),
])
def test_bad_update_arguments_are_named_and_write_nothing(indices, td, words):
    buf, gs = build(True, {}, {})
    before = buf.sampler.priority.clone()
    with pytest.raises(ValueError, match=words):
        gs.update_priorities(indices, td)
    assert torch.equal(buf.sampler.priority, before)
    gs.check_updates()


def test_a_uniform_sampler_has_no_priorities_to_update():
    _, gs = build(False, {}, {})
    with pytest.raises(ValueError, match="not prioritized"):
        gs.update_priorities(torch.tensor([0]), torch.ones(1))


@pytest.mark.cuda
def test_one_cuda_graph_holds_the_whole_prioritized_step():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    buf = PrioritizedTransitionBuffer(4 * 256, 64, make_transition(0, 1, 4), n_steps=2, device="cuda", seed=0)
    buf.insert(make_transition(0, 100, 4))
    gs = buf.graph_sampler(minibatches=2)
    w = torch.tensor(0.01, device="cuda")
    graph, (loss, idx) = capture_graph(learner_step(gs, w))  # warm-up on a side stream, then one capture
    for t in range(5):
        buf.insert(make_transition(100 + 10 * t, 10, 4))
        graph.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(loss) and buf.max_priority > 1
    gs.check_updates()
    w.fill_(float("nan"))  # the next replay's TD errors are NaN: dropped on the device, raised at the check
    before = buf.sampler.priority.clone()
    graph.replay()
    assert torch.equal(buf.sampler.priority, before)
    with pytest.raises(ValueError, match="NaN"):
        gs.check_updates()
    # the graph updates the trees kept at capture: a draw that needs another one is refused, not left stale
    with pytest.raises(RuntimeError, match="captured GraphSampler.update_priorities"):
        buf.sample(with_next_obs=True, boundaries="forbid")


def test_the_buffers_own_update_can_be_deferred_too():
    """``update_priorities(..., deferred=True)``: the device-checked update without a GraphSampler."""
    buf, _ = build(True, {}, {})
    a, _ = build(True, {}, {})
    idx, td = torch.tensor([3, 3, 9]), torch.tensor([2.0, -5.0, 0.5])
    assert buf.update_priorities(idx, td, deferred=True) is buf
    a.update_priorities(idx, td)
    buf.check_updates()
    assert torch.equal(buf.sampler.priority, a.sampler.priority) and buf.max_priority == a.max_priority
    before = buf.sampler.priority.clone()
    buf.update_priorities(torch.tensor([1, E * M]), torch.ones(2), deferred=True)  # no exception here
    assert torch.equal(buf.sampler.priority, before)
    with pytest.raises(IndexError, match="outside"):
        buf.check_updates()
    buf.check_updates()
    with pytest.raises(ValueError, match="generations: not offered with deferred=True"):
        buf.update_priorities(idx, td, deferred=True, generations=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="td_errors"):
        buf.update_priorities(idx, torch.ones(2), deferred=True)
    assert torch.equal(buf.sampler.priority, before)


def consistent(buf) -> None:
    """Every kept tree holds ``priority ** alpha`` on the valid starts (within rounding) and its parents sum them."""
    mass = buf.sampling_mass()
    want = buf.sampler.priority.double().pow(buf.alpha) * (mass > 0)
    torch.testing.assert_close(mass, want, rtol=1e-12, atol=0)


def test_two_threads_update_insert_and_sample_at_once():
    buf, gs = build(True, {}, {})
    errors = []

    def learner():
        try:
            for _ in range(150):
                _, idx = gs.sample()
                gs.update_priorities(idx, torch.rand(8) * 3)
                buf.update_priorities(idx[:4], torch.rand(4), deferred=True)
                buf.update_priorities(idx[4:], torch.rand(4))
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    def actor():
        try:
            for t in range(150):
                buf.insert(make_transition(20 + t, 1, E))
                buf.sample(with_replacement=True)
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=learner), threading.Thread(target=actor)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    buf.check_updates()
    consistent(buf)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_after_device_updates_keeps_them_and_writes_apart(how):
    buf, gs = build(True, {}, {})
    gs.update_priorities(torch.arange(10), torch.arange(10.0) * 4)
    dup = copy.deepcopy(buf) if how == "deepcopy" else pickle.loads(pickle.dumps(buf))
    assert torch.equal(dup.sampler.priority, buf.sampler.priority) and dup.max_priority == buf.max_priority
    dup_gs = dup.graph_sampler(batch_size=8)
    dup_gs.update_priorities(torch.tensor([0]), torch.tensor([100.0]))
    assert dup.max_priority == pytest.approx(100.0) and buf.max_priority == pytest.approx(36.0)
    consistent(dup)
    consistent(buf)


def test_a_forked_child_samples_and_updates_on_its_own_copy():
    buf, gs = build(True, {}, {})
    gs.update_priorities(torch.arange(6), torch.full((6,), 9.0))
    before = buf.sampler.priority.clone()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: draw, update, check, report
        ok = True
        try:
            _, idx = gs.sample()
            gs.update_priorities(idx, torch.full((8,), 50.0))
            gs.check_updates()
            ok = buf.max_priority == pytest.approx(50.0)
        except Exception:  # noqa: BLE001
            ok = False
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        got = f.read()
    assert os.waitpid(pid, 0)[1] == 0 and got == b"1"
    assert torch.equal(buf.sampler.priority, before) and buf.max_priority == pytest.approx(9.0)
