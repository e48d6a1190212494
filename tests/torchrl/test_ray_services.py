"""gpubuf.torchrl's ReplayStorage and samplers inside torchrl's Ray-backed replay buffer, written by several Ray actors.

torchrl 0.14 builds the Ray buffer from the ordinary constructor: ``TensorDictReplayBuffer(storage=..., sampler=...,
service_backend="ray", service_backend_options={"remote_config": {...}})`` returns a ``RayReplayBuffer`` that owns one
Ray actor holding the buffer; storage and sampler are given as factories (``functools.partial``) built in that actor.
``rb.client()`` is a picklable handle that writer actors ``extend`` through; the learner samples through the owner.

Each comparison builds two such buffers, one on gpubuf's ``ReplayStorage`` and sampler, one on torchrl's
``LazyTensorStorage`` and torchrl's own sampler (the prioritized ones with numpy trees, ``tests/torchrl_reference.py``),
and has three writer actors extend both, one at a time, with rows whose ``value`` is their global index: the indices
each extend returns, ``len``, ``write_count``, every stored row, seeded samples and priority updates then match call
for call. The buffers draw in their own actor processes, so each is seeded there (``SeededBuffer.seed``): numpy's
global state for the prioritized draws, torch's for the uniform and slice draws, as the in-process tests seed them.
Then writers extend at once, in no fixed order, while the learner samples and updates priorities."""

import os
import time
from functools import partial

import numpy as np
import pytest
import torch
from extras import needs

ray = pytest.importorskip("ray")
needs("torchrl.data")  # a submodule: ``tests/torchrl`` is on sys.path too (see extras.needs)
from tensordict import TensorDict  # noqa: E402
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer  # noqa: E402
from torchrl.data.replay_buffers.samplers import SliceSampler as TorchRLSliceSampler  # noqa: E402
from torchrl_reference import ReferenceSampler, ReferenceSliceSampler  # noqa: E402

from gpubuf.torchrl import PrioritizedSampler, PrioritizedSliceSampler, ReplayStorage, SliceSampler  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]  # torchrl's imports warn

N, BATCH, EPISODE = 64, 8, 7  # ring rows, rows per sample, rows per episode (value // EPISODE)
HERE = os.path.dirname(os.path.abspath(__file__))
REMOTE = {"service_backend": "ray", "service_backend_options": {"remote_config": {"num_cpus": 0}}}
PRIO = dict(alpha=0.7, beta=0.5)
SLICES = dict(slice_len=4, traj_key="episode")
KINDS = {  # name: (gpubuf's sampler factory, torchrl's), None: torchrl's RandomSampler
    "uniform": (None, None),
    "prioritized": (partial(PrioritizedSampler, N, **PRIO), partial(ReferenceSampler, N, **PRIO)),
    "slices": (partial(SliceSampler, **SLICES), partial(TorchRLSliceSampler, **SLICES)),
    "prioritized slices": (partial(PrioritizedSliceSampler, N, **PRIO, **SLICES),
                           partial(ReferenceSliceSampler, N, **PRIO, **SLICES)),
}


class SeededBuffer(TensorDictReplayBuffer):
    """torchrl's buffer with one more method, so the test can seed the process its Ray actor draws in."""

    def seed(self, seed: int) -> None:
        np.random.seed(seed)
        torch.manual_seed(seed)


def rows(start: int, n: int) -> TensorDict:
    """``n`` rows of global indices ``start ..``: value, obs = (value, -value), episode = value // EPISODE."""
    r = torch.arange(start, start + n)
    return TensorDict({"value": r, "obs": torch.stack([r, -r], 1).float(), "episode": r // EPISODE,
                       ("next", "done"): ((r + 1) % EPISODE == 0).unsqueeze(1)}, batch_size=[n])


class Writer:
    """A writer (a Ray actor): extends each buffer whose client it is given, in order, with the same rows."""

    def extend(self, clients: list, start: int, n: int) -> list:
        return [c.extend(rows(start, n)) for c in clients]

    def extend_named(self, namespace: str, name: str, start: int, n: int) -> list:
        """Extends the buffer registered as ``name`` in torchrl's service registry (looked up once)."""
        clients = self.__dict__.setdefault("named", {})
        if name not in clients:
            from torchrl.services import get_services

            clients[name] = get_services(namespace=namespace).get(name)
        return self.extend([clients[name]], start, n)


