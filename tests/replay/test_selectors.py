"""Selectors: recency, mixtures, FIFO/LIFO queues and DreamerV3's online queue, through the public API; the draws
against exact probabilities computed here from the rows' ages, validity and priorities."""

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures import index_rows
from scipy import stats

from gpubuf import PrioritizedTransitionBuffer, TransitionBuffer
from gpubuf.replay.sampling.selectors import Fifo, Lifo, Mixture, Online, Recency

E, M = 3, 20


def filled(cls=TransitionBuffer, selector=None, rows=35, n_steps=2, **kw):
    """M rows per env held after ``rows`` inserted (the ring wrapped), an episode ending every 7 steps."""
    buf = cls(E * M, 48, index_rows(1, E), n_steps=n_steps, seed=0, selector=selector, **kw)
    for t in range(0, rows, 5):
        buf.insert(index_rows(5, E, t, term_every=7))
    return buf


def ages(buf) -> np.ndarray:
    """(M*E,) rows each start's env wrote after it (its age)."""
    flat = torch.arange(M * E)
    _, _, step = buf.locate(flat)
    return (step.max() - step).numpy()


def valid(buf, **kw) -> np.ndarray:
    twin = filled(n_steps=buf.n_steps)
    return twin.sampling_mass(**kw).numpy() > 0


def counts(draw, batches: int) -> np.ndarray:
    c = np.zeros(M * E)
    for _ in range(batches):
        np.add.at(c, draw().cpu().numpy(), 1)
    return c


def assert_matches(c: np.ndarray, expected: np.ndarray) -> None:
    """Counts ``c`` agree with ``expected`` counts (chi-square), and no count falls where none is expected."""
    assert c[expected == 0].sum() == 0
    keep = expected > 0
    assert stats.chisquare(c[keep], expected[keep] / expected[keep].sum() * c.sum()).pvalue > 1e-4


@pytest.mark.parametrize("boundaries", ["allow", "forbid"])
def test_recency_draws_each_valid_start_by_its_age(boundaries):
    buf = filled(selector=Recency(exponent=0.7))
    p = valid(buf, boundaries=boundaries) * (ages(buf) + 1.0) ** -0.7
    c = counts(lambda: buf.sample(boundaries=boundaries, return_indices=True)[1], 300)
    assert_matches(c, p)


def test_a_mixture_draws_its_counts_of_each_component_and_weighs_by_the_mixture():
    buf = filled(PrioritizedTransitionBuffer, Mixture(uniform=1, prioritized=2, recency=1, exponent=1.0), beta=0.5)
    prio = np.random.default_rng(0).uniform(0.1, 3.0, M * E)
    buf.update_priorities(torch.arange(M * E), prio)
    ok = valid(buf)
    pu = ok / ok.sum()
    pp = ok * buf.sampling_mass().numpy()
    pp /= pp.sum()
    pr = ok * (ages(buf) + 1.0) ** -1.0
    pr /= pr.sum()
    q = (12 * pu + 24 * pp + 12 * pr) / 48  # B = 48: 12, 24, 12
    batch, idx = buf.sample()
    want = (q[idx.numpy()] / q[idx.numpy()].min()) ** -0.5
    assert np.allclose(batch.PER_weights.numpy(), want, rtol=1e-5)
    assert_matches(counts(lambda: buf.sample()[1], 300), q)
    assert buf.selector.counts(48) == {"uniform": 12, "prioritized": 24, "recency": 12}
    assert Mixture(uniform=1, recency=2).counts(10) == {"uniform": 3, "prioritized": 0, "recency": 7}


def test_a_graph_sampler_draws_with_recency_from_the_rows_as_they_are_when_it_runs():
    buf = filled(selector=Recency())
    graph = buf.graph_sampler(batch_size=48)
    assert_matches(counts(lambda: graph.sample()[1], 300), valid(buf) * (ages(buf) + 1.0) ** -1)
    buf.insert(index_rows(3, E, 35, term_every=7))  # the ages move: the same sampler follows
    twin = TransitionBuffer(E * M, 48, index_rows(1, E), n_steps=2, seed=0)
    for t in range(0, 35, 5):
        twin.insert(index_rows(5, E, t, term_every=7))
    twin.insert(index_rows(3, E, 35, term_every=7))
    ok = twin.sampling_mass().numpy() > 0
    assert_matches(counts(lambda: graph.sample()[1], 300), ok * (ages(buf) + 1.0) ** -1)


