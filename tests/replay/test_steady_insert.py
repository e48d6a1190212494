"""The replay insert's steady-state path (numpy arrays with the last accepted signature, host storage):
the same rows, flags and validity as the checked path; anything else falls back to the checked path."""

import numpy as np
import pytest
import torch
from fixtures import index_rows

from gpubuf import PrioritizedTransitionBuffer, Transition, TransitionBuffer

E = 4


def rows(t0: int, T: int, trunc_every: int = 0, dtype=np.float32) -> Transition:
    tr = index_rows(T, E, t0, obs_dim=3, int_action=True, info=True)  # value = step * E + env
    tr.observation = tr.observation.astype(dtype)
    tr.terminated = tr.action % 7 == 0
    if trunc_every:
        tr.truncated = (np.arange(t0, t0 + T)[:, None] % trunc_every == trunc_every - 1).repeat(E, 1)
    return tr


def checked_only(monkeypatch):
    """Make every insert take the checked path."""
    from gpubuf.replay import steady_insert

    monkeypatch.setattr(steady_insert.SteadyInsert, "match", lambda self, transition, owned: None)


@pytest.mark.parametrize("cls", [TransitionBuffer, PrioritizedTransitionBuffer])
def test_steady_inserts_match_checked_ones(cls, monkeypatch):
    def run():
        buf = cls(E * 32, 8, rows(0, 1), n_steps=2, device="cpu", seed=0)
        for t in range(0, 90, 3):
            buf.insert(rows(t, 3, trunc_every=5))
        return buf

    steady = run()
    checked_only(monkeypatch)
    checked = run()
    a, b = steady.state_dict(), checked.state_dict()
    for name in a["data"]:
        assert torch.equal(a["data"][name], b["data"][name]), name
    assert torch.equal(a["trunc"], b["trunc"]) and a["pos"] == b["pos"] and a["count"] == b["count"]
    for kind in steady.ring.kinds:
        assert steady.num_valid(kind & 1 == 1) == checked.num_valid(kind & 1 == 1)
    assert torch.equal(steady.sampling_mass(True), checked.sampling_mass(True))
    one, two = (buf.sample(key=3, with_next_obs=True, batch_size=8, with_replacement=True)
                for buf in (steady, checked))
    if isinstance(one, tuple):  # prioritized: (batch, indices)
        one, two = one[0], two[0]
    assert torch.equal(one.observation, two.observation)


def test_the_steady_path_skips_the_checks_and_a_new_signature_does_not(monkeypatch):
    buf = TransitionBuffer(E * 16, 4, rows(0, 1), device="cpu")
    buf.insert(rows(0, 2))
    calls = []
    original = type(buf.config).rows
    monkeypatch.setattr(type(buf.config), "rows", lambda self, t: calls.append(1) or original(self, t))
    buf.insert(rows(2, 2))
    assert calls == []  # same signature: steady
    buf.insert(rows(4, 3))  # another T: checked, then steady
    buf.insert(rows(7, 3))
    assert calls == [1]
    buf.insert(rows(10, 3, dtype=np.float64))  # another dtype (a value-checked cast): checked
    assert calls == [1, 1]
    assert buf.state_dict()["data"]["action"][:13, 0].tolist() == [t * E for t in range(13)]


def test_bad_input_after_steady_inserts_still_raises_and_writes_nothing():
    buf = TransitionBuffer(E * 16, 4, rows(0, 1), device="cpu")
    buf.insert(rows(0, 2)).insert(rows(2, 2))
    before = {k: v.clone() for k, v in buf.state_dict()["data"].items()}
    bad = rows(4, 2)
    bad.observation = bad.observation[:, :, :2]
    with pytest.raises(ValueError, match="observation: expected shape"):
        buf.insert(bad)
    big = rows(4, 2, dtype=np.float64)
    big.observation[0, 0, 0] = 1e300
    with pytest.raises(TypeError, match="observation"):
        buf.insert(big)
    after = buf.state_dict()
    assert after["pos"] == 4 and all(torch.equal(before[k], after["data"][k]) for k in before)


def test_arrays_reaching_the_storage_or_strided_take_the_checked_path():
    buf = TransitionBuffer(E * 16, 4, rows(0, 1), device="cpu")
    buf.insert(rows(0, 2)).insert(rows(2, 2))
    data = buf.storage.host  # numpy views of the storage itself
    own = Transition(observation=data[("observation",)][0:2], action=data[("action",)][0:2],
                     reward=data[("reward",)][0:2], terminated=data[("terminated",)][0:2],
                     truncated=data[("truncated",)][0:2], info={"id": data[("info", "id")][0:2]})
    assert buf._steady.match(own, buf._owned) is None
    buf.insert(own)  # rows 0..1 copied to rows 4..5
    got = buf.state_dict()["data"]["action"][:, 0].tolist()
    assert got[4:6] == got[0:2] == [0, E]
    strided = rows(6, 4)
    strided.observation = strided.observation[::2]
    strided.action, strided.reward = strided.action[::2], strided.reward[::2]
    strided.terminated, strided.truncated = strided.terminated[::2], strided.truncated[::2]
    strided.info = {"id": strided.info["id"][::2]}
    assert buf._steady.match(strided, buf._owned) is None
    buf.insert(strided)
    assert buf.state_dict()["data"]["action"][6:8, 0].tolist() == [6 * E, 8 * E]


def test_a_closed_storage_dir_refuses_a_steady_insert(tmp_path):
    buf = TransitionBuffer(E * 16, 4, rows(0, 1), device="cpu", storage_dir=tmp_path / "d")
    buf.insert(rows(0, 2)).insert(rows(2, 2))
    buf.close()
    with pytest.raises(ValueError, match="was closed"):
        buf.insert(rows(4, 2))


def test_views_of_arrays_owning_their_memory_stay_steady_and_views_of_the_storage_do_not():
    buf = TransitionBuffer(E * 16, 4, rows(0, 1), device="cpu")
    buf.insert(rows(0, 2)).insert(rows(2, 2))
    fresh = rows(4, 4)  # arrays that own their memory: sliced views of them cannot reach the storage
    half = Transition(observation=fresh.observation[:2], action=fresh.action[:2], reward=fresh.reward[:2],
                      terminated=fresh.terminated[:2], truncated=fresh.truncated[:2], info={"id": fresh.info["id"][:2]})
    assert buf._steady.match(half, buf._owned) is not None
    data = buf.storage.host
    twice = {p: np.asarray(a[0:2])[:] for p, a in data.items()}  # views of views of the storage
    own = Transition(observation=twice[("observation",)], action=twice[("action",)], reward=twice[("reward",)],
                     terminated=twice[("terminated",)], truncated=twice[("truncated",)],
                     info={"id": twice[("info", "id")]})
    assert buf._steady.match(own, buf._owned) is None
    buf.insert(own)
    got = buf.state_dict()["data"]["action"][:, 0].tolist()
    assert got[4:6] == got[0:2] == [0, E]
