"""HistoryBuffer's steady-state paths (all envs in lockstep, the last accepted input signature,
cached get plans, reused large outputs): every call that leaves the steady state gives what the
checked path gives. The reference buffer is driven with explicit ``env_ids`` (never the lockstep
path)."""

import numpy as np
import pytest
import torch
from fixtures import assert_gets_equal

from gpubuf import HistoryBuffer
from gpubuf.history.lockstep import Lockstep

E, ML, AB = 4, 6, 2
ALL = np.arange(E)


def pair(block_keys=("action",), max_len=ML, ab=AB, n_envs=E):
    return (HistoryBuffer(n_envs, max_len, ab, block_keys, device="cpu"),
            HistoryBuffer(n_envs, max_len, ab, block_keys, device="cpu"))


def info(t, rows=E, nan=False):
    action = np.full((rows, 1, 2), t + 0.5, np.float32)
    if nan:
        action[0, 0, 0] = np.nan
    return {"obs": np.arange(rows * 3, dtype=np.float32).reshape(rows, 1, 3) + 10 * t,
            "action": action}



def spy(monkeypatch, name):
    """Record, per call of the steady-state method ``Lockstep.name``, whether it served the call."""
    orig, hits = vars(Lockstep)[name], []

    def wrapped(self, *args):
        result = orig(self, *args)
        hits.append(result is not None and result is not False)
        return result

    monkeypatch.setattr(Lockstep, name, wrapped)
    return hits


def both_get(fast, ref, n, keys=None):
    got = fast.get(n, keys=keys)
    assert_gets_equal(got, ref.get(n, env_ids=ALL, keys=keys))
    return got


def test_lockstep_appends_then_a_new_dtype_still_checks_and_casts(monkeypatch):
    appends = spy(monkeypatch, "append")
    fast, ref = pair()
    for t in range(20):
        fast.append(info(t))
        ref.append(info(t), env_ids=ALL)
    assert sum(appends) == 19  # all but the first took the steady state
    bad = {**info(20), "obs": np.full((E, 1, 3), 1e300)}  # float64 too large for float32
    before = fast.get(3)
    with pytest.raises(TypeError, match="obs"):
        fast.append(bad)
    assert_gets_equal(fast.get(3), before)  # nothing written
    wide = {k: v.astype(np.float64) for k, v in info(20).items()}  # fits: cast as before
    fast.append(wide)
    ref.append(wide, env_ids=ALL)
    both_get(fast, ref, 3)
    fast.append(info(21))  # back to the first signature
    ref.append(info(21), env_ids=ALL)
    for n in (1, 2, 3, 5):
        both_get(fast, ref, n)


def test_lockstep_append_with_a_changed_shape_or_key_raises_and_writes_nothing():
    fast, _ = pair()
    for t in range(8):
        fast.append(info(t))
    before = fast.get(3)
    with pytest.raises(ValueError, match="obs"):
        fast.append({**info(8), "obs": np.zeros((E, 1, 4), np.float32)})
    with pytest.raises(ValueError, match="missing"):
        fast.append({"obs": info(8)["obs"]})
    with pytest.raises(TypeError, match="action"):
        fast.append({**info(8), "action": torch.zeros(E, 1, 2, dtype=torch.complex64)})
    assert_gets_equal(fast.get(3), before)


def test_subset_appends_resets_and_rollback_match_the_checked_path(monkeypatch):
    appends, gets = spy(monkeypatch, "append"), spy(monkeypatch, "get")
    rng = np.random.default_rng(0)
    fast, ref = pair()
    for t in range(300):
        op = rng.integers(0, 10)
        if op < 6:
            fast.append(info(t, nan=t % 3 == 0))
            ref.append(info(t, nan=t % 3 == 0), env_ids=ALL)
        elif op == 6:  # a subset, then the others: heads back in lockstep
            ids = rng.choice(E, rng.integers(1, E), replace=False)
            fast.append(info(t, len(ids)), env_ids=ids)
            ref.append(info(t, len(ids)), env_ids=ids)
            n = int(rng.integers(1, 6))
            both_get(fast, ref, n)
            rest = np.setdiff1d(ALL, ids)
            fast.append(info(t, len(rest)), env_ids=rest)
            ref.append(info(t, len(rest)), env_ids=rest)
        elif op == 7:
            ids = None if rng.random() < 0.3 else rng.choice(E, 2, replace=False)
            fast.reset(ids)
            ref.reset(ids)
        elif op == 8:
            mark, mark_ref = fast.mark(), ref.mark()
            for s in range(3):
                fast.append(info(1000 + s))
                ref.append(info(1000 + s), env_ids=ALL)
            fast.rollback(mark)
            ref.rollback(mark_ref)
        n = int(rng.integers(1, 6))
        both_get(fast, ref, n)
        both_get(fast, ref, n, keys=("action",))
        both_get(fast, ref, n, keys=["obs"])
    assert sum(appends) > 50 and sum(gets) > 150  # the steady state was exercised, and left
    assert not all(gets)


