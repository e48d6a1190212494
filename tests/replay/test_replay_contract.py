"""TransitionBuffer against its documented contract on both backends (triton runs through the interpreter on CPU)."""

import warnings

import numpy as np
import pytest
import torch
from fixtures import Model, check_windows, make_transition
from scipy import stats
from snapshots import assert_unchanged, snapshot

from gpubuf import TransitionBuffer


def build(E=3, M=10, n=2, B=4, device="cpu", **kw):
    return TransitionBuffer(M * E, B, make_transition(0, 1, E, **kw), n_steps=n, device=device, seed=0)


def test_public_names():
    import gpubuf

    assert {"Transition", "TransitionBuffer", "PrioritizedTransitionBuffer"} <= set(gpubuf.__all__)


def test_layout_and_nbytes(backend, device):
    buf = build(device=device)
    assert buf.state_dict()["data"]["observation"].shape == (10, 3, 2)  # time-major (M, E, ...)
    assert buf.nbytes >= 10 * 3 * (2 * 4 + 4 + 4 + 1 + 1 + 8)
    assert len(buf) == 0


def test_max_size_rounded_down_with_warning():
    with pytest.warns(UserWarning, match="max_size"):
        buf = TransitionBuffer(31, 2, make_transition(0, 1, 3), device="cpu")
    assert buf.max_rows == 10 and buf.max_size == 30


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("with_next_obs", [False, True])
def test_windows_contiguous_valid_and_shifted(backend, device, n, with_next_obs):
    E, M = 3, 7
    buf = build(E=E, M=M, n=n, device=device)
    model = Model(M, E, n)
    g = 0
    for T, tr in [(2, ()), (3, (3,)), (4, (7,)), (5, ()), (1, (15,))]:
        buf.insert(make_transition(g, T, E, trunc_steps=tr))
        model.insert(T, tr)
        g += T
        valid = model.valid_starts(with_next_obs)
        assert buf.num_valid(with_next_obs) == len(valid)
        if not valid:
            with pytest.raises(ValueError, match="no valid"):
                buf.sample(with_next_obs=with_next_obs)
            continue
        out = buf.sample(key=g, batch_size=16, with_next_obs=with_next_obs)
        lead = (16, n) if n > 1 else (16,)
        assert out.observation.shape == lead + (2,) and out.reward.shape == lead
        assert out.info["step"].dtype == torch.int64
        check_windows(out, None, model, with_next_obs)


def test_flat_layout(backend, device):
    buf = TransitionBuffer(8, 3, make_transition(0, 1, 1, vectorized=False), vectorized_env=False, n_steps=2,
                           device=device)
    model = Model(8, 1, 2)
    buf.insert(make_transition(0, 5, 1, vectorized=False)).insert(make_transition(5, 6, 1, vectorized=False))
    model.insert(11)
    assert buf.state_dict()["data"]["observation"].shape == (8, 2)
    out = buf.sample(key=1, batch_size=6, with_next_obs=True)
    assert out.observation.shape == (6, 2, 2)
    check_windows(out, None, model, True)


def test_multi_agent_nested_leaves(backend, device):
    E, M = 2, 6
    buf = TransitionBuffer(M * E, 3, make_transition(0, 1, E, multi_agent=True), n_steps=2, device=device)
    model = Model(M, E, 2)
    buf.insert(make_transition(0, 5, E, multi_agent=True))
    model.insert(5)
    out = buf.sample(key=2, batch_size=5, with_next_obs=True)
    assert out.observation["a1"]["pos"].shape == (5, 2, 1)
    assert torch.equal(out.observation["a1"]["pos"], out.observation["a0"][..., :1] + 0.5)
    assert torch.equal(out.next_observation["a1"]["pos"], out.observation["a1"]["pos"] + E)
    check_windows(out, None, model, True)


def test_stored_next_observation_is_returned(backend, device):
    def tr(g0, T):
        t = make_transition(g0, T, 2)
        t.next_observation = t.observation * -1
        return t

    buf = TransitionBuffer(8, 2, tr(0, 1), n_steps=1, device=device)
    buf.insert(tr(0, 4))
    out = buf.sample(key=0, batch_size=8, with_next_obs=True)  # stored: all 8 starts valid, no shift
    assert buf.num_valid(True) == 8
    assert torch.equal(out.next_observation, -out.observation)


def test_without_replacement_distinct(backend, device):
    buf = build(E=2, M=6, n=2, device=device)
    buf.insert(make_transition(0, 6, 2))
    assert buf.num_valid() == 10
    out = buf.sample(key=3, with_replacement=False, batch_size=10)
    v = out.reward[:, 0].tolist()
    assert len(set(v)) == 10
    with pytest.raises(ValueError, match="batch_size"):
        buf.sample(with_replacement=False, batch_size=11)