@pytest.fixture(scope="module")
def cluster():
    """A local Ray of 3 CPUs whose workers import this gpubuf, ``tests`` and this folder (the test's classes)."""
    if ray.is_initialized():
        pytest.skip("Ray is already initialized in this process")
    import ray_actors

    ray_actors.start_ray(paths=(HERE,), env={"RL_WARNINGS": "0"}, num_cpus=3, include_dashboard=False,
                         namespace="gpubuf_tests")
    try:
        yield "gpubuf_tests"
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def ws(cluster) -> list:
    """Three writer actors, shared by the tests (an actor's process takes seconds to start on 2 cores)."""
    return [ray.remote(num_cpus=0)(Writer).remote() for _ in range(3)]


def buffers(kind: str, **kw) -> list:
    """``[gpubuf's, torchrl's]`` Ray-backed buffers of ``kind``."""
    ours, theirs = KINDS[kind]
    return [SeededBuffer(storage=partial(ReplayStorage, N), sampler=ours, batch_size=BATCH, **kw, **REMOTE),
            SeededBuffer(storage=partial(LazyTensorStorage, N), sampler=theirs, batch_size=BATCH, **kw, **REMOTE)]


def seeded_samples(rbs: list, seed: int) -> list:
    out = []
    for rb in rbs:
        rb.client().seed(seed)
        out.append(rb.sample())
    return out


def assert_same(a: TensorDict, b: TensorDict) -> None:
    """Same keys, same entries, the importance weights to float32 rounding."""
    assert set(a.keys(True, True)) == set(b.keys(True, True))
    for key in a.keys(True, True):
        if key == "priority_weight":
            torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=0)
        else:
            assert torch.equal(a[key], b[key]), key


