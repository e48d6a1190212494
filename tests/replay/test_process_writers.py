"""Writers in other processes: actor processes (spawned, real gymnasium envs) insert through ReplayWriter
handles into one buffer the test process owns and samples."""

import copy
import gc
import os
import pickle
import signal
import subprocess
import sys
import time

import numpy as np
import process_actors
import pytest
import torch
import torch.multiprocessing as mp
from extras import needs

from gpubuf import PrioritizedTransitionBuffer, RateLimiter, Transition, TransitionBuffer
from gpubuf.replay.feeds.process_writers import RowsWaiting, WriterDied

SPAWN = mp.get_context("spawn")
HANG_S = 600.0  # actors that have not finished after this long are stuck, not slow (the tests wait for progress)


def rows(T, E, start=0, shape=(3,)):
    n = np.arange(start, start + T, dtype=np.float32)
    obs = np.broadcast_to(n.reshape(T, 1, *([1] * len(shape))), (T, E, *shape)).copy()
    return Transition(observation=obs, action=np.broadcast_to(n[:, None], (T, E)).astype(np.float32),
                      reward=np.zeros((T, E), np.float32), terminated=np.zeros((T, E), bool),
                      truncated=np.zeros((T, E), bool))


def cartpole_sample(E):
    z = np.zeros((1, E), np.int64)
    return Transition(observation=np.zeros((1, E, 4), np.float32), action=z, reward=np.zeros((1, E), np.float32),
                      terminated=np.zeros((1, E), bool), truncated=np.zeros((1, E), bool),
                      info={"step": z, "actor": z})


def start(target, *args):
    p = SPAWN.Process(target=target, args=args, daemon=True)
    p.start()
    return p


def drain(buf, procs, deadline_s=HANG_S, sample=True):
    """Sample/collect until every process ended and nothing is left to commit."""
    end = time.monotonic() + deadline_s
    while any(p.is_alive() for p in procs):
        assert time.monotonic() < end, "actors did not finish"
        if sample and buf.num_valid() >= buf.sample_batch_size:
            buf.sample()
        else:
            buf.collect()
            time.sleep(0.01)
    for p in procs:
        p.join(10)
        assert p.exitcode == 0
    buf.collect()


def test_two_cartpole_actors_fill_their_lanes_in_order_with_a_rate_limiter():
    needs("gymnasium")  # the actors import it in their processes
    E_w, T, inserts = 3, 4, 30
    limiter = RateLimiter.sample_to_insert_ratio(samples_per_insert=2.0, min_size_to_sample=24, error_buffer=64.0,
                                                 timeout=HANG_S)
    buf = PrioritizedTransitionBuffer(2 * E_w * 200, 8, cartpole_sample(2 * E_w), seed=0, rate_limiter=limiter)
    writers = [buf.writer(envs=range(0, E_w), rows=16), buf.writer(envs=range(E_w, 2 * E_w), rows=16)]
    assert "envs 0..2 of PrioritizedTransitionBuffer" in repr(writers[0])
    procs = [start(process_actors.cartpole_actor, w, a, E_w, inserts, T, 10 + a) for a, w in enumerate(writers)]
    samples = 0
    end = time.monotonic() + HANG_S
    while limiter.inserts < 2 * E_w * inserts * T:
        assert time.monotonic() < end
        batch, idx = buf.sample()  # blocks on the limiter and commits the actors' rows meanwhile
        buf.update_priorities(idx, torch.rand(len(idx)))
        samples += len(idx)
        assert limiter.min_diff <= limiter.diff <= limiter.max_diff
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert len(buf) == 2 * E_w * inserts * T and limiter.samples == samples
    step, actor = buf.storage.data[("info", "step")], buf.storage.data[("info", "actor")]
    n = inserts * T
    assert (step[:n] == torch.arange(n)[:, None]).all()  # every lane in order, row t of every actor in row t
    assert (actor[:n] == torch.tensor([0] * E_w + [1] * E_w)).all()
    # the rows are the env's: an actor replayed with the same seed gives the same rows
    import gymnasium as gym
    env = gym.make_vec("CartPole-v1", num_envs=E_w, vectorization_mode="vector_entry_point")
    obs, _ = env.reset(seed=11)
    want, _ = process_actors.cartpole_rows(n, E_w, 1, 0, env, obs, np.random.default_rng(11))
    got = buf.storage.data
    assert torch.equal(got[("observation",)][:n, E_w:], torch.from_numpy(want.observation))
    assert torch.equal(got[("reward",)][:n, E_w:], torch.from_numpy(want.reward))
    assert torch.equal(got[("terminated",)][:n, E_w:], torch.from_numpy(want.terminated))


