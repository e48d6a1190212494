"""Contract: a ShardedBuffer is one replay buffer over the ranks of a process group. Every rank's sample is drawn
from the union of the shards with the exact global probabilities (uniform or prioritized, with or without
replacement, as the local buffers draw windows at episode boundaries), priority updates reach the shards that own
them, an error on any rank (a bad argument, a refused argument of the shared ``sample`` signature, a configuration
that disagrees, a failed load) raises on every rank, and each rank saves and loads its own shard.

Four gloo processes on CPU run every scenario (tests/distributed_worker.py) over the whole group and over two
pairs; the checks here read what each rank saw. Sampling is checked against the exact global distribution
(chi-square, fixed seeds so the outcome is deterministic) and windows are decoded back to (shard, step, env).
"""

import itertools
import multiprocessing

import distributed_worker as dw
import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

WORLD = 4
TIMEOUT_S = 240  # a bound for a hung collective; the run takes ~20 s on 2 busy cores
P_MIN = 1e-3  # chi-square p-value floor (seeds are fixed: a pass is reproducible)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """``{"world": [4 rank results], "pair0": [ranks 0, 1], "pair1": [ranks 2, 3]}``."""
    out = tmp_path_factory.mktemp("distributed")
    # children fork from a server that imported gpubuf once, instead of each importing torch again
    multiprocessing.get_context("forkserver").set_forkserver_preload(["gpubuf.replay.sharded.buffer"])
    ctx = mp.start_processes(dw.main, args=(WORLD, str(out / "init"), str(out)), nprocs=WORLD, join=False,
                             start_method="forkserver")
    try:
        deadline = TIMEOUT_S
        while not ctx.join(timeout=5):
            deadline -= 5
            if deadline <= 0:
                pytest.fail(f"the {WORLD} ranks did not finish in {TIMEOUT_S} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join()
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    return {"world": [r["world"] for r in ranks], "pair0": [r["pair"] for r in ranks[:2]],
            "pair1": [r["pair"] for r in ranks[2:]]}


GROUPS = ["world", "pair0", "pair1"]


def decode(obs: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(shard, step, env) of each window's first row from observations (B, n, 2)."""
    v = obs[:, 0, 0].numpy().astype(np.int64)
    shard, rest = np.divmod(v, dw.BIG)
    step, env = np.divmod(rest, dw.E)
    return shard, step, env


def global_start(obs: torch.Tensor) -> np.ndarray:
    shard, step, env = decode(obs)
    return shard * dw.S + (step % dw.M) * dw.E + env


def check_windows(w: dict, mass: np.ndarray) -> np.ndarray:
    """Every window is real: consecutive steps of one env of one shard, from a start of positive mass;
    returns the global starts."""
    obs = w["obs"]
    v = obs[:, :, 0].numpy()
    np.testing.assert_array_equal(obs[:, :, 1].numpy(), -v)
    offsets = np.broadcast_to(np.arange(dw.N_STEPS), v.shape)
    np.testing.assert_array_equal(v - v[:, :1], offsets * dw.E)
    shard, step, env = decode(obs)
    steps = step[:, None] + offsets
    np.testing.assert_array_equal(w["step"].numpy(), steps)
    np.testing.assert_array_equal(w["action"].numpy(), steps % 100)
    assert w["action"].dtype == torch.int16 and w["reward"].dtype == torch.float32
    np.testing.assert_array_equal(w["reward"].numpy(), v)
    assert not w["terminated"].any()
    np.testing.assert_array_equal(w["truncated"].numpy(), (shard == 1)[:, None] & (steps == 4) & (env == 0)[:, None])
    if "next_obs" in w:
        np.testing.assert_array_equal(w["next_obs"][:, :, 0].numpy(), v + dw.E)
    g = global_start(obs)
    assert (mass[g] > 0).all(), "a window starts where the sampling mass is zero"
    return g


def chi2_p(samples: np.ndarray, probs: np.ndarray) -> float:
    """p-value of ``samples`` (cell ids) against ``probs``; the least likely cells are pooled until every cell
    expects at least 5."""
    from scipy.stats import chisquare

    assert (probs[np.unique(samples)] > 0).all()
    keep = np.flatnonzero(probs > 0)
    order = keep[np.argsort(probs[keep])]
    obs = np.bincount(samples, minlength=probs.size)[order].astype(float)
    exp = probs[order] * samples.size
    # pooled: the cells [0, cut), which expect at least 5 together; every other cell expects 5 or more
    cut = min(max(int(np.searchsorted(exp, 5.0)), int(np.searchsorted(np.cumsum(exp), 5.0)) + 1), exp.size - 1)
    o, e = np.append(obs[:cut].sum(), obs[cut:]), np.append(exp[:cut].sum(), exp[cut:])
    return chisquare(o, e).pvalue


def masses(res: list, key: str, i: int | None = None) -> np.ndarray:
    return np.concatenate([(r[key] if i is None else r[key][i]).double().numpy() for r in res])


@pytest.mark.parametrize("name", GROUPS)
def test_num_valid_is_global(runs, name):
    res = runs[name]
    for i in range(2):
        want = sum(r["local_valid"][i] for r in res)
        assert all(r["num_valid"][i] == want for r in res)
    assert want < sum(r["local_valid"][0] for r in res)  # shard 1's truncation removes kind-1 starts


@pytest.mark.parametrize("name", GROUPS)
@pytest.mark.parametrize("which, kind", [("uni_wr", 0), ("uni_wr_next", 1)])
def test_uniform_with_replacement_matches_union(runs, name, which, kind):
    res = runs[name]
    mass = masses(res, "mass_uniform", kind)
    starts = np.concatenate([check_windows(r[which], mass) for r in res])
    assert chi2_p(starts, mass / mass.sum()) > P_MIN
    # shard 1's truncated row is drawn inside plain windows, never inside windows that infer next observations
    assert any(bool(r[which]["truncated"].any()) for r in res) == (kind == 0)
    assert len({tuple(global_start(r[which]["obs"])[:20]) for r in res}) == len(res)  # one key, distinct batches


@pytest.mark.parametrize("name", GROUPS)
def test_uniform_without_replacement_takes_every_start_once(runs, name):
    res = runs[name]
    mass = masses(res, "mass_uniform", 0)
    for r in res:
        starts = check_windows(r["uni_all"], mass)
        np.testing.assert_array_equal(np.sort(starts), np.flatnonzero(mass))


@pytest.mark.parametrize("name", GROUPS)
def test_update_priorities_routes_to_owners(runs, name):
    """Updates from every rank (duplicates included) land on their owners; duplicates keep their largest."""
    res = runs[name]
    before = masses(res, "prio_before").astype(np.float32)
    updated = np.zeros(before.size, bool)
    best = np.full(before.size, -np.inf, np.float32)
    for r in res:
        idx, td = r["updates"]
        new = np.abs(td.astype(np.float32)) + np.float32(1e-6)
        np.maximum.at(best, idx, new)
        updated[idx] = True
    expected = np.where(updated, best, before)
    np.testing.assert_array_equal(masses(res, "prio_after").astype(np.float32), expected)
    top = max(1.0, float(best.max()))
    assert all(r["max_priority"] == top for r in res)


@pytest.mark.parametrize("name", GROUPS)
@pytest.mark.parametrize("which", ["per_wr", "per_wr_next"])
def test_prioritized_with_replacement_matches_union(runs, name, which):
    res = runs[name]
    mass = masses(res, "mass_per")  # priority**alpha over valid kind-0 starts (kind 1 only removes some)
    if which == "per_wr_next":
        mass = mass * (masses(res, "mass_uniform", 1) > 0)
    N = int((mass > 0).sum())
    starts = []
    for r in res:
        w = r[which]
        g = check_windows(w, mass)
        np.testing.assert_array_equal(w["idx"].numpy(), g)  # global index = rank * S + local start
        P = mass[g] / mass.sum()
        want = (N * P) ** -0.5
        np.testing.assert_allclose(w["w"].numpy(), want / want.max(), rtol=1e-5)
        assert w["w"].dtype == torch.float32
        starts.append(g)
    if which == "per_wr":
        assert chi2_p(np.concatenate(starts), mass / mass.sum()) > P_MIN


@pytest.mark.parametrize("name", GROUPS)
def test_prioritized_without_replacement_is_plackett_luce(runs, name):
    """Each of many 2-window batches: distinct starts; first ~ P, second ~ sum_j P_j P_i / (1 - P_j)."""
    res = runs[name]
    mass = masses(res, "mass_per")
    P = mass / mass.sum()
    pairs = np.concatenate([r["per_pairs"].numpy() for r in res])
    assert (pairs[:, 0] != pairs[:, 1]).all()
    second = P * ((P / (1 - np.where(P < 1, P, 0))).sum() - P / (1 - P))
    assert np.isclose(second.sum(), 1)
    assert chi2_p(pairs[:, 0], P) > P_MIN
    assert chi2_p(pairs[:, 1], second) > P_MIN


def plackett_luce_positions(P: np.ndarray, k: int) -> np.ndarray:
    """(k, N): probability that position j of a sequential draw without replacement holds start i."""
    out = np.zeros((k, P.size))
    for seq in itertools.permutations(np.flatnonzero(P), k):
        p = np.prod([P[i] / (1 - sum(P[j] for j in seq[:at])) for at, i in enumerate(seq)])
        out[np.arange(k), seq] += p
    return out


@pytest.mark.parametrize("name", GROUPS)
def test_prioritized_without_replacement_over_rounds(runs, name):
    """Few starts and a dominant one: most batches take several rounds; every position of the batch follows
    the exact sequential law."""
    res = runs[name]
    mass = masses([r["few"] for r in res], "mass")
    draws = np.concatenate([r["few"]["draws"].numpy() for r in res])
    assert all(len(set(row)) == len(row) for row in draws.tolist())
    exact = plackett_luce_positions(mass / mass.sum(), draws.shape[1])
    for j in range(draws.shape[1]):
        assert chi2_p(draws[:, j], exact[j]) > P_MIN, j


@pytest.mark.parametrize("name", GROUPS)
def test_prioritized_without_replacement_whole_union(runs, name):
    res = runs[name]
    mass = masses(res, "mass_per")
    for r in res:
        w = r["per_all"]
        g = check_windows(w, mass)
        np.testing.assert_array_equal(w["idx"].numpy(), g)
        np.testing.assert_array_equal(np.sort(g), np.flatnonzero(mass))
        want = (mass[g] / mass[g].min()) ** -0.5
        np.testing.assert_allclose(w["w"].numpy(), want, rtol=1e-5)
        check_windows(r["per_none"], mass)


def _raised_everywhere(res, key, culprit, own_type, words):
    for r in res:
        kind, msg = r[key]
        if r["rank"] == culprit:
            assert kind == own_type and words in msg, (key, kind, msg)
        else:
            assert kind == "RuntimeError" and f"[{culprit}]" in msg, (key, kind, msg)


@pytest.mark.parametrize("name", GROUPS)
def test_bad_arguments_raise_on_every_rank(runs, name):
    res = runs[name]
    last = len(res) - 1
    _raised_everywhere(res, "bad_batch", 1, "ValueError", "batch_size")
    _raised_everywhere(res, "bad_key", last, "TypeError", "key")
    _raised_everywhere(res, "too_many", 0, "ValueError", "batch_size")
    _raised_everywhere(res, "bad_index", 0, "IndexError", "indices")
    _raised_everywhere(res, "bad_td", last, "ValueError", "td_errors")
    _raised_everywhere(res, "nan_td", last, "ValueError", "td_errors")
    _raised_everywhere(res, "missing_file", 0, "FileNotFoundError", "nothing0")
    for r in res:
        assert r["bad_next_obs"][0] == "ValueError" and "with_next_obs" in r["bad_next_obs"][1]
        assert r["bad_replacement"][0] == "ValueError" and "with_replacement" in r["bad_replacement"][1]
        assert r["uniform_update"][0] == "TypeError" and "no priorities" in r["uniform_update"][1]
        assert r["no_placeholder"][0] == "ValueError" and "{rank}" in r["no_placeholder"][1]
        assert r["empty_update"] is None
        # the group still works after every failed call, and nothing was written by them
        assert r["after_bad"][0] == r["num_valid"][0] and r["after_bad"][1] == r["after_bad"][2]


@pytest.mark.parametrize("name", GROUPS)
@pytest.mark.parametrize("arg, got", [
    ("out", "got a Transition"), ("return_indices", "expected None or False, got True"),
    ("frame_stack", "expected None, got 2"), ("frame_stride", "expected 1, got 2"),
    ("n_step_return", "expected None, got (3, 0.99)")])
def test_sample_refuses_by_name_what_a_sharded_sample_does_not_offer(runs, name, arg, got):
    for r in runs[name]:
        kind, msg = r["refused"][arg]
        assert kind == "ValueError" and msg.startswith(f"{arg}: ShardedBuffer.sample ") and msg.endswith(got), msg


@pytest.mark.parametrize("name", GROUPS)
def test_refusals_raise_on_every_rank_and_what_is_offered_passes(runs, name):
    res = runs[name]
    _raised_everywhere(res, "refused_one_rank", len(res) - 1, "ValueError", "frame_stack: ShardedBuffer.sample")
    for r in res:
        assert r["per_batch_alone"] == ("Transition", (2,))  # prioritized, return_indices=False: the batch alone
        assert r["defaults_given"] == (2, 2)  # (batch, global indices) when prioritized; a batch of 2 when uniform


@pytest.mark.parametrize("name", GROUPS)
def test_the_new_call_returns_a_batch_and_refuses_units_by_name(runs, name):
    for r in runs[name]:
        assert r["per_batch"] == ("Batch", (2,), (2,), None, True)
        assert r["uni_batch"] == ("Batch", None, None, (2, dw.N_STEPS, 2))
        kind, msg = r["refused_unit"]
        assert kind == "ValueError" and msg.startswith("frame_stack: ShardedBuffer.sample returns windows"), msg


def test_sample_takes_the_signature_every_buffer_shares():
    import inspect

    from gpubuf.replay.sampling.sample_args import Samples
    from gpubuf.replay.sharded.buffer import ShardedBuffer

    def shape(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    assert shape(ShardedBuffer.sample) == shape(Samples.sample)


@pytest.mark.parametrize("name", GROUPS)
def test_configuration_mismatch_raises_on_every_rank(runs, name):
    for r in runs[name]:
        assert r["bad_n_steps"][0] == "ValueError" and "differ in n_steps" in r["bad_n_steps"][1]
        assert r["bad_alpha"][0] == "ValueError" and "differ in alpha" in r["bad_alpha"][1]
        assert r["bad_local"][0] == "TypeError" and "rank 0" in r["bad_local"][1]
        assert any("same state" in m for m in r["same_seed_warning"])


@pytest.mark.parametrize("name", GROUPS)
def test_save_and_load_per_rank(runs, name):
    for r in runs[name]:
        assert r["reloaded"] == (True, True, True)


@pytest.mark.parametrize("name", GROUPS)
def test_shards_listing_info_keys_in_another_order_exchange_correct_windows(runs, name):
    res = runs[name]
    for r in res:
        keys, shards, a, b = r["edge"]["info_order"]
        assert keys == (["a", "b"] if r["rank"] % 2 else ["b", "a"])  # each rank keeps its own order
        assert len(shards) == len(res)  # windows came from every shard ...
        assert a.tolist() == [1.5] and b.tolist() == [7]  # ... and every leaf kept its values


@pytest.mark.parametrize("name", GROUPS)
def test_one_window_batches_of_unaligned_rows(runs, name):
    for r in runs[name]:
        uni, (per_wr, idx_wr), (per_wor, idx_wor) = r["edge"]["one_window"]
        for batch in (uni, per_wr, per_wor):
            assert batch.observation.shape == (1, 3) and batch.observation.dtype == torch.uint8
            assert batch.action.tolist() == [1.0] and batch.reward.dtype == torch.float64
            assert batch.info["a"].tolist() == [1.5] and batch.info["b"].tolist() == [7]
        for batch, idx in ((per_wr, idx_wr), (per_wor, idx_wor)):
            assert int(batch.observation[0, 0]) == int(idx[0]) // (dw.E * 8)  # the window is its index's shard
            assert batch.PER_weights.tolist() == [1.0]


@pytest.mark.parametrize("name", GROUPS)
def test_a_load_failing_on_one_rank_keeps_max_priority_global(runs, name):
    res = runs[name]
    last = len(res) - 1
    for r in res:
        assert r["edge"]["failed_load"] is not None  # the failing rank raises its own error, the others say who
        if r["rank"] != last:
            assert r["edge"]["failed_load"] == ("RuntimeError", f"load: the load of rank(s) [{last}] failed (see the "
                                                "error raised there); every rank of the group stops with it")
    assert len({r["edge"]["max_after_failed_load"] for r in res}) == 1
    assert res[0]["edge"]["max_after_failed_load"] == pytest.approx(10.0 * last, rel=1e-3)  # largest loaded one


# ------------------------------------------------------------------ episode boundaries


def truncated_rows(shard, step, env):
    return (shard == 1) & (step == 4) & (env == 0)


@pytest.mark.parametrize("name", GROUPS)
def test_boundaries_draw_the_local_windows_with_their_flags(runs, name):
    res = runs[name]
    for r in res:
        assert r["num_valid_forbid"][0] == sum(x["num_valid_forbid"][1] for x in res)
        # "mask": windows cross the truncation, is_first right after it, the mask up to it
        w = r["uni_mask"]
        mass = masses(res, "mass_uniform", 0)
        check_windows(w, mass)
        shard, step, env = decode(w["obs"])
        steps = step[:, None] + np.arange(dw.N_STEPS)
        ended = truncated_rows(shard[:, None], steps, env[:, None])
        is_first, mask = w["is_first"].numpy(), w["mask"].numpy()
        assert is_first[:, 0].all() and (is_first[:, 1:] == ended[:, :-1]).all()
        np.testing.assert_array_equal(mask, np.cumsum(is_first, 1) == 1)
        assert ended[:, :-1].any(), "no window crossed the truncation"
        # "forbid" with next observations: no truncation in the window's rows, constant flags
        w = r["uni_forbid"]
        shard, step, env = decode(w["obs"])
        steps = step[:, None] + np.arange(dw.N_STEPS)
        assert not truncated_rows(shard[:, None], steps, env[:, None]).any()
        assert w["mask"].all() and w["is_first"][:, 0].all() and not w["is_first"][:, 1:].any()
        # prioritized, without replacement: every forbid start of the group exactly once
        g = global_start(r["per_forbid_all"]["obs"])
        assert len(set(g.tolist())) == len(g) == r["num_valid_forbid"][0]
        np.testing.assert_array_equal(np.sort(g), np.sort(r["per_forbid_all"]["idx"].numpy()))


@pytest.mark.parametrize("name", GROUPS)
def test_bad_or_disagreeing_boundaries_raise_on_every_rank(runs, name):
    res = runs[name]
    last = len(res) - 1
    for rank, r in enumerate(res):
        kind, msg = r["bad_boundaries"]
        if rank == last:
            assert kind == "ValueError" and "boundaries: expected one of" in msg
        else:
            assert kind == "RuntimeError" and f"rank(s) [{last}]" in msg
        assert r["split_boundaries"] == ("ValueError", "boundaries: must agree on every rank of the group, got "
                                         f"{['mask'] + ['forbid'] * last} by rank")


@pytest.mark.parametrize("name", GROUPS)
def test_source_rows_marked_is_last_never_start_a_sharded_window(runs, name):
    res = runs[name]
    W = len(res)
    for r in res:
        for which in ("uni", "uni_all", "per", "per_all"):
            w = r["last"][which]
            v = w["obs"].numpy().astype(np.int64)
            shard, rest = np.divmod(v, dw.BIG)
            step, env = np.divmod(rest, dw.E)
            is_last = (step % 4 == 3) & (env == shard % dw.E)
            np.testing.assert_array_equal(w["is_last"].numpy(), is_last)
            assert not is_last[:, 0].any(), which
            is_first = w["is_first"].numpy()
            assert is_first[:, 0].all() and (is_first[:, 1:] == is_last[:, :-1]).all()
            np.testing.assert_array_equal(w["mask"].numpy(), np.cumsum(is_first, 1) == 1)
            if which.endswith("_all"):  # every start but the last rows, once
                starts = shard[:, 0] * dw.S + step[:, 0] * dw.E + env[:, 0]
                assert len(set(starts.tolist())) == len(starts) == W * ((dw.LAST_T - dw.N_STEPS + 1) * dw.E - 2)
        kind, msg = r["last"]["too_many"]
        assert kind == "ValueError" and "exceeds the" in msg
