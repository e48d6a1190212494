"""OfflineToOnline: every batch holds exactly round(B * fraction) offline windows, then online ones; each part is
drawn with its own buffer's probabilities (tested against the exact ones), carries its own importance weights, and
takes its own priority updates back."""

import numpy as np
import pytest
import torch
from scipy import stats

from gpubuf import MixedBatch, OfflineToOnline, PrioritizedTransitionBuffer, Transition, TransitionBuffer, Unit


def rows(values: np.ndarray) -> Transition:
    """Single-env rows whose observation and reward are ``values`` (offline negative, online positive)."""
    v = values.astype(np.float32)
    return Transition(observation=np.stack([v, v], 1), action=np.zeros((len(v), 1), np.float32), reward=v,
                      terminated=np.zeros(len(v), bool), truncated=np.zeros(len(v), bool))


def buffers(offline_per: bool, online_per: bool, n_off: int = 40, n_on: int = 24):
    off = (PrioritizedTransitionBuffer if offline_per else TransitionBuffer)(n_off, 8, rows(np.zeros(1)),
                                                                              vectorized_env=False, seed=0)
    on = (PrioritizedTransitionBuffer if online_per else TransitionBuffer)(n_on, 8, rows(np.zeros(1)),
                                                                            vectorized_env=False, seed=1)
    off.insert(rows(-1.0 - np.arange(n_off)))
    on.insert(rows(1.0 + np.arange(n_on)))
    for buf, n in ((off, n_off), (on, n_on)):
        if buf.prioritized:  # distinct priorities: a draw that ignored them would show
            buf.update_priorities(np.arange(n), 0.1 + np.arange(n) % 7)
    return off, on


@pytest.mark.parametrize(("fraction", "B"), [(0.5, 256), (0.25, 7), (0.0, 5), (1.0, 9), (0.3, 1)])
def test_every_batch_holds_the_exact_offline_fraction_offline_rows_first(host_backend, fraction, B):
    off, on = buffers(True, False)
    mixed = OfflineToOnline(off, on, fraction)
    n_off = round(B * fraction)
    assert mixed.split(B) == (n_off, B - n_off)
    for key in range(3):
        batch = mixed.sample(B, Unit.window(), key=key)
        assert isinstance(batch, MixedBatch) and batch.observation.shape == (B, 2)
        assert batch.from_offline.tolist() == [True] * n_off + [False] * (B - n_off)
        assert (batch.reward[:n_off] < 0).all() and (batch.reward[n_off:] > 0).all()
        assert (batch.offline is None) == (n_off == 0) and (batch.online is None) == (n_off == B)
        if n_off:  # a prioritized offline part: weights for every row, 1 on the uniform online part's
            assert batch.PER_weights.shape == (B,) and (batch.PER_weights[n_off:] == 1).all()
        else:
            assert batch.PER_weights is None


@pytest.mark.parametrize(("offline_per", "online_per"), [(True, False), (False, True), (True, True)])
def test_each_part_is_drawn_with_its_buffers_exact_probabilities(offline_per, online_per):
    off, on = buffers(offline_per, online_per)
    mixed = OfflineToOnline(off, on, 0.375)
    g = torch.Generator().manual_seed(0)
    counts = {"off": np.zeros(40), "on": np.zeros(24)}
    for _ in range(400):
        batch = mixed.sample(16, key=g)
        counts["off"] += np.bincount(batch.offline.indices.numpy(), minlength=40)
        counts["on"] += np.bincount(batch.online.indices.numpy(), minlength=24)
    for name, buf, per in (("off", off, offline_per), ("on", on, online_per)):
        n = len(counts[name])
        p = (0.1 + np.arange(n) % 7) ** buf.alpha if per else np.ones(n)
        expected = counts[name].sum() * p / p.sum()
        assert stats.chisquare(counts[name], expected).pvalue > 1e-4, name


def test_each_prioritized_part_carries_its_own_importance_weights():
    off, on = buffers(True, True)
    batch = OfflineToOnline(off, on, 0.5).sample(32, key=3)
    for part, buf, sl in ((batch.offline, off, slice(0, 16)), (batch.online, on, slice(16, 32))):
        n = buf.config.max_rows
        p = ((0.1 + np.arange(n) % 7) ** buf.alpha)
        p /= p.sum()
        w = (n * p[part.indices.numpy()]) ** -buf.beta
        np.testing.assert_allclose(batch.PER_weights[sl].numpy(), w / w.max(), rtol=1e-5)


