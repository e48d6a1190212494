"""Episode-aware sequence sampling: ``boundaries="allow" | "mask" | "forbid"`` on stored terminated and
truncated flags, with index-valued data (observation = step * E + env) so every window shows its rows."""

import numpy as np
import pytest
import torch
from fixtures import index_rows, make_transition
from scipy import stats

from gpubuf import PrioritizedTransitionBuffer, Transition, TransitionBuffer

E, M = 3, 24


def episodes(T: int, seed: int, t0: int = 0):
    """T rows of E envs; (terminated, truncated) set at random, including one-step episodes."""
    rng = np.random.default_rng(seed)
    term = rng.random((T, E)) < 0.15
    trunc = (rng.random((T, E)) < 0.08) & ~term
    if T > 4 and t0 == 0:
        term[3, 0] = term[4, 0] = True  # env 0: a one-step episode at row 4
    tr = index_rows(T, E, t0)
    tr.terminated, tr.truncated = term, trunc
    return tr, term | trunc, trunc


def build(cls, n, device, T=20, seed=0):
    buf = cls(E * M, 16, episodes(1, 0)[0], n_steps=n, device=device, seed=seed)
    tr, ends, trunc = episodes(T, seed)
    buf.insert(tr)
    return buf, ends, trunc


def brute_valid(ends, trunc, T, n, next_obs, forbid):
    """(T*E,) bool over flat starts (step * E + env) of rows 0..T-1 (no wrap)."""
    W = n + int(next_obs)
    ok = np.zeros((T, E), dtype=bool)
    for t in range(T - W + 1):
        row = np.ones(E, dtype=bool)
        if next_obs:
            row &= ~trunc[t:t + n].any(0)
        if forbid and n > 1:
            row &= ~ends[t:t + n - 1].any(0)
        ok[t] = row
    return ok.reshape(-1)


def rows_of(batch, n):
    steps = batch.observation[..., 0].cpu().numpy().astype(np.int64)  # (B, n) values
    return steps // E, steps % E


@pytest.mark.parametrize("prioritized", [False, True])
@pytest.mark.parametrize("next_obs", [False, True])
def test_forbid_draws_exactly_the_windows_inside_one_episode(backend, device, prioritized, next_obs):
    n, T = 4, 20
    buf, ends, trunc = build(PrioritizedTransitionBuffer if prioritized else TransitionBuffer, n, device, T)
    want = brute_valid(ends, trunc, T, n, next_obs, forbid=True)
    mass = buf.sampling_mass(next_obs, boundaries="forbid").cpu().numpy()[:T * E]
    np.testing.assert_array_equal(mass > 0, want)
    assert buf.num_valid(next_obs, boundaries="forbid") == want.sum()
    out = buf.sample(batch_size=64, with_replacement=True, with_next_obs=next_obs, boundaries="forbid")
    batch = out[0] if prioritized else out
    steps, envs = rows_of(batch, n)
    assert (envs == envs[:, :1]).all() and (np.diff(steps, axis=1) == 1).all()
    assert not ends[steps[:, :-1], envs[:, :-1]].any()  # no episode end before the last row
    assert batch.is_first.shape == (64, n) and batch.is_first[:, 0].all() and not batch.is_first[:, 1:].any()
    assert batch.mask.all()


def test_mask_marks_where_each_window_crosses_an_episode_end(backend, device):
    n, T = 5, 20
    buf, ends, _ = build(TransitionBuffer, n, device, T)
    assert buf.num_valid(boundaries="mask") == buf.num_valid() == (T - n + 1) * E  # crossing is allowed
    batch = buf.sample(batch_size=200, boundaries="mask", key=1)
    steps, envs = rows_of(batch, n)
    done = ends[steps, envs]  # (B, n) episode end per sampled row
    is_first, mask = batch.is_first.cpu().numpy(), batch.mask.cpu().numpy()
    assert is_first[:, 0].all() and (is_first[:, 1:] == done[:, :-1]).all()
    want_mask = np.concatenate([np.ones((200, 1), bool), np.cumprod(~done[:, :-1], axis=1).astype(bool)], 1)
    assert (mask == want_mask).all()
    assert (~mask).any() and mask.any(1).all()  # some windows cross, every window keeps its first step
    # the one-step episode of env 0 at row 4 can start a window here, never under "forbid"
    flat = 4 * E + 0
    assert buf.sampling_mass(boundaries="mask")[flat] > 0 and buf.sampling_mass(boundaries="forbid")[flat] == 0