def test_lockstep_get_into_out_and_bad_out():
    fast, ref = pair()
    for t in range(9):
        fast.append(info(t))
        ref.append(info(t), env_ids=ALL)
    out = {k: torch.empty_like(v) for k, v in fast.get(3).items()}
    for _ in range(2):
        res = fast.get(3, out=out)
        assert res["obs"] is out["obs"] and res["action"] is out["action"]
        assert_gets_equal(res, ref.get(3, env_ids=ALL))
    shared = {"obs": out["obs"], "action": out["obs"].view(-1)[:out["action"].numel()]
              .view(torch.float32).view(out["action"].shape)}
    with pytest.raises(ValueError, match="shares memory"):
        fast.get(3, out=shared)
    with pytest.raises(ValueError, match=r"out\['obs'\]"):
        fast.get(3, out={**out, "obs": out["obs"].double()})
    with pytest.raises(ValueError, match="not stored"):
        fast.get(3, keys=("nope",))


def test_lockstep_inputs_reading_the_storage_or_requiring_grad_are_copied():
    fast, ref = pair(block_keys=())
    for t in range(8):
        v = {"obs": torch.full((E, 1, 3), float(t)), "action": torch.full((E, 1, 2), float(t))}
        fast.append(v)
        ref.append(v, env_ids=ALL)
    own = {k: t.view(ML, E, *t.shape[1:])[0].unsqueeze(1)
           for k, t in fast.state_dict()["data"].items()}
    own = {"obs": own["obs"].view(E, 1, 3), "action": own["action"].view(E, 1, 2)}
    ref_own = {k: v.clone() for k, v in own.items()}
    fast.append(own)
    ref.append(ref_own, env_ids=ALL)
    both_get(fast, ref, 3)
    grad = {"obs": torch.ones(E, 1, 3, requires_grad=True), "action": torch.ones(E, 1, 2)}
    fast.append(grad)
    ref.append(grad, env_ids=ALL)
    assert not any(t.requires_grad for t in fast.state_dict()["data"].values())
    both_get(fast, ref, 3)


def test_large_outputs_are_never_handed_out_twice_while_held():
    n_envs = 64
    fast, ref = pair(block_keys=(), n_envs=n_envs, max_len=4, ab=1)
    big = {"pix": np.zeros((n_envs, 1, 128, 128), np.uint8)}
    for t in range(4):
        big["pix"][:] = t
        fast.append(big)
        ref.append(big, env_ids=np.arange(n_envs))
    a = fast.get(3)  # 3 MiB: a large output
    a_np = fast.get(3)["pix"].numpy()  # only a numpy array holds this one
    view = fast.get(3)["pix"][1:]  # only a view holds this one
    before = (a["pix"].clone(), a_np.copy(), view.clone())
    for t in range(4, 8):
        big["pix"][:] = t
        fast.append(big)
        ref.append(big, env_ids=np.arange(n_envs))
        got = fast.get(3)
        assert_gets_equal(got, ref.get(3, env_ids=np.arange(n_envs)))
        ptr = got["pix"].data_ptr()
        assert ptr not in (a["pix"].data_ptr(), view.data_ptr() - view.storage_offset())
        del got
    assert torch.equal(a["pix"], before[0]) and np.array_equal(a_np, before[1])
    assert torch.equal(view, before[2])
