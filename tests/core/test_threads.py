"""Threads: an actor inserting while learners sample and update, a planner reading while a thread
appends. Every row encodes its env and step (value = step * E + env) in every leaf, so a torn row
(leaves of two writes), a window across the write seam, a start on a row being written or a stale
stack shows as a value that breaks the arithmetic. The workers run until each made its share of
progress (counted calls, never work per second: a loaded machine only makes them slower), with the
interpreter switching threads every few microseconds so that calls interleave finely; a generous
timeout tells a hang from slowness."""

import sys
import threading
import warnings

import numpy as np
import pytest
import torch
from extras import needs

from gpubuf import HistoryBuffer, PrioritizedTransitionBuffer, Transition, TransitionBuffer

E = 4
HANG_S = 600.0  # a worker still running after this long is stuck (a deadlock), not slow


@pytest.fixture(autouse=True)
def fine_switching():
    """Switch threads every 10 us (default 5 ms), so calls interleave at any point."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(old)


class Stream:
    """Rows of ``E`` envs: every leaf of env ``e`` at step ``s`` holds ``s * E + e``; terminations
    and truncations at random (5 % each)."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.step = 0

    def rows(self, T: int) -> Transition:
        v = (np.arange(self.step, self.step + T)[:, None] * E + np.arange(E)).astype(np.float32)
        self.step += T
        u = self.rng.random((2, T, E))
        return Transition(observation=np.stack([v, v], -1), action=v.astype(np.int64), reward=v,
                          terminated=u[0] < 0.05, truncated=u[1] < 0.05,
                          info={"id": v.astype(np.int64)})