def test_forbid_is_uniform_over_its_valid_starts():
    n, T = 3, 20
    buf, ends, trunc = build(TransitionBuffer, n, "cpu", T)
    want = brute_valid(ends, trunc, T, n, False, forbid=True)
    counts = np.zeros(E * M)
    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        batch = buf.sample(key=g, batch_size=100, boundaries="forbid")
        steps, envs = rows_of(batch, n)
        np.add.at(counts, steps[:, 0] * E + envs[:, 0], 1)
    assert counts[:T * E][~want].sum() == 0 and counts[T * E:].sum() == 0
    assert stats.chisquare(counts[:T * E][want]).pvalue > 1e-4


def test_prioritized_forbid_follows_priorities_among_its_starts():
    n, T = 3, 20
    buf, ends, trunc = build(PrioritizedTransitionBuffer, n, "cpu", T)
    g = torch.Generator().manual_seed(1)
    buf.update_priorities(torch.arange(E * M), torch.rand(E * M, generator=g) * 3)
    p = buf.sampling_mass(boundaries="forbid").numpy()
    assert ((p > 0)[:T * E] == brute_valid(ends, trunc, T, n, False, forbid=True)).all()
    counts = np.zeros(E * M)
    for _ in range(60):
        _, idx = buf.sample(key=g, batch_size=100, with_replacement=True, boundaries="forbid")
        np.add.at(counts, idx.numpy(), 1)
    keep = p > 0
    assert counts[~keep].sum() == 0
    assert stats.chisquare(counts[keep], p[keep] / p[keep].sum() * counts.sum()).pvalue > 1e-4


def test_validity_follows_wrapping_and_checkpoints(tmp_path):
    n = 3
    buf, _, _ = build(TransitionBuffer, n, "cpu", T=20)
    buf.insert(episodes(15, 5, t0=20)[0])  # wraps: rows 20..34 overwrite the oldest
    before = buf.sampling_mass(boundaries="forbid")
    buf.save(tmp_path / "b.ckpt")
    other = TransitionBuffer(E * M, 16, episodes(1, 0)[0], n_steps=n, device="cpu")
    other.load(tmp_path / "b.ckpt")
    assert torch.equal(other.sampling_mass(boundaries="forbid"), before)
    batch = other.sample(batch_size=50, boundaries="forbid")
    assert (batch.observation[:, 1:, 0] - batch.observation[:, :-1, 0] == E).all()  # never across the seam


def test_single_step_windows_carry_flat_flags():
    buf, _, _ = build(TransitionBuffer, 1, "cpu")
    batch = buf.sample(batch_size=7, boundaries="mask")
    assert batch.is_first.shape == (7,) and batch.is_first.all() and batch.mask.all()
    assert buf.num_valid(boundaries="forbid") == buf.num_valid()


def test_bad_boundaries_are_named_and_need_episode_flags():
    buf, _, _ = build(TransitionBuffer, 2, "cpu")
    with pytest.raises(ValueError, match="boundaries: expected one of"):
        buf.sample(boundaries="never")
    with pytest.raises(ValueError, match="boundaries: expected one of"):
        buf.num_valid(boundaries=None)
    plain = TransitionBuffer(40, 4, Transition(observation=np.zeros((1, 2, 3), np.float32), action=None,
                                                reward=np.zeros((1, 2), np.float32), terminated=None,
                                                truncated=None), n_steps=2, device="cpu")
    plain.insert(Transition(observation=np.zeros((5, 2, 3), np.float32), action=None,
                            reward=np.zeros((5, 2), np.float32), terminated=None, truncated=None))
    with pytest.raises(ValueError, match="boundaries: 'forbid' needs episode ends"):
        plain.sample(boundaries="forbid")
    assert plain.sample(boundaries="allow").is_first is None