def test_priority_updates_go_back_to_each_prioritized_part():
    off, on = buffers(True, False)
    mixed = OfflineToOnline(off, on, 0.5)
    batch = mixed.sample(8, key=0, with_replacement=False)
    before = on.state_dict()
    mixed.update_priorities(batch, torch.arange(8, dtype=torch.float32) + 10)
    got = off.state_dict()["priority"][batch.offline.indices]
    np.testing.assert_allclose(got.numpy(), np.arange(4) + 10 + off.eps, rtol=1e-6)
    assert all(torch.equal(before["data"][k], on.state_dict()["data"][k]) for k in before["data"])
    with pytest.raises(ValueError, match=r"td_errors: expected shape \(8,\), got \(7,\)"):
        mixed.update_priorities(batch, torch.zeros(7))
    with pytest.raises(TypeError, match="batch: expected the MixedBatch"):
        mixed.update_priorities(batch.offline, torch.zeros(4))


def test_buffers_that_do_not_match_and_bad_fractions_are_refused():
    off, on = buffers(False, False)
    other = TransitionBuffer(8, 2, Transition(observation=np.zeros((1, 3), np.float32),
                                              action=np.zeros((1, 1), np.float32), reward=np.zeros(1, np.float32),
                                              terminated=np.zeros(1, bool), truncated=np.zeros(1, bool)),
                             vectorized_env=False)
    with pytest.raises(ValueError, match=r"online: its leaves differ from offline's at \['observation'\]"):
        OfflineToOnline(off, other, 0.5)
    longer = TransitionBuffer(24, 2, rows(np.zeros(1)), vectorized_env=False, n_steps=2)
    with pytest.raises(ValueError, match="online: n_steps 2"):
        OfflineToOnline(off, longer, 0.5)
    for bad in (1.5, -0.1, float("nan")):
        with pytest.raises(ValueError, match="offline_fraction"):
            OfflineToOnline(off, on, bad)
    with pytest.raises(TypeError, match="offline: expected a TransitionBuffer, got dict"):
        OfflineToOnline({}, on, 0.5)


def test_an_update_with_a_bad_value_in_one_part_writes_neither():
    off, on = buffers(True, True)
    mixed = OfflineToOnline(off, on, 0.5)
    batch = mixed.sample(4, key=0)
    before = off.state_dict()["priority"].clone(), on.state_dict()["priority"].clone()
    with pytest.raises(ValueError, match=r"td_errors: \|td\| \+ eps must be finite"):
        mixed.update_priorities(batch, torch.tensor([3.0, 3.0, float("nan"), 1.0]))
    assert torch.equal(off.state_dict()["priority"], before[0]) and torch.equal(on.state_dict()["priority"], before[1])


def test_numpy_int_keys_seed_one_generator_and_bad_batch_sizes_are_named():
    off, on = buffers(False, False, 24, 24)
    mixed = OfflineToOnline(off, on, 0.5)
    a, b = mixed.sample(8, key=5), mixed.sample(8, key=np.int64(5))
    assert torch.equal(a.offline.indices, b.offline.indices) and torch.equal(a.online.indices, b.online.indices)
    assert not torch.equal(a.offline.indices, a.online.indices)  # one generator: the second draw goes on from it
    for bad in (0, 2.7, "8", True):
        with pytest.raises(ValueError, match="batch_size: expected a positive int"):
            mixed.sample(bad)


def test_buffers_whose_samples_differ_in_dtype_are_refused():
    wide = TransitionBuffer(24, 8, rows(np.zeros(1)), vectorized_env=False, storage_dtypes={"observation":
                            torch.bfloat16}, sample_dtypes={"observation": torch.float32})
    narrow = TransitionBuffer(24, 8, rows(np.zeros(1)), vectorized_env=False,
                              storage_dtypes={"observation": torch.bfloat16})
    with pytest.raises(ValueError, match="online: its sample_dtypes {} differ from offline's"):
        OfflineToOnline(wide, narrow, 0.5)