def test_keys_generator_int_none(backend, device):
    buf = build(device=device)
    buf.insert(make_transition(0, 8, 3))
    a = buf.sample(key=5).reward
    b = buf.sample(key=torch.Generator(device=device).manual_seed(5)).reward
    assert torch.equal(a, b)
    buf.sample()  # own generator
    with pytest.raises(TypeError, match="key"):
        buf.sample(key="seed")
    with pytest.raises(ValueError, match=r"key: an int seed must lie in \[-2\*\*63, 2\*\*64\), got 1844674"):
        buf.sample(key=2**64)


@pytest.mark.parametrize("prioritized", [False, True])
@pytest.mark.parametrize("seed, error, match", [
    (True, TypeError, "seed: expected an int seed or None, got bool"),
    (1.5, TypeError, "seed: expected an int seed or None, got float"),
    ("x", TypeError, "seed: expected an int seed or None, got str"),
    (2**64, ValueError, r"seed: an int seed must lie in \[-2\*\*63, 2\*\*64\), got 1844674"),
])
def test_a_bad_seed_is_refused_before_anything_is_made(prioritized, seed, error, match, tmp_path):
    from gpubuf import PrioritizedTransitionBuffer

    cls = PrioritizedTransitionBuffer if prioritized else TransitionBuffer
    with pytest.raises(error, match=match):
        cls(30, 4, make_transition(0, 1, 3), seed=seed, storage_dir=tmp_path / "buf")
    assert not (tmp_path / "buf").exists()
    a = cls(30, 4, make_transition(0, 1, 3), seed=np.int64(7)).insert(make_transition(0, 8, 3))
    b = cls(30, 4, make_transition(0, 1, 3), seed=7).insert(make_transition(0, 8, 3))
    assert torch.equal(a.sample(return_indices=False).reward, b.sample(return_indices=False).reward)


def test_state_dict_round_trip(backend, device):
    buf = build(device=device)
    buf.insert(make_transition(0, 8, 3, trunc_steps=(5,))).insert(make_transition(8, 5, 3))
    state = buf.state_dict()
    other = build(device=device)
    other.load_state_dict(state)
    assert torch.equal(buf.sample(with_next_obs=True).observation, other.sample(with_next_obs=True).observation)
    for wno in (False, True):
        assert torch.equal(buf.sampling_mass(wno), other.sampling_mass(wno))
    buf.insert(make_transition(13, 2, 3))
    other.insert(make_transition(13, 2, 3))
    assert buf.num_valid(True) == other.num_valid(True)