# ------------------------------------------------------------------ provenance: indices and locate


def test_sample_returns_its_flat_starts_on_request_and_locate_maps_them_back(backend, device):
    buf, _, _ = build(TransitionBuffer, 3, device, T=20)
    buf.insert(episodes(15, 5, t0=20)[0])  # 35 rows written, 24 held: the ring wrapped
    assert isinstance(buf.sample(key=1), Transition)  # the default return is unchanged
    batch, idx = buf.sample(key=1, batch_size=50, return_indices=True)
    assert idx.shape == (50,) and idx.dtype == torch.int64 and idx.device.type == torch.device(device).type
    steps, envs = rows_of(batch, 3)
    env, row, step = buf.locate(idx)
    np.testing.assert_array_equal(env.cpu().numpy(), envs[:, 0])
    np.testing.assert_array_equal(step.cpu().numpy(), steps[:, 0])  # the env's own row count
    np.testing.assert_array_equal(row.cpu().numpy(), steps[:, 0] % M)  # the ring row
    np.testing.assert_array_equal(idx.cpu().numpy(), row.cpu().numpy() * E + env.cpu().numpy())
    per, _, _ = build(PrioritizedTransitionBuffer, 3, device, T=20)
    batch, idx = per.sample(key=2, batch_size=10)
    np.testing.assert_array_equal(per.locate(idx)[2].cpu().numpy(), rows_of(batch, 3)[0][:, 0])
    env, row, step = buf.locate(np.array([[0, 1], [E * M - 1, 5]]))  # any shape, host arrays
    assert env.shape == (2, 2) and env.tolist() == [[0, 1], [E - 1, 2]] and row.tolist() == [[0, 0], [M - 1, 1]]
    assert step.tolist() == [[24, 24], [23, 25]]  # ring row 0 holds row 24, ring row 23 row 23
    env, row, step = buf.locate(5)  # a scalar gives 0-d tensors, like the index
    assert env.shape == row.shape == step.shape == () and (env.item(), row.item(), step.item()) == (2, 1, 25)


def test_locate_and_return_indices_reject_bad_input():
    buf, _, _ = build(TransitionBuffer, 2, "cpu", T=10)  # 10 of 24 rows held
    with pytest.raises(TypeError, match="return_indices: expected a bool, got 1"):
        buf.sample(return_indices=1)
    with pytest.raises(TypeError, match="indices: expected integer flat starts, got torch.float32"):
        buf.locate(torch.zeros(2))
    with pytest.raises(IndexError, match=rf"indices: expected flat starts in \[0, {E * M}\), got \[-1, {E * M}\]"):
        buf.locate([-1, 0, E * M])
    with pytest.raises(IndexError, match=r"indices: rows \[10, 23\] are not held \(the buffer holds 10 rows per env\)"):
        buf.locate([10 * E, 23 * E + 1, 9 * E])