def assert_written_rows(td: TensorDict) -> None:
    """Every row is a row some writer wrote: obs and episode agree with its value."""
    v = td["value"]
    assert torch.equal(td["obs"], torch.stack([v, -v], -1).float())
    assert torch.equal(td["episode"], v // EPISODE)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_writers_taking_turns_give_both_buffers_the_same_rows_draws_and_priorities(ws, kind):
    rbs = buffers(kind)
    try:
        clients = [rb.client() for rb in rbs]
        g, start = torch.Generator().manual_seed(len(kind)), 0
        for step in range(12):  # 12 extends of 7 to 21 rows: the ring of 64 wraps three times
            n = EPISODE * int(torch.randint(1, 4, (1,), generator=g))
            ours, theirs = ray.get(ws[step % len(ws)].extend.remote(clients, start, n))
            assert torch.equal(ours, theirs)
            start += n
            assert len(rbs[0]) == len(rbs[1]) == min(start, N)
            assert rbs[0].write_count == rbs[1].write_count == start
            stored = [rb[:] for rb in rbs]
            assert_same(*stored)
            assert_written_rows(stored[0])
            a, b = seeded_samples(rbs, step)
            assert_same(a, b)
            assert_written_rows(a)
            if kind.startswith("prioritized"):
                td_error = torch.rand(a.shape, generator=g) * (3.0 if step % 4 else 0.0)  # some rounds write zeros
                for rb, s in zip(rbs, (a, b), strict=True):
                    s.set("td_error", td_error)
                    rb.update_tensordict_priority(s)
                idx, prio = torch.randint(0, len(rbs[0]), (5,), generator=g), torch.rand(5, generator=g)
                for rb in rbs:
                    rb.update_priority(idx, prio)
                assert_same(*seeded_samples(rbs, 1000 + step))
        for seed in range(5):
            assert_same(*seeded_samples(rbs, 2000 + seed))
    finally:
        for rb in rbs:
            rb.close()


@pytest.mark.parametrize("kind", ["prioritized", "slices"])
def test_writers_at_once_leave_every_row_once_while_the_learner_samples(ws, kind):
    """Three writers extend 12 times each at once (252 rows into 256) while the learner samples and updates."""
    size = 256
    sampler = partial(PrioritizedSampler, size, **PRIO) if kind == "prioritized" else partial(SliceSampler, **SLICES)
    rb = SeededBuffer(storage=partial(ReplayStorage, size), sampler=sampler, batch_size=BATCH, **REMOTE)
    try:
        clients, jobs = [rb.client()], {}
        for i in range(12):
            for k, w in enumerate(ws):
                start = 10_000 * (k + 1) + EPISODE * i
                jobs[start] = w.extend.remote(clients, start, EPISODE)
        samples = []
        deadline = time.monotonic() + 120
        while len(rb) < EPISODE and time.monotonic() < deadline:  # the learner starts once some rows are in
            time.sleep(0.01)
        while not all(ray.wait([j], timeout=0)[0] for j in jobs.values()):
            s = rb.sample()
            samples.append(s)
            if kind == "prioritized":
                rb.update_priority(s["index"], torch.rand(s.shape[0]) + 0.1)
        written = torch.cat([torch.arange(start, start + EPISODE) for start in jobs])
        assert len(rb) == rb.write_count == written.numel()
        stored = rb[:]
        assert_written_rows(stored)
        assert torch.equal(stored["value"].sort().values, written.sort().values)  # each row once, unchanged
        for start, job in jobs.items():  # the indices each writer was given hold its rows
            (index,) = ray.get(job)
            assert torch.equal(rb[index]["value"], torch.arange(start, start + EPISODE))
        for s in [*samples, rb.sample(), rb.sample()]:
            assert_written_rows(s)
            assert torch.isin(s["value"], written).all()
    finally:
        rb.close()


def test_writers_find_the_buffer_in_torchrls_service_registry_and_the_ring_stays_whole(cluster, ws):
    """``torchrl.services``: the owner registers the running buffer, writers look it up by name; they extend at
    once past the ring's capacity, which then holds the newest rows, each once and whole."""
    from torchrl.services import get_services

    services = get_services(namespace=cluster)
    rb = SeededBuffer(storage=partial(ReplayStorage, N), sampler=partial(PrioritizedSampler, N, **PRIO),
                      batch_size=BATCH, **REMOTE)
    try:
        services.register("replay", rb)
        jobs = {10_000 * (k + 1) + EPISODE * i: w.extend_named.remote(cluster, "replay", 10_000 * (k + 1)
                                                                     + EPISODE * i, EPISODE)
                for i in range(6) for k, w in enumerate(ws)}
        ray.get(list(jobs.values()))
        assert len(rb) == N and rb.write_count == EPISODE * len(jobs)
        stored = rb[:]
        assert_written_rows(stored)
        values = stored["value"]
        assert values.unique().numel() == N  # no row twice
        assert torch.isin(values, torch.cat([torch.arange(s, s + EPISODE) for s in jobs])).all()
        whole = sum(bool(torch.isin(torch.arange(s, s + EPISODE), values).all()) for s in jobs)
        assert whole == N // EPISODE  # the newest extends whole, the row left over from the one before
        s = rb.sample()
        assert_written_rows(s)
        rb.update_priority(s["index"], torch.ones(s.shape[0]))
    finally:
        services.reset()
        rb.close()


def reopen(path: str, wait: float = 60.0) -> ReplayStorage:
    """The storage_dir re-opened here once the killed actor's process has let it go (``ray.kill`` does not wait)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            return ReplayStorage(N, storage_dir=path)
        except ValueError as err:
            if "open for writing" not in str(err) or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_instances_travel_to_the_buffer_actor_and_a_storage_dir_stays_whole_after_it(ws, tmp_path):
    """A storage and sampler given as instances are pickled to the buffer's actor and work there; a storage_dir
    cannot be pickled (its writer is one process) but a factory opens it in the actor, and once the actor is gone
    the directory re-opens here with every row."""
    rb = SeededBuffer(storage=ReplayStorage(N), sampler=PrioritizedSampler(N, **PRIO), batch_size=BATCH, **REMOTE)
    try:
        ray.get(ws[0].extend.remote([rb.client()], 0, 40))
        assert torch.equal(rb[:]["value"], torch.arange(40))
        assert_written_rows(rb.sample())
    finally:
        rb.close()
    with pytest.raises(TypeError, match="cannot be pickled"):
        SeededBuffer(storage=ReplayStorage(N, storage_dir=tmp_path / "rows"), **REMOTE)
    rb = SeededBuffer(storage=partial(ReplayStorage, N, storage_dir=str(tmp_path / "rows")), batch_size=BATCH,
                      **REMOTE)
    try:
        clients = [rb.client()]
        for i in range(10):  # 70 rows: the ring wraps
            ray.get(ws[i % 2].extend.remote(clients, EPISODE * i, EPISODE))
        want = rb[:]
    finally:
        rb.close()  # kills the actor: no flush, no close
    again = reopen(str(tmp_path / "rows"))
    try:
        assert len(again) == N
        assert_same(again[:], want)
        assert torch.equal(again[:]["value"].sort().values, torch.arange(70 - N, 70))
    finally:
        again.close()