def test_uniform_chi_square():
    """With replacement, starts are uniform over the valid ones (the seam and truncations excluded)."""
    E, M, n = 3, 9, 3
    buf = build(E=E, M=M, n=n)
    model = Model(M, E, n)
    buf.insert(make_transition(0, 7, E)).insert(make_transition(7, 6, E, trunc_steps=(10,)))
    model.insert(13, (10,))
    valid = sorted(model.valid_starts(True))
    out = buf.sample(key=7, batch_size=30000, with_next_obs=True)
    v = out.observation[:, 0, 0].double()
    flat = (((v // E) % M) * E + v % E).long()
    counts = torch.bincount(flat, minlength=M * E).numpy()
    assert counts[[i for i in range(M * E) if i not in valid]].sum() == 0
    assert stats.chisquare(counts[valid]).pvalue > 1e-4


@pytest.mark.parametrize("trunc, with_next_obs, rows", [((), True, 13), ((), False, 5), ((10,), False, 13),
                                                        ((10,), True, 13), ((), True, 30)])
def test_uniform_chi_square_on_every_path(trunc, with_next_obs, rows, device):
    """Exact uniform sampling whether it descends the tree (truncations stored and next observations inferred)
    or draws from the ring range of rows directly (every other case), before and after the ring wraps. The
    draw is backend-independent torch code (the window gather it feeds is tested per backend elsewhere)."""
    E, M, n = 3, 9, 3
    buf = build(E=E, M=M, n=n, device=device)
    model = Model(M, E, n)
    buf.insert(make_transition(0, min(rows, 7), E))
    if rows > 7:
        for g0 in range(7, rows, 6):
            buf.insert(make_transition(g0, min(6, rows - g0), E, trunc_steps=trunc))
    model.insert(rows, trunc)
    valid = sorted(model.valid_starts(with_next_obs))
    assert buf.num_valid(with_next_obs) == len(valid)
    out = buf.sample(key=3, batch_size=20000, with_next_obs=with_next_obs)
    v = out.observation[:, 0, 0].double().cpu()
    flat = (((v // E) % M) * E + v % E).long()
    counts = torch.bincount(flat, minlength=M * E).numpy()
    assert counts[[i for i in range(M * E) if i not in valid]].sum() == 0
    assert stats.chisquare(counts[valid]).pvalue > 1e-4


def test_without_replacement_inclusion_uniform():
    E, M = 2, 8
    buf = build(E=E, M=M, n=1)
    buf.insert(make_transition(0, 8, E))
    counts = np.zeros(16)
    for s in range(400):
        out = buf.sample(key=s, with_replacement=False, batch_size=4)
        counts[out.reward.long().numpy() % 16] += 1
    assert stats.chisquare(counts).pvalue > 1e-4


# ---------------------------------------------------------------- bad input: message names it, nothing written


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_size=0), "max_size"),
    (dict(max_size=2), r"max_size: expected at least one row per env \(3 envs\), got 2"),
    (dict(sample_batch_size=0), "sample_batch_size"),
    (dict(n_steps=0), "n_steps"),
    (dict(n_steps=11), "n_steps"),
    (dict(sample_batch_size=28), "sample_batch_size"),  # E*(M-n+1) = 3*9 = 27
])
def test_bad_constructor(kwargs, match):
    args = dict(max_size=30, sample_batch_size=4, data_sample=make_transition(0, 1, 3), n_steps=2, device="cpu")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        TransitionBuffer(**args)


def test_bad_data_sample():
    with pytest.raises(TypeError, match="data_sample"):
        TransitionBuffer(30, 4, {"observation": torch.zeros(1, 3)}, device="cpu")
    bad = make_transition(0, 1, 3)
    bad.reward = torch.zeros(1, 4)
    with pytest.raises(ValueError, match="env axis"):
        TransitionBuffer(30, 4, bad, device="cpu")


def _bad_inserts():
    t = make_transition(0, 2, 3)
    wrong_env = make_transition(0, 2, 3)
    wrong_env.action = torch.zeros(2, 4)
    wrong_T = make_transition(0, 2, 3)
    wrong_T.reward = torch.zeros(3, 3)
    wrong_dtype = make_transition(0, 2, 3)
    wrong_dtype.terminated = torch.zeros(2, 3)  # float -> bool is not a safe cast
    missing = make_transition(0, 2, 3)
    missing.info = {}
    extra = make_transition(0, 2, 3)
    extra.info = {"step": t.info["step"], "other": t.reward}
    too_long = make_transition(0, 11, 3)
    string = make_transition(0, 2, 3)
    string.reward = "abc"
    return [
        (wrong_env, ValueError, "action"),
        (wrong_T, ValueError, "reward"),
        (wrong_dtype, TypeError, "terminated"),
        (missing, ValueError, "missing"),
        (extra, ValueError, "unexpected"),
        (too_long, ValueError, "T <= 10"),
        (string, TypeError, "reward"),
        ({"observation": 1}, TypeError, "transition"),
    ]


@pytest.mark.parametrize("i", range(8))
def test_bad_insert_writes_nothing(i):
    buf = build()
    buf.insert(make_transition(0, 4, 3))
    buf.sample()  # the tree is built
    before, mass = snapshot(buf), buf.sampling_mass()
    bad, exc, match = _bad_inserts()[i]
    with pytest.raises(exc, match=match):
        buf.insert(bad)
    assert_unchanged(buf, before)
    assert torch.equal(mass, buf.sampling_mass())


def test_bad_sample_args():
    buf = build()
    with pytest.raises(ValueError, match="no valid"):
        buf.sample()
    buf.insert(make_transition(0, 3, 3))
    with pytest.raises(ValueError, match="batch_size"):
        buf.sample(batch_size=0)
    with pytest.raises(ValueError, match="batch_size"):
        buf.sample(batch_size=7, with_replacement=False)  # 2 rows * 3 envs valid


def test_load_state_dict_mismatch():
    buf = build()
    other = build(n=3)
    with pytest.raises(ValueError, match="n_steps"):
        other.load_state_dict(buf.state_dict())


def test_numpy_inputs_copied():
    buf = build()
    tr = make_transition(0, 4, 3)
    arr = tr.reward.numpy().copy()
    tr.reward = arr
    buf.insert(tr)
    arr[:] = -1  # the caller overwrites its array: storage keeps the inserted values
    assert (buf.state_dict()["data"]["reward"][:4] >= 0).all()


def test_no_warning_when_divisible():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build()


def test_allocation_failure_names_bytes_and_device():
    with pytest.raises(MemoryError, match=r"bytes .* on cpu"):
        TransitionBuffer(2**42 * 3, 4, make_transition(0, 1, 3), device="cpu")


def test_insert_returns_self_and_len():
    buf = build()
    assert buf.insert(make_transition(0, 4, 3)) is buf
    assert len(buf) == 12


def test_sample_into_out(backend, device):
    buf = build(n=3, device=device)
    buf.insert(make_transition(0, 9, 3))
    ref = buf.sample(key=4, batch_size=5, with_next_obs=True)
    out = buf.sample(key=4, batch_size=5, with_next_obs=True)  # a Transition of the right tensors
    for t in (out.observation, out.reward, out.next_observation):
        t.zero_()
    got = buf.sample(key=4, batch_size=5, with_next_obs=True, out=out)
    assert got is out
    assert torch.equal(out.observation, ref.observation) and torch.equal(out.next_observation, ref.next_observation)
    assert torch.equal(out.info["step"], ref.info["step"])
    out.reward = torch.zeros(5, 2)
    with pytest.raises(ValueError, match=r"out\.reward"):
        buf.sample(batch_size=5, with_next_obs=True, out=out)