def test_a_graph_sampler_of_a_prioritized_mixture_weighs_like_sample():
    buf = filled(PrioritizedTransitionBuffer, Mixture(uniform=1, prioritized=1), beta=0.4)
    graph = buf.graph_sampler(batch_size=8)
    out, idx = graph.sample()
    q = buf.selector.prob(0, idx, buf.selector.counts(8))
    assert torch.allclose(out.PER_weights, ((q / q.min()) ** -0.4).float())


def test_each_minibatch_of_a_graph_sampled_mixture_is_the_mixture_its_weights_assume():
    """``minibatches=K`` with a Mixture: every minibatch holds the mixture's counts of each component, so its draws
    follow the mixture's probabilities (chi-square per minibatch) and its PER_weights are those of its own starts."""
    buf = filled(PrioritizedTransitionBuffer, Mixture(uniform=0.5, recency=0.5), beta=0.5)
    graph = buf.graph_sampler(batch_size=8, minibatches=2)
    ok = valid(buf)
    pr = ok * (ages(buf) + 1.0) ** -1.0
    q = 0.5 * ok / ok.sum() + 0.5 * pr / pr.sum()
    c, age, start_age = np.zeros((2, M * E)), [[], []], ages(buf)
    for _ in range(400):
        out, idx = graph.sample()
        for k in range(2):
            i = idx[k].numpy()
            np.add.at(c[k], i, 1)
            age[k].append(start_age[i].mean())
            want = (q[i] / q[i].min()) ** -0.5
            assert np.allclose(out.PER_weights[k].numpy(), want, rtol=1e-5)
    for k in range(2):
        assert_matches(c[k], q)
    assert stats.ttest_ind(age[0], age[1]).pvalue > 1e-4  # the same mean age in both


@pytest.mark.parametrize("cls", [TransitionBuffer, PrioritizedTransitionBuffer])
def test_online_draws_a_batch_larger_than_the_valid_starts_with_replacement_as_the_buffer_does(cls):
    """6 valid starts, a batch of 8 with replacement: the buffer draws it, and so does Online with any base (its 6
    queued starts first, then 2 from the base); without replacement both refuse it alike."""
    for selector in (None, Online(), Online(Recency()), Online(Mixture(uniform=1, recency=1))):
        buf = cls(E * M, 8, index_rows(1, E), selector=selector, seed=0)
        buf.insert(index_rows(2, E))
        assert buf.num_valid() == 6
        for call in range(2):
            batch, idx = buf.sample(batch_size=8, with_replacement=True, return_indices=True)
            assert idx.shape == (8,) and set(idx.tolist()) <= set(range(6)), selector
            assert (batch.observation[:, 0] == idx.to(batch.observation.dtype)).all()
            if selector is not None and call == 0:
                assert sorted(idx[:6].tolist()) == list(range(6))  # the queue first, each start once
        if selector is None or selector.base is None:
            with pytest.raises(ValueError, match="batch_size: 8 exceeds the 6 valid starts, which sampling without"):
                buf.sample(batch_size=8, with_replacement=False)


def test_dreamerv3_s_default_replay_is_online_then_uniform_as_the_docs_map_it():
    """DreamerV3's defaults (replay.online: True, fracs: uniform 1.0) are Online() on a uniform buffer: the new starts
    first, then uniform draws over the valid starts (no recency); docs/replay.md maps them so."""
    buf = filled(selector=Online())
    buf.sample(batch_size=48)  # serves the waiting starts (and more)
    while buf.num_unserved():
        buf.sample(batch_size=48)
    assert_matches(counts(lambda: buf.sample(batch_size=48, return_indices=True)[1], 200), valid(buf) * 1.0)
    page = (Path(__file__).parents[2] / "docs" / "replay.md").read_text()
    block = page[page.index("# DreamerV3's defaults"):]
    assert "fracs: {uniform: 1.0, priority: 0.0, recency: 0.0}" in block
    assert block.split("world = ", 1)[1].split("\n", 1)[0].endswith("selector=Online())")