def test_an_actor_killed_mid_write_loses_only_its_rows_in_flight_and_is_reported():
    E, shape = 2, (64, 64)  # big rows: a kill lands inside a copy often
    buf = TransitionBuffer(E * 4000, 4, rows(1, E, shape=shape), seed=0)
    writer = buf.writer(rows=8)
    done = torch.zeros(1, dtype=torch.int64).share_memory_()
    proc = start(process_actors.numbered_actor, writer, E, shape, 3, 0, done)
    end = time.monotonic() + HANG_S
    while len(buf) < 300 * E:
        assert time.monotonic() < end
        buf.collect()
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    with pytest.raises(WriterDied, match=f"process {proc.pid} exited or was killed"):
        buf.collect()
    assert buf.collect() == 0  # reported once
    held = buf.ring.count
    assert held == int(done[0]) or held == int(done[0]) + 3  # published rows all in (the kill may follow a publish)
    obs = buf.storage.data[("observation",)][:held]
    assert (obs == torch.arange(held, dtype=torch.float32).view(-1, 1, 1, 1)).all()  # no torn row
    assert (buf.storage.data[("action",)][:held] == torch.arange(held).view(-1, 1)).all()
    # the lanes go to a new actor; the dead one's last row ends their episodes
    assert buf.sample(boundaries="forbid", batch_size=4) is not None
    again = buf.writer(rows=8)
    proc = start(process_actors.numbered_actor, again, E, shape, 3, 10_000, None, 30)
    drain(buf, [proc], sample=False)
    assert buf.ring.count == held + 30
    assert buf.storage.data[("truncated",)][held - 1].all()
    fresh = buf.storage.data[("observation",)][held:held + 30, :, 0, 0]
    assert (fresh == torch.arange(10_000, 10_030).view(-1, 1)).all()


def test_a_dead_actor_wakes_a_learner_waiting_on_the_limiter():
    E = 2
    limiter = RateLimiter.min_size(1000, timeout=HANG_S)  # not woken, it would end in TimeoutError
    buf = TransitionBuffer(E * 1000, 4, rows(1, E), seed=0, rate_limiter=limiter)
    proc = start(process_actors.kill_self_actor, buf.writer(), E)
    with pytest.raises(WriterDied):
        buf.sample()
    proc.join(10)
    assert len(buf) == E


def flat(value, T):
    return Transition(observation=np.full((T, 3), value, np.float32), action=np.zeros(T, np.float32),
                      reward=np.zeros(T, np.float32), terminated=np.zeros(T, bool), truncated=np.zeros(T, bool))


def test_writers_of_a_buffer_that_is_not_vectorized_commit_whole_inserts():
    buf = TransitionBuffer(1000, 4, flat(0, 1), vectorized_env=False, seed=0)
    with pytest.raises(ValueError, match="envs: a buffer with vectorized_env=False"):
        buf.writer(envs=range(0, 1))
    a, b = buf.writer(rows=16), buf.writer(rows=16)
    a.insert(flat(1, 5))
    b.insert(flat(2, 2))
    a.insert(flat(3, 3))
    assert buf.collect() == 10
    got = buf.storage.data[("observation",)][:10, 0].tolist()
    assert got == [1] * 5 + [3] * 3 + [2] * 2


def test_bad_writer_arguments_and_copies_are_refused():
    E = 4
    buf = TransitionBuffer(E * 50, 4, rows(1, E), seed=0)
    for bad in (range(0, 0), range(2, 6), range(-1, 2), range(0, 4, 2), 3, "all"):
        with pytest.raises(ValueError, match="envs: expected a non-empty range"):
            buf.writer(envs=bad)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="rows: expected a positive int"):
            buf.writer(rows=bad)
    with pytest.raises(ValueError, match="rows: expected at most the buffer's 50 rows"):
        buf.writer(rows=51)
    w = buf.writer(envs=slice(0, 2), rows=4)
    with pytest.raises(ValueError, match="overlaps the lanes range"):
        buf.writer(envs=range(1, 3))
    with pytest.raises(ValueError, match="still writes these lanes"):
        buf.writer(envs=range(0, 2))
    with pytest.raises(ValueError, match="expected shape"):
        w.insert(rows(2, E))  # 4 lanes into a 2-lane writer
    with pytest.raises(ValueError, match="1 <= T <= 4"):
        w.insert(rows(5, 2))
    with pytest.raises(ValueError, match="timeout: expected None or seconds >= 0, got 'x'"):
        w.insert(rows(1, 2), timeout="x")
    with pytest.raises(TimeoutError, match="did not make room"):
        w.insert(rows(4, 2)).insert(rows(1, 2), timeout=0.05)
    assert w.pending == 4 and buf.collect() == 0  # lanes 2..3 have no writer: nothing commits
    for c in (pickle.loads(pickle.dumps(w)), copy.deepcopy(w), copy.copy(w)):
        with pytest.raises(RuntimeError, match="a copy holding no shared memory"):
            c.insert(rows(1, 2))
    w.close()
    with pytest.raises(RuntimeError, match="closed"):
        w.insert(rows(1, 2))
    assert len(buf) == 0