def run_workers(*targets, timeout: float = HANG_S) -> list:
    """Run each ``target(stop)`` in its own thread until the first returns (``stop`` is then set);
    re-raise the first error; every thread must finish within ``timeout`` (a hang, not a speed)."""
    stop, errors = threading.Event(), []

    def wrap(fn):
        def run():
            try:
                fn(stop)
            except BaseException as err:  # noqa: B036 - reported to the test below
                errors.append(err)
            finally:
                stop.set()
        return run

    threads = [threading.Thread(target=wrap(fn), daemon=True) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a worker did not finish in time (deadlock?)"
    if errors:
        raise errors[0]
    return threads


def check_windows(batch: Transition, idx: torch.Tensor, n: int) -> None:
    """Whole rows, consecutive steps of one env, next observations one row later, valid starts."""
    obs = batch.observation.reshape(-1, n, 2)
    v = obs[..., 0]
    for leaf in (obs[..., 1], batch.reward.reshape(-1, n), batch.action.reshape(-1, n).float(),
                 batch.info["id"].reshape(-1, n).float()):
        torn = (leaf != v).any(1)
        assert not torn.any(), f"torn rows: {v[torn][:3].tolist()} vs {leaf[torn][:3].tolist()}"
    steps = v - v[:, :1]
    assert torch.equal(steps, torch.arange(n, dtype=v.dtype) * E * torch.ones_like(v)), \
        f"a window jumps: {v[(steps != torch.arange(n) * E).any(1)][:3].tolist()}"
    assert torch.equal(batch.next_observation.reshape(-1, n, 2)[..., 0], v + E)
    # inferred next observations: never a truncation without its final observation (one that is also a termination
    # needs no successor)
    assert not (batch.truncated & ~batch.terminated).reshape(-1, n).any()
    assert torch.equal(idx % E, v[:, 0].long() % E)
    if batch.PER_weights is not None:
        w = batch.PER_weights
        assert torch.isfinite(w).all() and (w > 0).all() and (w <= 1).all(), w
    ended = (batch.terminated | batch.truncated).reshape(-1, n)
    mask = torch.cat([torch.ones_like(ended[:, :1]), ~ended[:, :-1]], 1).cumprod(1).bool()
    assert torch.equal(batch.mask.reshape(-1, n), mask)


def assert_masses_rebuilt_equal(buf, with_next_obs: bool, boundaries: str) -> None:
    """The masses kept current call by call equal those a fresh buffer rebuilds from the rows: no
    valid start lost its mass, no invalid one kept some."""
    fresh = type(buf)(**buf.copy_args())
    fresh.load_state_dict(buf.state_dict())
    got = buf.sampling_mass(with_next_obs, boundaries)
    want = fresh.sampling_mass(with_next_obs, boundaries)
    assert torch.equal(got > 0, want > 0), (got > 0).logical_xor(want > 0).nonzero()[:5]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


@pytest.mark.parametrize("prioritized", [False, True])
def test_actor_inserts_while_learners_sample_and_update(prioritized, host_backend):
    inserts = 1500 if host_backend == "torch" else 30  # Triton's interpreter runs the kernels on CPU: slow
    n = 3
    stream = Stream(0)
    kwargs = {"alpha": 0.7} if prioritized else {}
    cls = PrioritizedTransitionBuffer if prioritized else TransitionBuffer
    buf = cls(64 * E, 16, stream.rows(1), n_steps=n, device="cpu", seed=1, **kwargs)
    stream.step = 0
    buf.insert(stream.rows(8))
    counts = {"samples": 0, "inserts": 0}
    indices = {"return_indices": True}

    def actor(stop):  # inserts, and goes on until the learners sampled enough (a slow first draw)
        rng = np.random.default_rng(1)
        while counts["inserts"] < inserts or counts["samples"] < 10:
            buf.insert(stream.rows(int(rng.integers(1, 4))))
            counts["inserts"] += 1

    def learner(seed):
        def run(stop):
            gen = torch.Generator().manual_seed(seed)
            while not stop.is_set():
                batch, idx = buf.sample(gen, with_replacement=True, with_next_obs=True,
                                        boundaries="mask", **({} if prioritized else indices))
                check_windows(batch, idx, n)
                if prioritized:
                    buf.update_priorities(idx, torch.rand(idx.shape, generator=gen) * 5)
                counts["samples"] += 1
        return run

    run_workers(actor, learner(2), learner(3))
    assert counts["inserts"] >= inserts and counts["samples"] >= 10, counts  # both made their progress
    assert_masses_rebuilt_equal(buf, True, "mask")
    assert_masses_rebuilt_equal(buf, False, "allow")


def test_stacks_and_returns_while_an_actor_inserts():
    """Frame stacks and n-step returns sampled while rows arrive: every stack is one env's
    consecutive frames (the oldest possibly repeated as padding) ending at the start row, and every
    return sums exactly the rows its bootstrap observation says it took."""
    stream = Stream(5)
    buf = TransitionBuffer(48 * E, 16, stream.rows(1), device="cpu", seed=1)
    stream.step = 0
    buf.insert(stream.rows(6))
    k, gamma = 3, 0.5

    checked = []

    def actor(stop):  # inserts, and goes on until the learner checked enough (a slow first draw)
        inserts = 0
        while inserts < 1500 or sum(checked) < 160:
            buf.insert(stream.rows(1))
            inserts += 1

    def learner(stop):
        gen = torch.Generator().manual_seed(7)
        while not stop.is_set():
            b = buf.sample(gen, frame_stack=k, n_step_return=(2, gamma))
            frames = b.observation[..., 0]  # (B, k)
            start = frames[:, -1]
            assert torch.equal(b.action.float(), start) and torch.equal(b.info["id"].float(), start)
            gaps = frames.diff(dim=1)
            assert ((gaps == 0) | (gaps == E)).all(), frames
            # padding only at the oldest end: once a gap is E, the later ones are too
            assert (gaps.cummax(1).values == gaps).all(), frames
            nxt = b.next_observation[..., -1, 0]
            m = ((nxt - start) / E).round().long()
            assert ((m >= 1) & (m <= 2)).all(), (start, nxt)
            want = start + torch.where(m == 2, gamma * (start + E), 0)
            assert torch.allclose(b.reward.double(), want.double()), (b.reward, want, m)
            assert torch.allclose(b.discount.double(),
                                  torch.where(b.terminated, 0.0, gamma ** m.double()))
            checked.append(len(start))

    run_workers(actor, learner)
    assert sum(checked) >= 160


def test_planner_reads_while_a_thread_appends():
    """A HistoryBuffer appended by one thread (every key of a step holds the step's id) and read
    by two planner threads: no history mixes steps across keys, frames are strided and blocks are
    the entries between frames."""
    ab, n = 2, 4
    hist = HistoryBuffer(E, 16, action_block=ab, block_keys=("act",), device="cpu")

    checked = []

    def appender(stop):  # appends, and goes on until the planners checked enough
        s = 0
        while s < 3000 or len(checked) < 40:
            v = np.full((E, 1), s + 1, dtype=np.float32)
            hist.append({"a": v, "b": np.repeat(v[..., None], 3, -1), "act": v})
            if s % 97 == 0:
                hist.reset([0])
            s += 1

    def planner(stop):
        while not stop.is_set():
            got = hist.get(n)
            if got is None:
                continue
            checked.append(1)
            a, b, act = got["a"], got["b"].reshape(E, n, 3), got["act"]
            assert torch.equal(b, a[..., None].expand(E, n, 3)), (a, b)
            gaps = a.diff(dim=1)
            assert ((gaps == 0) | (gaps == ab)).all(), a
            real = gaps == ab  # blocks between real frames: the ab entries after the older frame
            want = a[:, :-1, None] + torch.arange(1, ab + 1)
            assert torch.equal(act[real], want[real]), (a, act)
            assert (act[~real] == 0).all(), (a, act)

    run_workers(appender, planner, planner)
    assert len(checked) >= 40


def test_hold_the_lock_to_make_several_calls_one_step():
    """``with buf.lock:`` keeps other threads out between a sample and its priority update."""
    stream = Stream(3)
    buf = PrioritizedTransitionBuffer(32 * E, 8, stream.rows(1), device="cpu", seed=0)
    buf.insert(stream.rows(10))
    inserted = threading.Event()
    with buf.lock:
        t = threading.Thread(target=lambda: (buf.insert(stream.rows(1)), inserted.set()))
        t.start()
        batch, idx = buf.sample()
        assert not inserted.wait(0.2)  # the actor waits for the lock
        buf.update_priorities(idx, torch.ones(len(idx)))
    t.join(10)
    assert inserted.is_set()


@pytest.mark.cuda
def test_two_threads_on_two_streams_are_ordered():
    """An actor inserting on one CUDA stream and a learner sampling on another: no sample reads a
    row an insert has queued but not finished (stream order follows the calls' order)."""
    stream = Stream(11)
    rows = stream.rows(1)
    buf = TransitionBuffer(256 * E, 64, rows, n_steps=3, device="cuda", seed=1)
    stream.step = 0
    buf.insert(stream.rows(8).to("cuda"))
    s_actor, s_learner = torch.cuda.Stream(), torch.cuda.Stream()

    def actor(stop):
        with torch.cuda.stream(s_actor):
            for _ in range(1000):
                buf.insert(stream.rows(2).to("cuda", non_blocking=True))

    def learner(stop):
        with torch.cuda.stream(s_learner):
            while not stop.is_set():
                b, idx = buf.sample(with_next_obs=True, boundaries="mask", return_indices=True)
                torch.cuda.current_stream().synchronize()
                check_windows(b.to("cpu"), idx.cpu(), 3)

    run_workers(actor, learner)


def test_a_signal_handler_that_writes_mid_call_is_refused():
    """A timer's handler inserting while the main thread samples (the handler runs between two
    bytecodes of the sample, on the same thread): the insert raises RuntimeError, every sample is
    whole, and the same handler between calls inserts."""
    import signal

    stream = Stream(9)
    buf = TransitionBuffer(64 * E, 16, stream.rows(1), n_steps=3, device="cpu", seed=1)
    stream.step = 0
    buf.insert(stream.rows(12))
    refused, landed = [], [0]

    busy = [False]

    def handler(signum, frame):
        if busy[0]:  # a timer tick inside this handler itself: skipped, so steps stay in order
            return
        busy[0] = True
        try:
            buf.insert(stream.rows(1))
            landed[0] += 1
        except RuntimeError as err:
            stream.step -= 1  # that row was not written: the next one takes its step
            refused.append(str(err))
        finally:
            busy[0] = False

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 0.0005, 0.0005)
    try:
        for _ in range(1500):
            batch, idx = buf.sample(with_next_obs=True, boundaries="mask", return_indices=True)
            check_windows(batch, idx, 3)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert refused and "insert: called while this thread is inside another call" in refused[0]
    before = len(buf)
    handler(signal.SIGALRM, None)  # between calls: it lands
    assert len(buf) == min(before + E, 64 * E)


def test_a_fork_never_waits_forever_on_nested_locks():
    """A thread holding one buffer's lock while it waits for another's (a grouped step, a source
    stepped under its replay's lock) while other threads fork: every fork goes through."""
    import os

    from gpubuf import EnvPoolSource

    envpool = needs("envpool")
    stream = Stream(4)
    replay = TransitionBuffer(32 * E, 4, stream.rows(1), device="cpu")
    hist = HistoryBuffer(E, 8, device="cpu")
    src = EnvPoolSource(envpool.make("CartPole-v1", env_type="gymnasium", num_envs=2), device="cpu",
                        history=HistoryBuffer(2, 4, device="cpu"))
    src.reset()
    forks = []

    def nester(stop):
        while not stop.is_set():
            with replay.lock:
                with hist.lock:
                    hist.append({"a": np.zeros((E, 1), np.float32)})
            with replay.lock:
                src.step(np.zeros(2, np.int64))

    def forker(stop):
        for _ in range(20):
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0)
            forks.append(pid)

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the fork's "still inside a call" warning
        run_workers(nester, forker)
    assert len(forks) == 20
