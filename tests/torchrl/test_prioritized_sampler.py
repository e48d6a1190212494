"""gpubuf.torchrl.PrioritizedSampler inside torchrl's replay buffers: the same call sequences as torchrl's own
prioritized sampler give the same indices and weights.

torchrl's own sampler keeps its priorities in segment trees from its compiled extension, which does not load
against this torch; the reference here is torchrl's own sampler class with those two trees replaced by plain numpy
ones (``tests/torchrl_reference.py``), so everything else the comparison runs is torchrl's code."""

import numpy as np
import pytest
import torch
from extras import needs

torchrl = needs("torchrl.data")
from scipy import stats  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer  # noqa: E402
from torchrl_reference import ReferenceSampler  # noqa: E402

from gpubuf.torchrl import PrioritizedSampler  # noqa: E402


def buffers(capacity, **kw):
    return [TensorDictReplayBuffer(storage=LazyTensorStorage(capacity), sampler=cls(capacity, **kw), batch_size=16)
            for cls in (PrioritizedSampler, ReferenceSampler)]


def data(start, n):
    return TensorDict({"obs": torch.arange(start, start + n, dtype=torch.float32).view(n, 1)}, batch_size=[n])


def sample_both(rbs, seed):
    out = []
    for rb in rbs:
        np.random.seed(seed)  # torchrl's CPU sampler draws its masses with np.random
        out.append(rb.sample())
    return out


def assert_same(a, b):
    assert torch.equal(a["index"], b["index"])
    assert torch.equal(a["obs"], b["obs"])
    assert torch.allclose(a["priority_weight"], b["priority_weight"], rtol=1e-6)