def test_a_copy_or_a_forked_child_of_the_owner_takes_no_rows():
    E = 2
    buf = TransitionBuffer(E * 50, 4, rows(1, E), seed=0)
    w = buf.writer(rows=8)
    w.insert(rows(3, E))
    assert copy.deepcopy(buf).collect() == 0
    pid = os.fork()
    if pid == 0:  # the child's buffer commits nobody's rows
        os._exit(0 if buf.collect() == 0 and w.pending == 3 else 1)
    assert os.waitpid(pid, 0)[1] == 0
    assert buf.collect() == 3 * E and len(buf) == 3 * E


def test_write_backs_drop_rows_another_process_overwrote():
    E = 2
    buf = PrioritizedTransitionBuffer(E * 20, 8, rows(1, E), seed=0)
    buf.insert(rows(20, E))
    batch, idx, gen = buf.sample(return_generations=True)
    proc = start(process_actors.numbered_actor, buf.writer(rows=20), E, (3,), 20, 100, None, 20)
    drain(buf, [proc], sample=False)  # the actor's 20 rows replaced every row sampled
    buf.update_priorities(idx, torch.full((8,), 5.0), generations=gen)
    assert buf.stale_updates == 8
    assert torch.equal(buf.sampling_mass(), torch.ones(E * 20, dtype=torch.float64))


def test_a_source_feeds_a_writer_unless_its_env_resets_inside_the_ending_step():
    import gymnasium as gym

    from gpubuf import VectorEnvSource

    def env(mode):
        return gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync",
                            vector_kwargs={"autoreset_mode": mode})

    bufs = []
    for through_writer in (True, False):  # the same run into a writer and straight into a buffer
        source = VectorEnvSource(env(gym.vector.AutoresetMode.NEXT_STEP))
        buf = TransitionBuffer(2 * 100, 4, source.transition_sample(), seed=0)
        source.transitions = buf.writer() if through_writer else buf
        source.reset(seed=0)
        for t in range(40):
            source.step(np.full(2, t % 2, np.int64))
        buf.collect()
        bufs.append(buf)
    assert len(bufs[0]) == len(bufs[1]) > 2 * 30
    for path, t in bufs[1].storage.data.items():
        assert torch.equal(bufs[0].storage.data[path], t), path
    same = VectorEnvSource(env(gym.vector.AutoresetMode.SAME_STEP))
    other = TransitionBuffer(2 * 100, 4, same.transition_sample(), seed=0)
    with pytest.raises(ValueError, match="cannot end the episodes of rows it already handed on.*feed a writer from an "
                                         "env that keeps final observations .*NEXT_STEP autoreset vector env"):
        same.transitions = other.writer()


def test_an_actor_writes_into_a_storage_dir_buffer_that_reopens_with_its_rows(tmp_path):
    E = 2
    with TransitionBuffer(E * 100, 4, rows(1, E), seed=0, storage_dir=tmp_path / "replay") as buf:
        proc = start(process_actors.numbered_actor, buf.writer(rows=16), E, (3,), 5, 0, None, 40)
        drain(buf, [proc], sample=False)
        assert len(buf) == 40 * E
    again = TransitionBuffer(E * 100, 4, rows(1, E), seed=0, storage_dir=tmp_path / "replay")
    assert len(again) == 40 * E
    assert (again.storage.data[("action",)][:40] == torch.arange(40).view(-1, 1)).all()
    again.close()


def test_an_actor_killed_before_it_took_its_writer_up_is_reported_and_its_lanes_freed():
    E = 2
    buf = TransitionBuffer(E * 50, 4, rows(1, E), seed=0)
    proc = start(process_actors.numbered_actor, buf.writer(envs=range(0, 1)), 1, (3,), 1, 0, None, 5)
    os.kill(proc.pid, signal.SIGKILL)  # at once: maybe before the child unpickled the writer
    proc.join(10)
    with pytest.raises(WriterDied, match=f"its process {proc.pid} exited or was killed"):
        buf.collect()
    buf.writer(envs=range(0, 1))  # the lanes are free again


