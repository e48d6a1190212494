"""Generation-checked write-backs: ``sample(return_generations=True)``, ``update_priorities(...,
generations=)`` and ``update_rows`` never land on a row overwritten since the sample.

Rows are valued by index (``info["step"] = global step * E + env``), so a value written back onto the
wrong row shows: every write-back below writes a row's own id, and the check is that each stored value
is 0 (never written) or its row's id.
"""

import threading

import pytest
import torch
from fixtures import make_transition

from gpubuf import PrioritizedTransitionBuffer, Transition, TransitionBuffer

E, M = 3, 8


def rows(g0: int, T: int) -> Transition:
    """``T`` rows of global steps ``g0..``, with an info leaf ``latent`` (float32 (2,)) of zeros."""
    tr = make_transition(g0, T, E)
    tr.info["latent"] = torch.zeros(T, E, 2)
    return tr


def buffer(cls=PrioritizedTransitionBuffer, n_steps=1, **kw):
    buf = cls(E * M, 4, rows(0, 1), n_steps=n_steps, device="cpu", seed=0, **kw)
    return buf


def ids_of(buf, idx):
    """The ``info["step"]`` ids of flat starts ``idx``."""
    env, row, _ = buf.locate(idx)
    return buf.state_dict()["data"]["info['step']"][row, env]


def test_generations_are_the_rows_serials_and_stay_on_the_device():
    buf = buffer()
    buf.insert(rows(0, 5))
    batch, idx, gen = buf.sample(batch_size=16, with_replacement=True, return_generations=True)
    assert gen.dtype == torch.int64 and gen.device == idx.device and gen.shape == idx.shape
    serial = buf.locate(idx)[2]
    assert len(set((gen - serial).tolist())) == 1  # the rows' serials from the buffer's base
    # a uniform buffer returns them too
    ubuf = buffer(TransitionBuffer)
    ubuf.insert(rows(0, 5))
    assert len(ubuf.sample(return_generations=True)) == 3
    with pytest.raises(TypeError, match="return_generations: expected a bool"):
        ubuf.sample(return_generations=1)


def test_stale_priority_updates_are_dropped_and_counted():
    buf = buffer()
    buf.insert(rows(0, M))  # full: rows 0..7
    _, idx, gen = buf.sample(batch_size=12, with_replacement=True, return_generations=True)
    _, row, _ = buf.locate(idx)
    buf.insert(rows(M, 3))  # overwrites rows 0, 1, 2
    stale = row < 3
    assert stale.any() and (~stale).any(), "the draw must hit both kinds of rows"
    before = buf.state_dict()["priority"].clone()
    buf.update_priorities(idx, torch.full((12,), 5.0), generations=gen)
    assert buf.stale_updates == int(stale.sum())
    after = buf.state_dict()["priority"]
    torch.testing.assert_close(after[idx[stale]], before[idx[stale]])  # the newer rows keep theirs
    torch.testing.assert_close(after[idx[~stale]], torch.full((int((~stale).sum()),), 5.0 + buf.eps))
    buf.update_priorities(idx, torch.ones(12))  # without generations: every index written, as before
    assert buf.stale_updates == 0


def test_a_load_makes_every_earlier_generation_stale():
    buf = buffer()
    buf.insert(rows(0, 5))
    _, idx, gen = buf.sample(batch_size=4, return_generations=True)
    buf.load_state_dict(buf.state_dict())  # the same rows, replaced wholesale
    buf.update_priorities(idx, torch.ones(4), generations=gen)
    assert buf.stale_updates == 4
    _, idx2, gen2 = buf.sample(batch_size=4, return_generations=True)
    assert (gen2 > gen.max()).all()
    buf.update_priorities(idx2, torch.ones(4), generations=gen2)
    assert buf.stale_updates == 0


@pytest.mark.parametrize("n_steps", [1, 3])
def test_update_rows_writes_starts_or_windows_and_skips_recycled_rows(n_steps):
    buf = buffer(TransitionBuffer, n_steps=n_steps)
    buf.insert(rows(0, M))
    batch, idx, gen = buf.sample(batch_size=10, return_generations=True)
    ids = batch.info["step"].to(torch.float32)  # (B,) or (B, n): each row's own id
    buf.insert(rows(M, 2))  # overwrites rows 0 and 1
    stale = idx // E < 2
    value = torch.stack([ids, -ids], -1)
    buf.update_rows(idx, {"latent": value}, generations=gen)
    assert buf.stale_updates == int(stale.sum())
    data = buf.state_dict()["data"]
    latent, step = data["info['latent']"], data["info['step']"].to(torch.float32)
    written = latent[..., 0] != 0
    assert written.any()
    torch.testing.assert_close(latent[..., 0][written], step[written])  # only onto its own row
    torch.testing.assert_close(latent[..., 1][written], -step[written])
    fresh = idx[~stale]
    env, r = fresh % E, fresh // E
    for j in range(n_steps):  # every row of every fresh window (the start row only with n_steps=1)
        assert (latent[(r + j) % M, env, 0] == step[(r + j) % M, env]).all()