def test_rows_marked_is_last_never_start_a_window(backend, device):
    """A buffer with an info['is_last'] leaf (the source's rows): such rows (stored with truncated) never start a
    window, is_first follows them and the mask keeps them, for every boundaries value and both samplers."""
    T = 20
    rng = np.random.default_rng(3)
    last = rng.random((T, E)) < 0.2
    v = (np.arange(T)[:, None] * E + np.arange(E)).astype(np.float32)
    term = np.zeros((T, E), bool)
    term[:-1] = last[1:] & (rng.random((T - 1, E)) < 0.5)  # some episodes terminated, the others truncated
    rows = Transition(observation=v[..., None], action=v, reward=v, terminated=term, truncated=last,
                      info={"is_last": last})
    for cls in (TransitionBuffer, PrioritizedTransitionBuffer):
        buf = cls(E * M, 8, rows, n_steps=4, device=device, seed=0)
        buf.insert(rows)
        for boundaries in ("mask",) if backend == "triton" else ("allow", "mask", "forbid"):  # interpreted: slow
            out = buf.sample(key=1, batch_size=60, boundaries=boundaries, with_replacement=True)
            batch = out[0] if cls is PrioritizedTransitionBuffer else out
            steps, envs = rows_of(batch, 4)
            assert not last[steps[:, 0], envs[:, 0]].any()
            if boundaries == "mask":
                is_last = last[steps, envs]
                np.testing.assert_array_equal(batch.is_first[:, 1:].cpu().numpy(), is_last[:, :-1])
                np.testing.assert_array_equal(batch.mask.cpu().numpy(), np.cumsum(batch.is_first.cpu().numpy(), 1) == 1)
    n_ok = (T - 4 + 1) * E - int(last[:T - 3].sum())
    buf = TransitionBuffer(E * M, 8, rows, n_steps=4, device=device, seed=0).insert(rows)
    batch = buf.sample(key=2, batch_size=n_ok, with_replacement=False)  # every allowed start once
    starts = rows_of(batch, 4)[0][:, 0] * E + rows_of(batch, 4)[1][:, 0]
    assert len(set(starts.tolist())) == n_ok
    with pytest.raises(ValueError, match=f"batch_size: {n_ok + 1} exceeds the {n_ok} valid starts"):
        buf.sample(batch_size=n_ok + 1, with_replacement=False)
    # validity itself leaves them out: counts, masses and a GraphSampler's draws agree
    assert buf.num_valid() == n_ok
    mass = buf.sampling_mass().view(M, E)[:T].cpu().numpy()
    assert not mass[last].any() and int((mass > 0).sum()) == n_ok
    _, idx = buf.graph_sampler(batch_size=200, generator=torch.Generator(device=device).manual_seed(0)).sample()
    assert not last.reshape(-1)[idx.cpu().numpy()].any()


def test_has_transition_is_set_beside_the_flags_and_false_exactly_on_is_last_rows(backend, device):
    """``has_transition`` rides with ``is_first`` and ``mask``: False on the rows marked ``info["is_last"]`` (a flag
    leaf of any dtype: set where nonzero), which stay inside ``mask``; True on every row of a buffer without that
    leaf and on single-row windows; absent with ``"allow"``. ``refresh_flags`` recomputes it in place."""
    T = 20
    rng = np.random.default_rng(4)
    last = rng.random((T, E)) < 0.2
    v = (np.arange(T)[:, None] * E + np.arange(E)).astype(np.float32)
    marks = np.where(last, rng.integers(1, 5, (T, E)), 0).astype(np.int8)  # nonzero counts as set
    rows = Transition(observation=v[..., None], action=v, reward=v, terminated=np.zeros((T, E), bool), truncated=last,
                      info={"is_last": marks})
    buf = TransitionBuffer(E * M, 8, rows, n_steps=4, device=device, seed=0).insert(rows)
    for boundaries in ("mask", "forbid"):
        batch = buf.sample(key=1, batch_size=60, boundaries=boundaries)
        steps, envs = rows_of(batch, 4)
        assert batch.has_transition.dtype == torch.bool and batch.has_transition.shape == (60, 4)
        np.testing.assert_array_equal(batch.has_transition.cpu().numpy(), ~last[steps, envs])
        if boundaries == "mask":
            assert (batch.mask & ~batch.has_transition).any()
        batch.has_transition.fill_(False)
        buf.config.refresh_flags(batch)
        np.testing.assert_array_equal(batch.has_transition.cpu().numpy(), ~last[steps, envs])
    assert buf.sample(key=1, boundaries="allow").has_transition is None
    one = TransitionBuffer(E * M, 8, rows, device=device, seed=0).insert(rows)
    assert one.sample(key=1, boundaries="mask").has_transition.all()
    plain, _, _ = build(TransitionBuffer, 4, device)  # no is_last leaf: every row holds a transition
    assert plain.sample(key=2, boundaries="mask").has_transition.all()