def test_a_dead_or_replaced_writer_refuses_to_write_again():
    E = 2
    buf = TransitionBuffer(E * 50, 4, rows(1, E), seed=0)
    old = buf.writer()
    proc = start(process_actors.numbered_actor, old, E, (3,), 1, 0, None, 2, False)  # exits without close()
    proc.join(HANG_S)
    with pytest.raises(WriterDied, match="every row it published is committed"):
        buf.collect()
    assert len(buf) == 2 * E
    with pytest.raises(RuntimeError, match="retired by the owner"):
        old.insert(rows(1, E))  # the handle taken up again (here by the owner itself)
    new = buf.writer()
    new.insert(rows(1, E, start=7))
    assert buf.collect() == E and buf.storage.data[("truncated",)][1].all()  # the seam ends the episodes


def test_a_buffer_whose_rows_could_never_pass_the_rate_limiter_is_refused():
    E = 16
    limiter = RateLimiter.sample_to_insert_ratio(1.0, min_size_to_sample=4, error_buffer=4)
    with pytest.raises(ValueError, match=r"rate_limiter: an insert of one row \(16 transitions\) moves .* by 16 and "
                                         "a sample of sample_batch_size=4 windows by 4, together more than its band "
                                         "max_diff - min_diff = 8"):
        TransitionBuffer(E * 50, 4, rows(1, E), seed=0, rate_limiter=limiter)


def forked(fn) -> None:
    """Run ``fn()`` in a forked child that then exits without closing anything (a writer it used dies)."""
    pid = os.fork()
    if pid == 0:
        try:
            fn()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def test_inserts_of_writers_land_whole_under_a_rate_limiter():
    """An insert the limiter holds back waits whole, and its writer goes first next time: no other writer's row
    lands inside it."""
    lim = RateLimiter(1.0, 1, 0.0, 6.0, timeout=0)
    buf = TransitionBuffer(1000, 1, flat(0, 1), vectorized_env=False, seed=0, rate_limiter=lim)
    b, a = buf.writer(rows=16), buf.writer(rows=16)
    assert a.max_insert == 5  # the band (6) holds an insert of 5 beside a sample of the batch (1)
    with pytest.raises(ValueError, match="transition: expected at most max_insert=5 rows per insert into this buffer"):
        a.insert(flat(9, 6))
    buf.insert(flat(0, 3))  # diff 3
    b.insert(flat(2, 1))
    a.insert(flat(1, 4))  # 4 rows, of which the limiter would let in 3 after b's row
    for i in range(12):
        b.insert(flat(10 + i, 1))
        try:
            buf.sample()  # commits first
        except TimeoutError:
            pass
    buf.collect()
    got = buf.storage.data[("observation",)][:len(buf), 0].tolist()
    at = got.index(1.0)
    assert got.count(1.0) == 4 and got[at:at + 4] == [1.0] * 4, got
    assert [v for v in got if v >= 2] == sorted(v for v in got if v >= 2)  # b's rows in order
    assert lim.min_diff <= lim.diff <= lim.max_diff


def test_rows_a_closed_writer_published_beyond_the_other_lanes_wait_and_are_reported():
    E = 2
    buf = TransitionBuffer(E * 50, 4, rows(1, E), seed=0)
    a, b = buf.writer(envs=range(0, 1)), buf.writer(envs=range(1, 2))
    a.insert(rows(5, 1))
    b.insert(rows(3, 1))
    a.close()
    b.close()
    with pytest.warns(RowsWaiting, match=r"\(2 of lanes range\(0, 1\)\) wait for rows of lanes range\(1, 2\), whose "
                                         r"writer .* ended .* buffer.writer\(envs=range\(1, 2\)\) hands"):
        assert buf.collect() == 3 * E
    assert a.pending == 2 and len(buf) == 3 * E
    c = buf.writer(envs=range(1, 2))  # a new writer of the short lanes: the waiting rows commit beside its rows
    c.insert(rows(2, 1, start=3))
    assert buf.collect() == 2 * E and a.pending == 0
    assert buf.storage.data[("action",)][:5, 0].tolist() == [0, 1, 2, 3, 4]