def test_update_rows_refuses_bad_input_and_writes_nothing():
    buf = buffer(TransitionBuffer, n_steps=2)
    buf.insert(rows(0, 4))
    _, idx, gen = buf.sample(batch_size=3, return_generations=True)
    good = torch.ones(3, 2)
    cases = [
        (dict(values={"observation": good}), ValueError, r"values: expected names of the buffer's info leaves "
                                                         r"\['latent', 'step'\]"),
        (dict(values={"latent": torch.ones(3, 3)}), ValueError, r"values\['latent'\]: expected shape \(3, 2\) or "
                                                                r"\(3, 2, 2\), got \(3, 3\)"),
        (dict(values={"step": torch.full((3,), 0.5)}), TypeError, r"values\['step'\]"),
        (dict(values={}), TypeError, "values: expected a non-empty dict"),
        (dict(values=[good]), TypeError, "values: expected a non-empty dict"),
        (dict(indices=idx.to(torch.float32)), TypeError, "indices: expected a 1-D integer array"),
        (dict(indices=torch.tensor([0, 1, E * M])), IndexError, r"indices: expected flat starts in \[0, 24\)"),
        (dict(indices=torch.tensor([0, 1, E * 6]), generations=None), IndexError, "not held"),
        (dict(generations=gen[:2]), ValueError, "generations: expected a 1-D integer array of 3 values"),
        (dict(generations=gen.to(torch.float64)), ValueError, "generations: expected a 1-D integer array"),
    ]
    before = {k: v.clone() for k, v in buf.state_dict()["data"].items()}
    for change, exc, match in cases:
        kw = {"indices": idx, "values": {"latent": good}, "generations": gen, **change}
        with pytest.raises(exc, match=match):
            buf.update_rows(kw["indices"], kw["values"], generations=kw["generations"])
    for k, v in buf.state_dict()["data"].items():
        torch.testing.assert_close(v, before[k], msg=k)


def test_update_priorities_refuses_misshapen_generations():
    buf = buffer()
    buf.insert(rows(0, 4))
    _, idx, gen = buf.sample(batch_size=3, return_generations=True)
    before = buf.state_dict()["priority"].clone()
    for bad in (gen[:1], gen.to(torch.float32), gen[:, None]):
        with pytest.raises(ValueError, match="generations: expected a 1-D integer array of 3 values"):
            buf.update_priorities(idx, torch.ones(3), generations=bad)
    with pytest.raises(IndexError, match="indices: expected flat starts"):
        buf.update_priorities(torch.tensor([0, 1, 99]), torch.ones(3), generations=gen)
    torch.testing.assert_close(buf.state_dict()["priority"], before)


def test_a_storage_dir_buffer_keeps_written_back_rows_across_a_reopen(tmp_path):
    buf = buffer(TransitionBuffer, storage_dir=tmp_path / "r")
    buf.insert(rows(0, 5))
    _, idx, gen = buf.sample(batch_size=4, return_generations=True)
    ids = ids_of(buf, idx).to(torch.float32)
    buf.update_rows(idx, {"latent": torch.stack([ids, ids], -1)}, generations=gen)
    buf.flush()
    buf.close()
    with pytest.raises(ValueError, match="was closed"):
        buf.update_rows(idx, {"latent": torch.zeros(4, 2)})
    again = buffer(TransitionBuffer, storage_dir=tmp_path / "r")
    data = again.state_dict()["data"]
    env, row = idx % E, idx // E
    torch.testing.assert_close(data["info['latent']"][row, env, 0], ids)
    again.update_rows(idx, {"latent": torch.zeros(4, 2)}, generations=gen)  # a re-open: all stale
    assert again.stale_updates == 4
    again.close()


def test_write_backs_from_a_learner_thread_never_land_on_rows_an_actor_thread_recycled():
    """An actor thread inserts while the learner samples, then writes back each row's own id: a write-back onto a
    recycled row would store another row's id."""
    buf = buffer(n_steps=1)
    buf.insert(rows(0, M))
    stop, inserted = threading.Event(), []

    def actor():
        g = M
        while not stop.is_set():
            buf.insert(rows(g, 1))
            g += 1
        inserted.append(g)

    t = threading.Thread(target=actor)
    t.start()
    try:
        for _ in range(300):
            batch, idx, gen = buf.sample(batch_size=8, with_replacement=True, return_generations=True)
            ids = batch.info["step"].to(torch.float32)
            for _ in range(3):  # let the actor run between sample and write-back
                threading.Event().wait(0)
            buf.update_rows(idx, {"latent": torch.stack([ids, ids], -1)}, generations=gen)
            buf.update_priorities(idx, ids + 1, generations=gen)
    finally:
        stop.set()
        t.join(10)
    data = buf.state_dict()["data"]
    latent, step = data["info['latent']"][..., 0], data["info['step']"].to(torch.float32)
    written = latent != 0
    torch.testing.assert_close(latent[written], step[written])
    assert inserted[0] > 3 * M, "the actor must recycle rows during the run"
