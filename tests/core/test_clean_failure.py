"""Clean failure and bounded memory: a sample or get too large for the machine raises ``MemoryError`` naming
``batch_size`` / ``n`` and the bytes, before anything changes (generator state, priorities, counts), and keeps
none of its memory; no cache grows with the values callers pass (n, gamma, batch sizes, fanouts).

Sizes: "impossible" requests ask for more than the machine has in all (refused up front, nothing allocated);
"real" failures let torch's allocator refuse an allocation of about 2**45 bytes (skipped where the allocator
would hand out such memory lazily), with the up-front check switched off.
"""

import numpy as np
import pytest
import torch
from fixtures import index_rows
from snapshots import assert_unchanged, snapshot

import gpubuf.history.lockstep as lockstep_module
import gpubuf.history.outputs as outputs_module
import gpubuf.ops.device as device_ops
import gpubuf.ops.indexing as indexing
import gpubuf.ops.prefix_tree as tree_ops
import gpubuf.replay.sampling.stacked as stacked_sampling
from gpubuf import HistoryBuffer, PrioritizedTransitionBuffer, Transition, TransitionBuffer

E, M = 2, 8
HUGE = 2**45  # bytes torch's host allocator refuses at once (more than RAM and swap)


def rows(T: int, obs_dim: int, t0: int = 0) -> Transition:
    return index_rows(T, E, t0, obs_dim=obs_dim, by_env=False, term_every=3)  # episodes of 3 rows


def replay(cls, obs_dim: int = 4, **kw):
    buf = cls(M * E, 4, rows(1, obs_dim), device="cpu", seed=0, **kw)
    buf.insert(rows(M, obs_dim))
    return buf


def state(buf) -> tuple:
    """What a failed call must leave as it was: the generator, the whole state_dict (priorities, counts) and
    every start's sampling mass."""
    return (buf.generator.get_state().clone(), snapshot(buf), buf.sampling_mass().clone(),
            buf.sampling_mass(with_next_obs=True).clone())


def assert_same(buf, before: tuple) -> None:
    rng, snap, mass, mass_next = before
    assert torch.equal(buf.generator.get_state(), rng), "the generator moved"
    assert_unchanged(buf, snap)
    assert torch.equal(buf.sampling_mass(), mass) and torch.equal(buf.sampling_mass(with_next_obs=True), mass_next)


@pytest.fixture
def allocator_refuses():
    """Skip unless torch's host allocator refuses ``HUGE`` bytes outright (Linux's default overcommit does)."""
    try:
        t = torch.empty(HUGE, dtype=torch.uint8)
    except RuntimeError as err:
        assert device_ops.allocation_failed(err), err
        return
    del t
    pytest.skip("this machine's allocator hands out 2**45 bytes lazily")


@pytest.fixture
def no_upfront_check(monkeypatch, allocator_refuses):
    """The up-front size check off (capacity unknown), so that the allocator itself fails."""
    monkeypatch.setattr(device_ops, "capacity", lambda device: None)


SAMPLES = {
    "plain": {},
    "next_obs": {"with_next_obs": True},
    "frame_stack": {"frame_stack": 4},
    "n_step_return": {"n_step_return": (3, 0.9)},
    "both": {"frame_stack": 4, "frame_stride": 2, "n_step_return": (3, 0.9)},
}


# ---- refused up front: more than the machine has


@pytest.mark.parametrize("cls", [TransitionBuffer, PrioritizedTransitionBuffer])
@pytest.mark.parametrize("case", list(SAMPLES))
def test_an_impossible_sample_is_refused_before_anything_changes(host_backend, cls, case):
    buf = replay(cls, obs_dim=2**12)  # 16 KiB observations
    before = state(buf)
    B = 2**28  # with replacement: any size may be asked for; 2**28 windows of 16 KiB are 4 TiB
    if B * 2**14 <= device_ops.capacity(torch.device("cpu")):
        pytest.skip("this machine has more than 4 TiB")
    with pytest.raises(MemoryError, match=rf"batch_size: sample\(batch_size={B}\) needs about (\d+) bytes") as err:
        buf.sample(batch_size=B, with_replacement=True, **SAMPLES[case])
    assert int(err.value.args[0].split("needs about ")[1].split()[0]) > device_ops.capacity(torch.device("cpu"))
    assert_same(buf, before)
    buf.sample(batch_size=4, with_replacement=True, **SAMPLES[case])  # and it still samples


def test_an_impossible_graph_sampler_is_refused_before_allocating():
    buf = replay(TransitionBuffer, obs_dim=2**12)
    before = state(buf)
    for kw in ({}, {"frame_stack": 4, "n_step_return": (2, 0.5)}):
        with pytest.raises(MemoryError, match=r"batch_size: sample\(batch_size=268435456\) needs about \d+ bytes"):
            buf.graph_sampler(batch_size=2**28, **kw)
    assert_same(buf, before)


# ---- the allocator itself fails


@pytest.mark.parametrize(("cls", "case"), [(TransitionBuffer, "plain"), (TransitionBuffer, "frame_stack"),
                                           (TransitionBuffer, "n_step_return"),
                                           (PrioritizedTransitionBuffer, "frame_stack"),
                                           (PrioritizedTransitionBuffer, "n_step_return")])