def test_selected_windows_read_as_the_buffer_reads_any_start():
    """Stacks, n-step returns and boundary flags of the starts a selector drew equal the buffer's own reading of
    those starts."""
    for selector in (Recency(), Fifo(), Online(Mixture(uniform=1, recency=1))):
        buf = filled(selector=selector, n_steps=1)
        for kw in ({"frame_stack": 3, "n_step_return": (3, 0.9)}, {"with_next_obs": True, "boundaries": "mask"}):
            batch, idx = buf.sample(batch_size=8, return_indices=True, **kw)
            spec = buf.reader.spec(kw.get("frame_stack"), 1, kw.get("n_step_return"), None)
            plan, _ = buf.reader.plan(8, kw.get("with_next_obs", False), kw.get("boundaries", "allow"), spec, True,
                                      None, ())
            again = plan.read(idx, plan.outputs())
            for name in ("observation", "reward", "next_observation", "discount", "is_first", "mask"):
                if getattr(batch, name) is not None:
                    assert torch.equal(getattr(batch, name), getattr(again, name)), name


def test_fifo_and_lifo_serve_each_start_once_in_order():
    fifo = TransitionBuffer(2 * 10, 3, index_rows(1, 2), seed=0, selector=Fifo())
    lifo = TransitionBuffer(2 * 10, 3, index_rows(1, 2), seed=0, selector=Lifo())
    for buf in (fifo, lifo):
        buf.insert(index_rows(4, 2))  # starts 0..7
    assert fifo.sample(return_indices=True)[1].tolist() == [0, 1, 2]
    assert fifo.sample(return_indices=True)[1].tolist() == [3, 4, 5]
    assert lifo.sample(return_indices=True)[1].tolist() == [6, 7, 4]
    assert fifo.num_unserved() == 2
    with pytest.raises(ValueError, match="batch_size: 3 exceeds the 2 valid starts not yet served"):
        fifo.sample()
    fifo.insert(index_rows(8, 2, 4))  # steps 4..11; steps 10, 11 overwrite rows 0, 1: new again
    assert fifo.num_unserved() == 18  # rows held: steps 2..11; served among them: step 2's row
    assert fifo.sample(return_indices=True)[1].tolist() == [6, 7, 8]  # step 3's row, then step 4's
    fifo.sample(batch_size=14)
    assert fifo.sample(batch_size=1, return_indices=True)[1].tolist() == [3]  # step 11 (row 1), env 1: last
    assert fifo.num_unserved() == 0


def test_queue_marks_ride_along_in_state_dict_and_copies():
    buf = TransitionBuffer(2 * 10, 3, index_rows(1, 2), seed=0, selector=Fifo())
    buf.insert(index_rows(4, 2))
    buf.sample()
    for other in (copy.deepcopy(buf), _loaded(buf.state_dict())):
        assert other.sample(return_indices=True)[1].tolist() == [3, 4, 5]
    plain = TransitionBuffer(2 * 10, 3, index_rows(1, 2), seed=0)
    plain.insert(index_rows(4, 2))
    fresh = _loaded(plain.state_dict())  # a state without marks: every start unserved
    assert fresh.sample(return_indices=True)[1].tolist() == [0, 1, 2]
    bad = {**buf.state_dict(), "selector_served": torch.zeros(3, dtype=torch.bool)}
    with pytest.raises(ValueError, match="selector_served: expected a torch.bool tensor of shape"):
        fresh.load_state_dict(bad)
    assert fresh.num_unserved() == 5  # nothing changed


def _loaded(state):
    buf = TransitionBuffer(2 * 10, 3, index_rows(1, 2), seed=1, selector=Fifo())
    buf.load_state_dict(state)
    return buf