@pytest.mark.parametrize("within", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_call_sequence_of_a_prioritized_torchrl_buffer_matches_torchrls_sampler(within, dtype):
    rbs = buffers(64, alpha=0.7, beta=0.5, eps=1e-6, dtype=dtype, max_priority_within_buffer=within)
    g = torch.Generator().manual_seed(0)
    start = 0
    for step in range(12):
        for rb in rbs:
            rb.extend(data(start, 23))  # the ring wraps every few steps
        start += 23
        a, b = sample_both(rbs, step)
        assert_same(a, b)
        td = torch.rand(16, generator=g) * (3.0 if step % 4 else 0.0)  # some rounds write zero priorities
        for rb, s in zip(rbs, (a, b), strict=True):
            s.set("td_error", td)
            rb.update_tensordict_priority(s)
        idx = torch.randint(0, len(rbs[0]), (5,), generator=g)
        prio = torch.rand(5, generator=g)
        for rb in rbs:
            rb.update_priority(idx, prio)
            rb.mark_update(idx[:2])
        assert len(rbs[0]) == len(rbs[1])
        assert float(rbs[0].sampler.default_priority) == pytest.approx(float(rbs[1].sampler.default_priority))
    for seed in range(20):
        assert_same(*sample_both(rbs, 100 + seed))


def test_state_dict_dumps_loads_and_empty_round_trip(tmp_path):
    rbs = buffers(50, alpha=0.6, beta=0.4)
    for rb in rbs:
        rb.extend(data(0, 40))
        rb.update_priority(torch.arange(40), torch.linspace(0.1, 4.0, 40))
    again = buffers(50, alpha=0.6, beta=0.4)
    for rb, other in zip(rbs, again, strict=True):
        other.load_state_dict(rb.state_dict())
    assert_same(*sample_both(again, 1))
    assert_same(*sample_both([again[0], rbs[1]], 2))
    rbs[0].dumps(tmp_path / "plug")
    loaded = buffers(50, alpha=0.6, beta=0.4)[0]
    loaded.loads(tmp_path / "plug")
    assert_same(*sample_both([loaded, rbs[1]], 3))
    for rb in rbs:
        rb.empty()
        assert len(rb) == 0
        rb.extend(data(0, 10))
    assert_same(*sample_both(rbs, 4))


def test_draws_follow_the_priorities_exactly():
    rb = buffers(30, alpha=0.8, beta=1.0, eps=1e-8)[0]
    rb.extend(data(0, 30))
    prio = torch.linspace(0.0, 2.0, 30)  # one zero priority: drawn with (eps) ** alpha only
    rb.update_priority(torch.arange(30), prio)
    p = (prio.double() + 1e-8) ** 0.8
    counts = np.zeros(30)
    for _ in range(400):
        np.add.at(counts, rb.sample()["index"].numpy(), 1)
    keep = p.numpy() > 1e-5
    assert counts[~keep].sum() == 0
    assert stats.chisquare(counts[keep], p.numpy()[keep] / p.numpy()[keep].sum() * counts.sum()).pvalue > 1e-4
    s = rb.sample()
    want = (p[s["index"]] / p.min()) ** -1.0
    assert torch.allclose(s["priority_weight"].double(), want, rtol=1e-5)


def test_a_bad_dtype_is_refused_naming_it_with_torchrls_exception_type():
    with pytest.raises(NotImplementedError, match="dtype: expected torch.float32 or torch.float64"):
        PrioritizedSampler(10, 0.5, 0.5, dtype=torch.float16)
    for name, dtype in ((torch.FloatType, torch.float32), (torch.DoubleTensor, torch.float64)):  # torchrl's names
        rb = TensorDictReplayBuffer(storage=LazyTensorStorage(10), batch_size=4,
                                    sampler=PrioritizedSampler(10, 0.5, 0.5, dtype=name))
        rb.extend(data(0, 10))
        assert rb.sampler._sum_tree.dtype == dtype  # noqa: SLF001
        assert rb.sample()["priority_weight"].shape == (4,)


def test_inference_tensors_are_written_like_any_other():
    """Rows, indices and priorities made under ``torch.inference_mode()`` (as a learner computes TD errors)."""
    rbs = buffers(30, alpha=0.7, beta=0.5)
    with torch.inference_mode():
        rows = data(0, 30)
        idx, prio = torch.arange(0, 30, 3), torch.linspace(0.1, 3.0, 10)
    for rb in rbs:
        rb.extend(rows)
        rb.update_priority(idx, prio)
    assert_same(*sample_both(rbs, 0))
    a, b = sample_both(rbs, 1)
    with torch.inference_mode():
        td_error = torch.rand(16)
    for rb, s in zip(rbs, (a, b), strict=True):
        s.set("td_error", td_error)
        rb.update_tensordict_priority(s)
    assert_same(*sample_both(rbs, 2))


def test_dumps_and_loads_write_torchrls_files(tmp_path):
    """The plug-in's files load into torchrl's sampler and back: the same draws afterwards."""
    rbs = buffers(4096, alpha=0.6, beta=0.4)
    for rb in rbs:
        rb.extend(data(0, 3000))
        rb.update_priority(torch.arange(3000), torch.linspace(0.0, 4.0, 3000))
    rbs[0].dumps(tmp_path / "plug")
    reference = buffers(4096, alpha=0.6, beta=0.4)[1]
    reference.loads(tmp_path / "plug")  # torchrl's own loads, one leaf at a time
    assert_same(*sample_both([rbs[0], reference], 5))
    reference.dumps(tmp_path / "ref")  # torchrl's own dumps
    plug = buffers(4096, alpha=0.6, beta=0.4)[0]
    plug.loads(tmp_path / "ref")
    assert_same(*sample_both([plug, rbs[1]], 6))
    assert float(plug.sampler.default_priority) == pytest.approx(4.0)
    wrong = PrioritizedSampler(100, 0.6, 0.4)
    with pytest.raises(RuntimeError, match="max capacity of loaded metadata"):
        wrong.loads(tmp_path / "plug" / "sampler")


def test_an_index_outside_the_trees_is_refused_before_any_write():
    rb = buffers(100, alpha=1.0, beta=1.0)[0]
    rb.extend(data(0, 100))
    before = rb.sampler._sum_tree.leaves.clone()  # noqa: SLF001
    for bad in (110, -2):
        with pytest.raises(IndexError, match=r"index: expected leaves in \[0, 100\)"):
            rb.sampler._sum_tree[torch.tensor([3, bad])] = 1e6  # noqa: SLF001
    default = float(rb.sampler.default_priority)
    with pytest.raises(IndexError):
        rb.update_priority(torch.tensor([110]), torch.tensor([1e6]))
    assert torch.equal(rb.sampler._sum_tree.leaves, before)  # noqa: SLF001
    assert float(rb.sampler.default_priority) == default  # the refused priority is not the new maximum
    assert len(set(rb.sample()["index"].tolist())) > 1


def test_loads_of_a_file_from_before_torchrls_schema_version_recomputes_the_maximum(tmp_path):
    """Files without ``_schema_version`` hold the transformed within-buffer maximum; both samplers recompute it."""
    import json

    rbs = buffers(20, alpha=0.5, beta=0.4, max_priority_within_buffer=True)
    rbs[0].extend(data(0, 20))
    rbs[0].update_priority(torch.arange(20), torch.arange(20.0))
    rbs[0].dumps(tmp_path / "d")
    meta_path = tmp_path / "d" / "sampler" / "sampler_metadata.json"
    meta = json.loads(meta_path.read_text())
    del meta["_schema_version"]
    meta["_max_priority"] = [(19.0 + 1e-8) ** 0.5, 19]
    meta_path.write_text(json.dumps(meta))
    loaded = [PrioritizedSampler(20, 0.5, 0.4, max_priority_within_buffer=True),
              ReferenceSampler(20, 0.5, 0.4, max_priority_within_buffer=True)]
    for s in loaded:
        s.loads(tmp_path / "d" / "sampler")
    assert float(loaded[0].default_priority) == pytest.approx(19.0, rel=1e-5)
    assert float(loaded[0].default_priority) == pytest.approx(float(loaded[1].default_priority), rel=1e-6)


def test_the_smallest_priority_follows_writes_that_raise_it_repeat_leaves_or_change_in_place():
    """The weights' normaliser (the smallest priority) after writes that raise the leaf holding it, after one update
    naming a leaf twice (the last value wins) and after an in-place change of the same index tensor."""
    rbs = buffers(40, alpha=1.0, beta=1.0, eps=0.0)
    for rb in rbs:
        rb.extend(data(0, 40))
        rb.update_priority(torch.arange(40), torch.arange(1.0, 41.0))
    g = torch.Generator().manual_seed(3)
    for step in range(30):
        low = int(torch.argmin(torch.as_tensor(rbs[1].sampler._min_tree.v)))  # noqa: SLF001
        idx = torch.tensor([low, low, int(torch.randint(0, 40, (1,), generator=g))])
        prio = torch.rand(3, generator=g) * 50 + (0.0 if step % 3 else 60.0)
        for rb in rbs:
            rb.update_priority(idx, prio)
        assert_same(*sample_both(rbs, step))
        idx[0] = (low + 1) % 40  # the same tensor, changed in place, written again
        for rb in rbs:
            rb.update_priority(idx, prio)
        assert_same(*sample_both(rbs, 100 + step))
        if step % 10 == 9:  # the kept minimum survives a state round trip
            again = buffers(40, alpha=1.0, beta=1.0, eps=0.0)[0]
            again.load_state_dict(rbs[0].state_dict())
            rbs[0] = again


def test_a_buffer_filled_part_way_weighs_and_draws_over_its_rows_only(tmp_path):
    """The mass and the smallest priority over the filled rows (torchrl queries ``[0, len)``), before and after a
    round trip through disk, with rows past the fill written by an explicit update."""
    rbs = buffers(5000, alpha=0.9, beta=0.7)
    g = torch.Generator().manual_seed(5)
    for rb in rbs:
        rb.extend(data(0, 10))
        rb.update_priority(torch.tensor([4900, 4901]), torch.tensor([50.0, 1e-3]))  # past the filled rows
    for step in range(6):
        for rb in rbs:
            rb.extend(data(step * 300, 300))
        idx = torch.randint(0, len(rbs[0]), (40,), generator=g)
        prio = torch.rand(40, generator=g) * 4
        for rb in rbs:
            rb.update_priority(idx, prio)
        assert_same(*sample_both(rbs, step))
        if step == 3:
            for i, rb in enumerate(rbs):
                rb.dumps(tmp_path / str(i))
                rb.loads(tmp_path / str(i))


@pytest.mark.parametrize("boundary", ["pad", "stop", "include_reset"])
def test_torchrls_sequence_stage_on_the_plug_in_matches_torchrls_sampler(boundary):
    """torchrl's ``Sequence`` sample unit expands the plug-in's anchors into windows (burn-in, bootstrap,
    dilation, masks) and writes the max over each window's valid records back to its anchor, as on torchrl's."""
    from torchrl.data import Sequence

    unit = dict(length=3, burn_in=1, bootstrap=1, dilation=2, episode_boundary=boundary)
    rbs = [TensorDictReplayBuffer(storage=LazyTensorStorage(50), sampler=cls(50, alpha=0.8, beta=0.6),
                                  batch_size=6, sample_unit=Sequence(**unit))
           for cls in (PrioritizedSampler, ReferenceSampler)]
    g = torch.Generator().manual_seed(2)
    for step in range(10):
        n = 17
        done = (torch.rand(n, 1, generator=g) < 0.15)
        td = TensorDict({"obs": torch.arange(step * n, (step + 1) * n, dtype=torch.float32),
                         ("next", "done"): done}, batch_size=[n])
        for rb in rbs:
            rb.extend(td)
        a, b = sample_both(rbs, step)
        assert_same(a, b)
        for key in ("anchor_index", "validity_mask", "learning_mask"):
            assert torch.equal(a[key], b[key]), key
        td_error = torch.rand(a.shape[0], generator=g) * 3
        for rb, s in zip(rbs, (a, b), strict=True):
            s.set("td_error", td_error)
            rb.update_tensordict_priority(s)
    for seed in range(5):
        assert_same(*sample_both(rbs, 50 + seed))


@pytest.mark.parametrize(("alpha", "bad", "torchrl_draw_raises"), [
    (0.6, -1.0, True), (1.0, -1.0, True), (2.0, -1.0, False), (0.6, -1e-9, False), (0.6, float("nan"), True),
    (0.6, float("inf"), True), (2.0, 1e30, True)])
def test_an_invalid_priority_is_refused_with_nothing_written_and_draws_go_on_as_torchrls(alpha, bad,
                                                                                         torchrl_draw_raises):
    """A negative, NaN or infinite priority, or one whose ``(p + eps) ** alpha`` leaf overflows float32, is refused
    before anything is written (torchrl's sampler stores it, and its next draw raises unless alpha makes the leaf
    positive and finite); the plug-in then draws and weighs as torchrl's sampler that never got the refused
    update."""
    rbs = buffers(32, alpha=alpha, beta=0.4)
    g = torch.Generator().manual_seed(7)
    prio = torch.rand(32, generator=g) + 0.1
    for rb in rbs:
        rb.extend(data(0, 32))
        rb.update_priority(torch.arange(32), prio)
    plug = rbs[0].sampler
    before, default = plug._sum_tree.leaves.clone(), float(plug.default_priority)  # noqa: SLF001
    with pytest.raises(ValueError, match=r"priority: expected finite priorities >= 0 .*; nothing was written"):
        rbs[0].update_priority(torch.tensor([3, 5]), torch.tensor([50.0, bad]))
    assert torch.equal(plug._sum_tree.leaves, before)  # noqa: SLF001
    assert float(plug.default_priority) == default  # the refused update's 50 is not the new maximum
    for seed in range(5):
        assert_same(*sample_both(rbs, seed))
    reference = buffers(32, alpha=alpha, beta=0.4)[1]
    reference.extend(data(0, 32))
    reference.update_priority(torch.tensor([3, 5]), torch.tensor([50.0, bad]))  # torchrl accepts it
    np.random.seed(0)
    if torchrl_draw_raises:
        with pytest.raises((OverflowError, RuntimeError)):
            reference.sample()
    else:
        reference.sample()


def test_nan_leaves_loaded_from_torchrls_files_are_forgotten_once_rewritten(tmp_path):
    """Leaves torchrl's sampler stored from a NaN priority, loaded from its files: both samplers raise on a draw
    until those leaves are rewritten, then draw the same rows with the same finite weights (the kept minimum is
    recounted rather than kept NaN)."""
    rbs = buffers(16, alpha=0.6, beta=0.4)
    for rb in rbs:
        rb.extend(data(0, 16))
    rbs[1].update_priority(torch.tensor([2, 9]), torch.tensor([float("nan"), 3.0]))  # torchrl accepts it
    rbs[1].dumps(tmp_path / "ref")  # torchrl's own dumps
    rbs[0].loads(tmp_path / "ref")
    for rb in rbs:
        with pytest.raises(OverflowError):
            np.random.seed(0)
            rb.sample()
    for rb in rbs:
        rb.update_priority(torch.arange(16), torch.linspace(0.5, 2.0, 16))
    for seed in range(5):
        a, b = sample_both(rbs, seed)
        assert_same(a, b)
        assert torch.isfinite(a["priority_weight"]).all()