def test_a_loaded_state_is_never_written_through_the_flags_it_was_read_from():
    """The ring keeps copies of the row flags a load or a re-open reads from the state's leaves."""
    T = 6
    v = np.zeros((T, E), np.float32)
    flags = np.zeros((T, E), bool)
    rows = Transition(observation=v[..., None], action=v, reward=v, terminated=flags.copy(), truncated=flags.copy(),
                      info={"is_last": flags.copy()})
    source = TransitionBuffer(E * M, 4, rows, n_steps=2, device="cpu").insert(rows)
    state = source.state_dict()
    before = {k: t.clone() for k, t in state["data"].items()}
    target = TransitionBuffer(E * M, 4, rows, n_steps=2, device="cpu")
    target.load_state_dict(state)
    ones = np.ones((M, E), bool)
    target.insert(Transition(observation=np.zeros((M, E, 1), np.float32), action=np.zeros((M, E), np.float32),
                             reward=np.zeros((M, E), np.float32), terminated=ones, truncated=ones,
                             info={"is_last": ones}))
    for k, t in source.state_dict()["data"].items():
        assert torch.equal(t, before[k]), k


@pytest.mark.parametrize("cls", [TransitionBuffer, PrioritizedTransitionBuffer])
def test_cut_episodes_marks_the_newest_row_as_a_load_would(cls):
    """cut_episodes() ends every env's episode at its newest row in place: validity, masses and marks are those of a
    buffer loaded from the same rows."""
    buf = cls(4 * 16, 8, make_transition(0, 1, 4), n_steps=3, device="cpu", seed=0)
    buf.cut_episodes()  # empty: nothing to do
    buf.insert(make_transition(0, 12, 4, trunc_steps=(6,)))
    buf.insert(make_transition(12, 8, 4))  # wrapped: 16 rows held
    buf.cut_episodes()
    newest = (buf.state_dict()["pos"] - 1) % 16
    assert buf.state_dict()["data"]["truncated"][newest].all()
    fresh = cls(4 * 16, 8, make_transition(0, 1, 4), n_steps=3, device="cpu", seed=0)
    fresh.load_state_dict(buf.state_dict())
    for with_next_obs in (False, True):
        for boundaries in ("allow", "mask", "forbid"):
            torch.testing.assert_close(buf.sampling_mass(with_next_obs, boundaries),
                                       fresh.sampling_mass(with_next_obs, boundaries))
    assert buf.num_valid(True) == fresh.num_valid(True) < buf.num_valid(False)
    np.testing.assert_array_equal(buf.episode_marks().marks.numpy(), fresh.episode_marks().marks.numpy())
    plain = TransitionBuffer(16, 4, Transition(observation=torch.zeros(1, 4, 2), action=torch.zeros(1, 4),
                                               reward=torch.zeros(1, 4), terminated=None, truncated=None), device="cpu")
    with pytest.raises(ValueError, match="cut_episodes: the buffer stores no truncated leaf"):
        plain.cut_episodes()


def test_cut_episodes_leaves_a_terminated_newest_row_alone():
    buf = PrioritizedTransitionBuffer(3 * 16, 8, make_transition(0, 1, 3), device="cpu", seed=0)
    tr = make_transition(0, 6, 3)
    tr.terminated[-1, 1] = True  # env 1's newest row ends its episode already
    buf.insert(tr)
    buf.cut_episodes()
    data = buf.state_dict()["data"]
    assert data["truncated"][5].tolist() == [True, False, True]
    buf.insert(make_transition(6, 2, 3))  # its successor is written: drawn with next observations (discount 0)
    mass = buf.sampling_mass(True)
    assert mass[5 * 3 + 1] > 0 and mass[5 * 3] == 0 and mass[5 * 3 + 2] == 0
    fresh = PrioritizedTransitionBuffer(3 * 16, 8, make_transition(0, 1, 3), device="cpu", seed=0)
    fresh.load_state_dict(buf.state_dict())
    torch.testing.assert_close(buf.sampling_mass(True), fresh.sampling_mass(True))