def test_a_sample_whose_allocation_fails_changes_nothing(no_upfront_check, cls, case):
    # 4 MiB observations: 2**23 windows ask torch for 2**45 bytes (the plain one after its draw, the stacked
    # ones before it; a prioritized plain draw of 2**23 would take gigabytes first: the injected failures cover it)
    buf = replay(cls, obs_dim=2**20)
    before = state(buf)
    with pytest.raises(MemoryError, match=r"batch_size: sample\(batch_size=8388608\) needs about \d+ bytes .* which "
                                          r"cannot be allocated"):
        buf.sample(batch_size=2**23, with_replacement=True, **SAMPLES[case])
    assert_same(buf, before)


def fail_on_call(monkeypatch, owner, name: str, call: int):
    """Make ``owner.name`` raise an allocator's error on its ``call``-th call (counted from 1)."""
    real, calls = getattr(owner, name), []

    def failing(*args, **kw):
        calls.append(1)
        if len(calls) == call:
            raise RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 123 bytes.")
        return real(*args, **kw)

    monkeypatch.setattr(owner, name, failing)
    return calls


@pytest.mark.parametrize("case", list(SAMPLES))
def test_a_draw_without_replacement_that_fails_restores_priorities_and_generator(monkeypatch, case):
    buf = replay(PrioritizedTransitionBuffer)
    buf.update_priorities(np.arange(M * E), np.geomspace(1e-3, 1e3, M * E))  # skewed: rare starts
    before = state(buf)
    kw = SAMPLES[case]
    valid = buf.num_valid(with_next_obs=kw.get("with_next_obs", False) or "n_step_return" in kw)
    # the whole batch: the first round of draws cannot find every start, so later rounds run with masses zeroed
    calls = fail_on_call(monkeypatch, buf.sampler, "uniforms", 2)
    with pytest.raises(MemoryError, match=rf"batch_size: sample\(batch_size={valid}\) needs about \d+ bytes"):
        buf.sample(batch_size=valid, **kw)
    assert len(calls) == 2
    assert_same(buf, before)


@pytest.mark.parametrize("where", ["frame_stack", "n_step_return"])
def test_a_stacked_gather_that_fails_after_the_draw_restores_the_generator(monkeypatch, where):
    buf = replay(PrioritizedTransitionBuffer)
    before = state(buf)
    fail_on_call(monkeypatch, buf.storage.table, where, 1)  # the stacks' and returns' ops: the storage's table
    with pytest.raises(MemoryError, match="batch_size: sample"):
        buf.sample(batch_size=6, frame_stack=2, n_step_return=(2, 0.9))
    assert_same(buf, before)


def test_other_errors_pass_through_and_still_restore_the_generator(monkeypatch):
    buf = replay(TransitionBuffer)
    before = state(buf)

    def broken(*args, **kw):
        raise KeyError("not an allocation")

    monkeypatch.setattr(type(buf.config), "with_flags", broken)
    with pytest.raises(KeyError, match="not an allocation"):
        buf.sample()
    assert_same(buf, before)


def test_the_allocator_refuses_2_45_bytes_as_the_tests_assume(allocator_refuses):
    with pytest.raises(RuntimeError) as err:
        torch.empty(HUGE, dtype=torch.uint8)
    assert device_ops.allocation_failed(err.value)
    assert not device_ops.allocation_failed(RuntimeError("shape mismatch"))
    assert device_ops.allocation_failed(torch.OutOfMemoryError("CUDA out of memory"))


# ---- HistoryBuffer.get


def history(E=4, D=4, max_len=6, block=False, t=4):
    buf = HistoryBuffer(E, max_len, 2 if block else 1, ("action",) if block else (), device="cpu")
    for i in range(t):
        info = {"x": np.full((E, 1, D), i, np.float32)}
        if block:
            info["action"] = np.full((E, 1, 2), i, np.float32)
        buf.append(info)
    return buf


def cached_tensors() -> list[torch.Tensor]:
    return [*indexing._COUNTDOWNS.values(), *indexing._BLOCK_BACKS.values()]  # noqa: SLF001


def held_spares(buf) -> list[int]:
    return buf._outputs.held()  # noqa: SLF001


@pytest.mark.parametrize("env_ids", [None, [0, 2]])
@pytest.mark.parametrize("block", [False, True])
def test_an_impossible_get_is_refused_and_keeps_nothing(host_backend, env_ids, block):
    buf = history(D=2**16, block=block)  # 256 KiB entries: 2**26 frames per env ask for terabytes
    before = snapshot(buf)
    n = 2**26
    with pytest.raises(MemoryError, match=rf"n: get\(n={n}\) needs \d+ bytes of output on cpu"):
        buf.get(n, env_ids=env_ids)
    assert_unchanged(buf, before)
    assert all(t.numel() <= indexing._CACHED for t in cached_tensors())  # noqa: SLF001
    assert all(b < 2**30 for b in held_spares(buf))
    assert buf.get(3, env_ids=env_ids)["x"].shape[1] == 3 * 1  # and it still reads