def test_online_serves_new_starts_first_then_the_base():
    buf = PrioritizedTransitionBuffer(2 * 10, 4, index_rows(1, 2), seed=0, selector=Online())
    buf.insert(index_rows(3, 2))  # 6 starts
    first = buf.sample()[1].tolist()
    assert first == [0, 1, 2, 3]
    second = buf.sample()[1].tolist()
    assert second[:2] == [4, 5] and len(set(second)) == 4  # then the buffer's own draw, distinct (PER default)
    buf.insert(index_rows(1, 2, 3))
    assert buf.sample()[1].tolist()[:2] == [6, 7]
    rec = TransitionBuffer(2 * 10, 4, index_rows(1, 2), seed=0, selector=Online(Recency()))
    rec.insert(index_rows(3, 2))
    rec.sample()
    assert rec.num_unserved() == 2
    batch, idx = rec.sample(return_indices=True)
    assert idx[:2].tolist() == [4, 5] and rec.num_unserved() == 0


def test_bad_selectors_are_refused_naming_the_argument():
    for bad in (0, -1.0, float("inf"), True, "1"):
        with pytest.raises(ValueError, match="exponent: expected a finite number > 0"):
            Recency(bad)
    with pytest.raises(ValueError, match="uniform: expected a finite fraction >= 0"):
        Mixture(uniform=-1)
    with pytest.raises(ValueError, match="expected at least one fraction > 0"):
        Mixture()
    with pytest.raises(ValueError, match="base: expected None, a Recency or a Mixture, got Fifo"):
        Online(Fifo())
    with pytest.raises(ValueError, match="selector: expected None or a gpubuf selector"):
        TransitionBuffer(E * M, 4, index_rows(1, E), selector="recency")
    with pytest.raises(ValueError, match="prioritized: a TransitionBuffer has no priorities"):
        TransitionBuffer(E * M, 4, index_rows(1, E), selector=Mixture(prioritized=1))
    shared = Recency()
    first = TransitionBuffer(E * M, 4, index_rows(1, E), selector=shared)
    with pytest.raises(ValueError, match="selects for another buffer already"):
        TransitionBuffer(E * M, 4, index_rows(1, E), selector=shared)
    del first  # held weakly by its selector: once the buffer is gone, the selector may select for another
    TransitionBuffer(E * M, 4, index_rows(1, E), selector=shared)
    buf = filled(selector=Recency())
    with pytest.raises(ValueError, match="with_replacement: a Recency selector draws with replacement"):
        buf.sample(with_replacement=False)
    with pytest.raises(ValueError, match="num_unserved: this buffer's selector"):
        buf.num_unserved()
    with pytest.raises(ValueError, match="decides on the host"):
        filled(selector=Fifo()).graph_sampler()


def test_recency_on_a_reopened_storage_dir_counts_ages_from_its_newest_row(tmp_path):
    with filled(selector=Recency(), storage_dir=tmp_path / "r") as buf:
        want = valid(buf) * (ages(buf) + 1.0) ** -1
    again = TransitionBuffer(E * M, 48, index_rows(1, E), n_steps=2, seed=0, selector=Recency(),
                             storage_dir=tmp_path / "r")
    assert_matches(counts(lambda: again.sample(return_indices=True)[1], 300), want)
    again.close()


def test_queue_marks_survive_save_and_load(tmp_path):
    buf = TransitionBuffer(2 * 10, 3, index_rows(1, 2), seed=0, selector=Fifo())
    buf.insert(index_rows(4, 2))
    buf.sample()
    buf.save(tmp_path / "q.ckpt")
    other = TransitionBuffer(2 * 10, 3, index_rows(1, 2), seed=0, selector=Online())
    other.load(tmp_path / "q.ckpt")
    assert other.num_unserved() == 5 and other.sample(return_indices=True)[1].tolist()[:3] == [3, 4, 5]


def test_numpy_numbers_configure_selectors():
    assert Recency(np.int64(2)).exponent == 2.0
    assert Mixture(uniform=np.float32(1), recency=np.int32(1)).fractions["uniform"] == 0.5
    with pytest.raises(ValueError, match="exponent"):
        Recency(np.bool_(True))