def time_limit_rows(start: int, T: int = 6) -> Transition:
    """Index rows of 3 envs where env 0 terminates on its time-limit step (terminated and truncated both set, as
    gymnasium's TimeLimit reports it) at rows 2 and 8, env 1 is truncated at row 8 and env 2 terminates there."""
    tr = index_rows(T, 3, start)
    term, trunc = np.zeros((T, 3), bool), np.zeros((T, 3), bool)
    for row, flags in ((2, ((0, True, True),)), (8, ((0, True, True), (1, False, True), (2, True, False)))):
        if start <= row < start + T:
            for env, te, tr_ in flags:
                term[row - start, env], trunc[row - start, env] = te, tr_
    tr.terminated, tr.truncated = term, trunc
    return tr


@pytest.mark.parametrize("cls", [TransitionBuffer, PrioritizedTransitionBuffer])
def test_a_row_both_terminated_and_truncated_is_drawn_as_a_terminal_transition(backend, device, cls):
    """A termination on the time-limit step needs no successor: it is a valid start with next observations, n-step
    returns and stacks (discount 0, terminated), uniform and prioritized, through the checked and steady inserts;
    a truncation alone is still never drawn with a next observation."""
    buf = cls(3 * 16, 8, time_limit_rows(0, 1), device=device, seed=0)
    buf.insert(time_limit_rows(0))
    buf.insert(time_limit_rows(6))  # the same numpy layout: a host buffer's steady path
    mass = buf.sampling_mass(True).cpu()
    assert mass[2 * 3] > 0 and mass[8 * 3] > 0 and mass[8 * 3 + 2] > 0 and mass[8 * 3 + 1] == 0
    assert buf.num_valid(True) == 3 * 11 - 1
    for kw in ({"with_next_obs": True}, {"n_step_return": (3, 0.5)}, {"n_step_return": (3, 0.5), "frame_stack": 2}):
        batch, idx = buf.sample(batch_size=400, with_replacement=True, return_indices=True, key=1, **kw)
        idx = idx.cpu()
        for flat in (2 * 3, 8 * 3):
            hit = idx == flat
            assert hit.any(), (kw, flat)
            assert batch.terminated.cpu()[hit].all() and batch.reward.cpu()[hit].eq(flat).all()
            if "n_step_return" in kw:
                assert batch.discount.cpu()[hit].eq(0).all() and not batch.truncated.cpu()[hit].any()
        before = (idx == 3) | (idx == 7 * 3)  # returns from the row before take its reward and stop there
        if "n_step_return" in kw:
            assert before.any() and batch.discount.cpu()[before].eq(0).all()
            assert batch.reward.cpu()[before].tolist() == [3 + 3.0 if i == 3 else 21 + 12.0 for i in idx[before]]
        assert not (idx == 8 * 3 + 1).any()


def test_a_state_dict_counting_terminal_time_limit_rows_as_truncations_loads():
    """A state dict whose ``trunc`` also sets the rows both terminated and truncated (as earlier releases saved
    them) loads, and those rows are drawn as terminal transitions."""
    buf = TransitionBuffer(3 * 16, 8, time_limit_rows(0, 1), device="cpu", seed=0)
    buf.insert(time_limit_rows(0))
    buf.insert(time_limit_rows(6))
    state = buf.state_dict()
    old = dict(state, trunc=state["data"]["truncated"].clone())
    assert not torch.equal(old["trunc"], state["trunc"])
    fresh = TransitionBuffer(3 * 16, 8, time_limit_rows(0, 1), device="cpu", seed=0)
    fresh.load_state_dict(old)
    torch.testing.assert_close(fresh.sampling_mass(True), buf.sampling_mass(True))
    assert torch.equal(fresh.state_dict()["trunc"], state["trunc"])
    with pytest.raises(ValueError, match=r"state_dict\['trunc'\]"):
        fresh.load_state_dict(dict(state, trunc=torch.zeros_like(state["trunc"])))