@pytest.mark.parametrize("env_ids", [None, [0, 1]])
def test_a_get_whose_allocation_fails_keeps_none_of_its_memory(no_upfront_check, env_ids):
    # two keys: the first output (2 GiB, untouched) is allocated, the second (2**45 bytes) is refused
    buf = HistoryBuffer(2, 4, device="cpu")
    for i in range(3):
        buf.append({"a": np.full(2, i, np.uint8), "b": np.full((2, 1, 2**14), i, np.float32)})
    before = snapshot(buf)
    n = 2**30
    with pytest.raises(MemoryError, match=rf"n: get\(n={n}\) needs \d+ bytes of output on cpu.* which cannot be "
                                          "allocated"):
        buf.get(n, env_ids=env_ids)
    assert_unchanged(buf, before)
    assert held_spares(buf) == []  # the 2 GiB output of "a" was dropped with the failed call
    assert all(t.numel() <= indexing._CACHED for t in cached_tensors())  # noqa: SLF001
    assert buf.get(2)["b"].shape == (2, 2, 2**14)


def test_index_tensors_of_large_n_are_not_cached():
    buf = history(E=1, D=1, max_len=4, block=True)
    got = buf.get(2**17, env_ids=[0])  # the twins' path: (n,) countdowns, built for this call only
    assert got["x"].shape[:2] == (1, 2**17) and got["action"].shape == (1, 2**17 - 1, 4)
    assert all(t.numel() <= indexing._CACHED for t in cached_tensors())  # noqa: SLF001


# ---- bounded caches


def test_history_index_caches_are_bounded():
    buf = history(E=2, D=1, max_len=8, block=True)
    for n in range(1, 101):
        buf.get(n, env_ids=[1, 0])
    assert 0 < len(indexing._COUNTDOWNS) <= 16 and 0 < len(indexing._BLOCK_BACKS) <= 16  # noqa: SLF001


def test_lockstep_plans_are_bounded(monkeypatch):
    monkeypatch.setattr(lockstep_module, "PLAN_ENTRIES", 8)
    buf = history(E=2, D=1, max_len=8)
    for n in range(1, 101):
        buf.get(n)
        assert buf._lockstep.cached_plans()[0] <= 8  # noqa: SLF001
    monkeypatch.undo()
    for n in range(1, 101):
        buf.get(n)
    plans, plan_bytes = buf._lockstep.cached_plans()  # noqa: SLF001
    assert plans <= lockstep_module.PLAN_ENTRIES
    assert plan_bytes <= lockstep_module.PLAN_BYTES


def test_large_output_spares_are_bounded_per_key():
    buf = HistoryBuffer(1, 4, device="cpu")
    for i in range(3):
        buf.append({"x": np.full((1, 1, 2**16), i, np.float32)})
    for n in range(8, 40):  # outputs of 2 MiB and more: their memory may be kept for reuse, two per key
        buf.get(n)
    assert len(held_spares(buf)) <= outputs_module.SPARES


def test_gamma_tensors_are_bounded():
    buf = replay(TransitionBuffer)
    for i in range(100):  # an annealed discount: 100 distinct values
        buf.sample(n_step_return=(2, 0.9 + i * 1e-4))
    assert len(stacked_sampling._GAMMAS) <= 8  # noqa: SLF001
    assert not getattr(buf.episode_marks(), "_gammas", {})  # the buffer keeps none of them


def test_a_graph_sampler_keeps_its_own_gamma():
    buf = replay(TransitionBuffer)
    gs = buf.graph_sampler(n_step_return=(2, 0.5))
    for i in range(20):
        buf.sample(n_step_return=(2, 0.1 + i / 100))  # evicts 0.5 from the shared cache
    out, _ = gs.sample()
    assert gs._plan.stacks.gamma.item() == 0.5  # noqa: SLF001
    assert set(out.discount.tolist()) <= {0.0, 0.5, 0.25}  # gamma**m after m rewards, 0 after a termination


def test_tree_and_host_plan_caches_are_bounded():
    cpu = torch.device("cpu")
    for fanout in range(2, 102):
        tree_ops._ascending(fanout, cpu)  # noqa: SLF001
    assert len(tree_ops._ASCENDING) <= 16  # noqa: SLF001
    buf = replay(TransitionBuffer)
    for B in range(1, 101):
        buf.sample(batch_size=B)
    assert len(buf.storage._host_jobs) <= 8  # noqa: SLF001


def test_lru_keeps_the_most_recent_and_caches_no_failure():
    lru = device_ops.LRU(3)
    for k in range(10):
        assert lru.get(k, lambda k=k: k * k) == k * k
    assert len(lru) == 3 and lru.values() == [49, 64, 81]
    assert lru.get(7, lambda: 0) == 49  # a hit: 7 becomes the most recent
    lru.get(10, lambda: 100)
    assert lru.values() == [81, 49, 100]

    def fails():
        raise MemoryError("no")

    with pytest.raises(MemoryError):
        lru.get(11, fails)
    assert lru.values() == [81, 49, 100]