def test_can_sample_reports_a_dead_writer():
    """The docs' learner loop (``if replay.can_sample(): ... else: sleep``) learns of a dead actor whose lanes
    stall every commit."""
    E = 2
    buf = TransitionBuffer(E * 50, 4, rows(1, E), seed=0, rate_limiter=RateLimiter.min_size(8, timeout=0))
    dying, living = buf.writer(envs=range(0, 1)), buf.writer(envs=range(1, 2))
    forked(lambda: dying.insert(rows(2, 1)))
    living.insert(rows(5, 1))
    died = r"every row it published is committed; rows in flight are lost; hand its lanes .*range\(0, 1\)"
    with pytest.warns(RowsWaiting), pytest.raises(WriterDied, match=died):
        buf.can_sample()
    assert len(buf) == 2 * E and not buf.can_sample()  # reported once


def test_a_dead_writer_is_reported_once_the_rows_the_limiter_held_back_are_committed(tmp_path):
    lim = RateLimiter(1.0, 1, 0.0, 6.0, timeout=0)
    buf = TransitionBuffer(1000, 1, flat(0, 1), vectorized_env=False, seed=0, rate_limiter=lim)
    w = buf.writer(rows=16)
    buf.insert(flat(0, 1))
    forked(lambda: [w.insert(flat(v, 3)) for v in range(1, 5)])  # 12 rows, then dies
    assert buf.collect() == 3 and w.pending == 9  # the limiter holds 9 back: not reported yet
    for _ in range(40):
        try:
            buf.sample()
        except TimeoutError:
            pass
        except WriterDied as err:
            message = str(err)
            break
    else:
        raise AssertionError("the dead writer was never reported")
    assert "every row it published is committed" in message and "other lanes" not in message
    assert len(buf) == 13 and w.pending == 0  # reported after its rows were committed: a save now has them all
    buf.save(tmp_path / "ckpt")
    again = TransitionBuffer(1000, 1, flat(0, 1), vectorized_env=False, seed=0)
    again.load(tmp_path / "ckpt")
    assert again.storage.data[("observation",)][:13, 0].tolist() == [0] + [1] * 3 + [2] * 3 + [3] * 3 + [4] * 3


def test_a_closed_storage_dir_buffer_samples(tmp_path):
    E = 2
    buf = TransitionBuffer(E * 50, 4, rows(1, E), seed=0, storage_dir=tmp_path / "replay")
    w = buf.writer(rows=16)
    w.insert(rows(6, E))
    buf.close()  # commits what the writer published first
    assert len(buf) == 6 * E and buf.sample().observation.shape == (4, 3)
    with pytest.raises(RuntimeError, match="its buffer was closed or dropped by the owner"):
        w.insert(rows(2, E, start=6))  # after close() nothing could commit it: refused at once
    assert buf.sample().observation.shape == (4, 3) and buf.collect() == 0 and w.pending == 0
    again = TransitionBuffer(E * 50, 4, rows(1, E), seed=0, storage_dir=tmp_path / "replay")
    assert len(again) == 6 * E
    again.close()


@pytest.mark.parametrize("end", ["close", "drop"])
def test_a_writer_of_a_buffer_its_owner_closed_or_dropped_refuses_at_once(tmp_path, end):
    """After the owner closed its storage_dir buffer, or dropped the buffer (gc off: freed at once), the writer's
    next insert raises RuntimeError saying so, nothing published, instead of filling its queue and waiting."""
    gc.disable()
    try:
        buf = TransitionBuffer(100, 4, flat(0, 1), vectorized_env=False, seed=0, storage_dir=tmp_path / "d")
        w = buf.writer(rows=4)
        w.insert(flat(1, 2))
        if end == "close":
            buf.close()  # commits the 2 rows first
        else:
            del buf
        published = w.pending
        with pytest.raises(RuntimeError, match="its buffer was closed or dropped by the owner .* nothing was "
                                               "published"):
            w.insert(flat(2, 1), timeout=30)
        assert w.pending == published
    finally:
        gc.enable()


def test_without_ray_the_transport_names_the_extra():
    code = ("import sys; sys.modules['ray'] = None\n"
            "import numpy as np\nfrom gpubuf import Transition, TransitionBuffer\n"
            "b = TransitionBuffer(8, 1, Transition(observation=np.zeros((1, 2), np.float32), "
            "action=np.zeros((1, 2), np.float32), reward=np.zeros((1, 2), np.float32), "
            "terminated=np.zeros((1, 2), bool), truncated=np.zeros((1, 2), bool)))\n"
            "try:\n    b.writer(transport='ray')\nexcept ImportError as e:\n    print('IMPORTERROR', e)\n"
            "assert b._hub is None\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "IMPORTERROR" in out.stdout and "gpubuf[ray]" in out.stdout
