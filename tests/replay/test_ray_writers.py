"""Ray actors as writers: real Ray actors on a local Ray cluster step gymnasium CartPole envs and insert through
RayWriter handles into one buffer the test process (the learner) owns and samples."""

import time
import warnings

import numpy as np
import pytest
import torch
from extras import needs

from gpubuf import PrioritizedTransitionBuffer, RateLimiter, Transition, TransitionBuffer, Unit
from gpubuf.replay.feeds.process_writers import RowsWaiting

ray = needs("ray")
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
HANG_S = 300.0


@pytest.fixture(scope="module")
def cluster():
    """A local Ray instance with three worker CPUs; its workers import the tests' actor module."""
    import ray_actors

    ray_actors.start_ray(num_cpus=3, include_dashboard=False)
    yield ray.remote(num_cpus=1)(ray_actors.CartPoleActor), ray_actors
    ray.shutdown()


def cartpole_sample(E):
    z = np.zeros((1, E), np.int64)
    return Transition(observation=np.zeros((1, E, 4), np.float32), action=z, reward=np.zeros((1, E), np.float32),
                      terminated=np.zeros((1, E), bool), truncated=np.zeros((1, E), bool),
                      info={"step": z, "actor": z})


def flat_sample():
    """One row of a buffer of two lanes whose observations are 3 numbers (NumberedActor's rows)."""
    return Transition(observation=np.zeros((1, 2, 3), np.float32), action=np.zeros((1, 2), np.float32),
                      reward=np.zeros((1, 2), np.float32), terminated=np.zeros((1, 2), bool),
                      truncated=np.zeros((1, 2), bool))


def until(condition, what):
    end = time.monotonic() + HANG_S
    while not condition():
        assert time.monotonic() < end, what
        time.sleep(0.01)


def drain(buf, runs):
    """Commit what the actors publish until their calls returned; their results."""
    end = time.monotonic() + HANG_S
    while not all(ray.wait([r], timeout=0)[0] for r in runs):
        assert time.monotonic() < end, "the actors did not finish"
        buf.collect()
        time.sleep(0.005)
    out = ray.get(runs)
    buf.collect()
    return out


def check_rows(buf, logs, held):
    """Every held row equals its actor's log at its step and lane (``logs``: actor -> (log, first lane))."""
    data = buf.storage.data
    steps, actors = data[("info", "step")][:held], data[("info", "actor")][:held]
    for a, (log, lane0) in logs.items():
        E = log.observation.shape[1]
        for j in range(E):
            mine = actors[:, lane0 + j] == a
            s = steps[mine, lane0 + j].numpy()
            assert np.array_equal(data[("observation",)][:held, lane0 + j][mine].numpy(), log.observation[s, j])
            assert np.array_equal(data[("action",)][:held, lane0 + j][mine].numpy(), log.action[s, j])
            assert np.array_equal(data[("reward",)][:held, lane0 + j][mine].numpy(), log.reward[s, j])
            assert np.array_equal(data[("terminated",)][:held, lane0 + j][mine].numpy(), log.terminated[s, j])


def check_sampled(batch, logs, n_envs):
    """Every sampled transition equals its actor's log at its step and lane (flat start = row * n_envs + lane)."""
    lanes, actors, steps = (batch.indices % n_envs).tolist(), batch.info["actor"].tolist(), batch.info["step"].tolist()
    for k, (a, step, lane) in enumerate(zip(actors, steps, lanes, strict=True)):
        log, lane0 = logs[a]
        assert np.array_equal(batch.observation[k].numpy(), log.observation[step, lane - lane0])
        assert batch.action[k] == log.action[step, lane - lane0] and batch.reward[k] == log.reward[step, lane - lane0]


def test_two_cartpole_actors_feed_one_per_buffer_and_a_killed_one_is_reported_once(cluster):
    Actor, ray_actors = cluster
    E_w, T = 2, 8
    buf = PrioritizedTransitionBuffer(2 * E_w * 4000, 4, cartpole_sample(2 * E_w), seed=0)
    writers = [buf.writer(envs=range(0, E_w), rows=32, transport="ray"),
               buf.writer(envs=range(E_w, 2 * E_w), rows=32, transport="ray")]
    assert "envs 0..1 of PrioritizedTransitionBuffer" in repr(writers[0])
    actors = [Actor.remote(w, a, E_w, 10 + a) for a, w in enumerate(writers)]
    runs = [actors[0].run.remote(300, T), actors[1].run.remote(10_000, T, close=False)]
    until(lambda: buf.collect() >= 0 and len(buf) >= 40 * 2 * E_w, "the actors' rows did not come in")
    batch, idx = buf.sample()
    buf.update_priorities(idx, torch.rand(len(idx)))
    ray.kill(actors[1])
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(runs[1])
    died = [ray_actors.reported_dead(buf)]
    assert "Ray actor" in died[0] and "died" in died[0] and "range(2, 4)" in died[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RowsWaiting)
        buf.collect()  # reported once: no second WriterDied
    held = buf.ring.count
    killed_rows = int((buf.storage.data[("info", "actor")][:held, E_w] == 1).sum()) + writers[1].pending
    assert killed_rows % T == 0 and killed_rows >= 40
    # a new actor takes the dead one's lanes; the first actor's waiting rows commit beside its rows
    again = buf.writer(envs=range(E_w, 2 * E_w), rows=32, transport="ray")
    actors.append(Actor.remote(again, 2, E_w, 12))
    runs.append(actors[2].run.remote(300 - killed_rows // T, T))
    n0, n2 = drain(buf, [runs[0], runs[2]])
    assert n0 == 300 * T
    assert len(buf) == n0 * 2 * E_w
    logs = {0: (ray_actors.cartpole_log(0, E_w, 10, n0), 0), 1: (ray_actors.cartpole_log(1, E_w, 11, killed_rows), E_w),
            2: (ray_actors.cartpole_log(2, E_w, 12, n2), E_w)}
    check_rows(buf, logs, buf.ring.count)
    assert buf.storage.data[("truncated",)][killed_rows - 1, E_w:].all()  # the dead actor's last row ends episodes
    assert (buf.storage.data[("info", "actor")][killed_rows:n0, E_w:] == 2).all()
    for _ in range(5):
        batch, idx = buf.sample()
        check_sampled(batch, logs, 2 * E_w)
        buf.update_priorities(idx, torch.rand(len(idx)))


def test_rows_flushed_before_a_kill_are_all_committed(cluster):
    Actor, ray_actors = cluster
    buf = TransitionBuffer(2 * 500, 4, cartpole_sample(2), seed=5)
    w = buf.writer(rows=64, transport="ray")
    actor = Actor.remote(w, 0, 2, 50)
    assert ray.get(actor.run.remote(5, 8, close=False)) == 40  # flushed: published, none committed yet maybe
    ray.kill(actor)
    died = [ray_actors.reported_dead(buf)]
    assert "every row it published is committed" in died[0]
    assert buf.ring.count == 40
    check_rows(buf, {0: (ray_actors.cartpole_log(0, 2, 50, 40), 0)}, 40)


def test_a_rate_limiter_holds_ray_actors_back(cluster):
    Actor, ray_actors = cluster
    E_w, T, inserts = 2, 4, 40
    limiter = RateLimiter.sample_to_insert_ratio(samples_per_insert=2.0, min_size_to_sample=16, error_buffer=64.0,
                                                 timeout=HANG_S)
    buf = PrioritizedTransitionBuffer(2 * E_w * 400, 8, cartpole_sample(2 * E_w), seed=1, rate_limiter=limiter)
    writers = [buf.writer(envs=range(0, E_w), rows=8, transport="ray"),
               buf.writer(envs=range(E_w, 2 * E_w), rows=8, transport="ray")]
    actors = [Actor.remote(w, a, E_w, 20 + a) for a, w in enumerate(writers)]
    runs = [a.run.remote(inserts, T) for a in actors]
    samples = 0
    end = time.monotonic() + HANG_S
    while limiter.inserts < 2 * E_w * inserts * T:
        assert time.monotonic() < end
        batch, idx = buf.sample()  # waits on the limiter, committing the actors' rows meanwhile
        samples += len(idx)
        assert limiter.min_diff <= limiter.diff <= limiter.max_diff
    assert ray.get(runs) == [inserts * T] * 2
    assert len(buf) == 2 * E_w * inserts * T and limiter.samples == samples
    logs = {a: (ray_actors.cartpole_log(a, E_w, 20 + a, inserts * T), a * E_w) for a in range(2)}
    check_rows(buf, logs, inserts * T)


def test_write_backs_check_generations_while_ray_actors_write(cluster):
    Actor, _ = cluster
    buf = PrioritizedTransitionBuffer(64, 2, cartpole_sample(2), seed=2)
    w = buf.writer(rows=16, transport="ray")
    actor = Actor.remote(w, 0, 2, 30)
    drain(buf, [actor.run.remote(2, 8, close=False)])
    batch = buf.sample(batch_size=16, unit=Unit.window())
    idx = batch.indices
    drain(buf, [actor.run.remote(4, 8)])  # the ring (32 rows per env) wraps over what was sampled
    buf.update_priorities(idx, torch.full((16,), 7.0), generations=batch.generations)
    assert buf.stale_updates == 16  # every sampled row was recycled: nothing written
    assert buf.max_priority == 1.0
    fresh = buf.sample(batch_size=16, unit=Unit.window())
    buf.update_priorities(fresh.indices, torch.full((16,), 7.0), generations=fresh.generations)
    assert buf.stale_updates == 0 and buf.max_priority > 1.0  # current rows take their write-backs


def test_a_not_vectorized_buffer_commits_each_ray_insert_whole(cluster):
    _, ray_actors = cluster
    Numbered = ray.remote(num_cpus=1)(ray_actors.NumberedActor)
    sample = Transition(observation=np.zeros((1, 3), np.float32), action=np.zeros(1, np.float32),
                        reward=np.zeros(1, np.float32), terminated=np.zeros(1, bool), truncated=np.zeros(1, bool))
    buf = TransitionBuffer(10_000, 2, sample, vectorized_env=False, seed=3)
    writers = [buf.writer(rows=24, transport="ray") for _ in range(2)]
    actors = [Numbered.remote(w, None, (3,)) for w in writers]
    runs = [actors[0].run.remote(6, 600, 0), actors[1].run.remote(6, 600, 100_000)]
    drain(buf, runs)
    obs = buf.storage.data[("observation",)][:1200, 0].numpy()
    assert sorted(obs.tolist()) == sorted(list(range(600)) + list(range(100_000, 100_600)))
    for start in range(0, 1200, 6):  # inserts whole: six consecutive numbers of one actor
        block = obs[start:start + 6]
        assert (np.diff(block) == 1).all()


def test_bad_inserts_from_an_actor_are_refused_naming_the_leaf(cluster):
    Actor, _ = cluster
    buf = TransitionBuffer(64, 2, cartpole_sample(2), seed=4)
    w = buf.writer(rows=8, transport="ray")
    actor = Actor.remote(w, 0, 2, 40)
    bad = cartpole_sample(3)  # three lanes, the writer has two
    with pytest.raises(ray.exceptions.RayTaskError, match="observation: expected shape"):
        ray.get(actor.insert.remote(bad))
    one = cartpole_sample(2)
    too_many = Transition(observation=one.observation.repeat(9, 0), action=one.action.repeat(9, 0),
                          reward=one.reward.repeat(9, 0), terminated=one.terminated.repeat(9, 0),
                          truncated=one.truncated.repeat(9, 0),
                          info={k: v.repeat(9, 0) for k, v in one.info.items()})
    with pytest.raises(ray.exceptions.RayTaskError, match="T <= 8|at most"):
        ray.get(actor.insert.remote(too_many))
    assert ray.get(actor.insert.remote(cartpole_sample(2))) == 1
    buf.collect()
    assert len(buf) == 2  # only the good insert
    with pytest.raises(RuntimeError, match="inside a Ray actor"):
        w.insert(cartpole_sample(2))
    with pytest.raises(ValueError, match="transport: expected"):
        buf.writer(rows=8, transport="tcp")
    ray.get(actor.close.remote())
    with pytest.raises(ray.exceptions.RayTaskError, match="closed"):
        ray.get(actor.insert.remote(cartpole_sample(2)))


def test_a_narrowed_storage_takes_float32_and_bfloat16_rows_from_an_actor(cluster):
    Actor, _ = cluster
    buf = TransitionBuffer(2 * 64, 2, cartpole_sample(2), storage_dtypes={"observation": torch.bfloat16}, seed=6)
    actor = Actor.remote(buf.writer(rows=16, transport="ray"), 0, 2, 60)
    one = cartpole_sample(2)
    first = Transition(observation=np.full((1, 2, 4), 1.5, np.float32), action=one.action, reward=one.reward,
                       terminated=one.terminated, truncated=one.truncated, info=one.info)
    second = Transition(observation=torch.full((1, 2, 4), 2.5, dtype=torch.bfloat16), action=one.action,
                        reward=one.reward, terminated=one.terminated, truncated=one.truncated, info=one.info)
    ray.get([actor.insert.remote(first), actor.insert.remote(second)])
    ray.get(actor.close.remote())  # flushes
    buf.collect()
    obs = buf.storage.data[("observation",)]
    assert obs.dtype == torch.bfloat16 and len(buf) == 4
    assert (obs[0] == 1.5).all() and (obs[1] == 2.5).all()


def test_threads_of_one_actor_insert_one_at_a_time_and_every_row_lands_once(cluster):
    _, ray_actors = cluster
    Numbered = ray.remote(num_cpus=1, max_concurrency=4)(ray_actors.NumberedActor)
    buf = TransitionBuffer(2 * 4000, 2, flat_sample(), seed=7)
    actor = Numbered.remote(buf.writer(rows=8, transport="ray"), 2, (3,))
    runs = [actor.run.remote(4, 100, 1000 * k) for k in range(4)]
    drain(buf, runs)
    got = buf.storage.data[("action",)][:400, 0].tolist()
    assert sorted(got) == sorted(float(1000 * k + i) for k in range(4) for i in range(100))


def test_a_storage_dir_close_commits_what_ray_actors_published_and_ends_them(cluster, tmp_path):
    Actor, _ = cluster
    buf = TransitionBuffer(2 * 64, 2, cartpole_sample(2), storage_dir=tmp_path / "d", seed=8)
    actor = Actor.remote(buf.writer(rows=16, transport="ray"), 0, 2, 80)
    assert ray.get(actor.run.remote(3, 4, close=False)) == 12  # flushed: published, not collected
    buf.close()
    assert len(buf) == 24
    for _ in range(3):  # and every call after it
        with pytest.raises(ray.exceptions.RayTaskError, match="closed or dropped by the learner"):
            ray.get(actor.run.remote(2, 4, close=False))
    again = TransitionBuffer(2 * 64, 2, cartpole_sample(2), storage_dir=tmp_path / "d", seed=8)
    assert len(again) == 24
    again.close()


def test_an_actor_killed_before_inserting_is_reported_and_its_lanes_go_on(cluster):
    Actor, ray_actors = cluster
    buf = TransitionBuffer(2 * 64, 2, cartpole_sample(2), seed=9)
    actor = Actor.remote(buf.writer(rows=8, transport="ray"), 0, 2, 90)
    assert ray.get(actor.published.remote()) == 0  # it holds the writer, never inserted
    ray.kill(actor)
    assert "died" in ray_actors.reported_dead(buf)
    fresh = Actor.remote(buf.writer(rows=8, transport="ray"), 1, 2, 91)
    assert drain(buf, [fresh.run.remote(2, 4)]) == [8]
    assert len(buf) == 16


def test_lanes_go_to_a_new_writer_right_after_close_and_a_copy_cannot_close_them(cluster):
    Actor, _ = cluster
    buf = TransitionBuffer(2 * 64, 2, cartpole_sample(2), seed=10)
    w = buf.writer(rows=8, transport="ray")
    holder, other = Actor.remote(w, 0, 2, 100), Actor.remote(w, 1, 2, 101)
    assert drain(buf, [holder.run.remote(1, 4, close=False)]) == [4]
    with pytest.raises(ray.exceptions.RayTaskError, match="which alone closes it"):
        ray.get(other.close.remote())
    ray.get(holder.close.remote())
    nxt = Actor.remote(buf.writer(rows=8, transport="ray"), 2, 2, 102)  # no collect() between
    assert drain(buf, [nxt.run.remote(1, 4)]) == [4]
    assert len(buf) == 16


def test_an_actor_restarted_by_ray_needs_a_new_writer(cluster):
    _, ray_actors = cluster
    Restartable = ray.remote(num_cpus=1, max_restarts=1)(ray_actors.CartPoleActor)
    buf = TransitionBuffer(2 * 64, 2, cartpole_sample(2), seed=11)
    w = buf.writer(rows=8, transport="ray")
    actor = Restartable.remote(w, 0, 2, 110)
    assert drain(buf, [actor.run.remote(1, 4, close=False)]) == [4]
    ray.kill(actor, no_restart=False)
    end, first_life = time.monotonic() + HANG_S, 1
    while True:  # a call may still reach its first life (the kill is asynchronous), fail while it restarts; then
        assert time.monotonic() < end  # its insert is refused
        try:
            ray.get(actor.run.remote(1, 4, close=False))
            first_life += 1
        except ray.exceptions.RayTaskError as err:
            assert "restarted by Ray" in str(err)
            break
        except ray.exceptions.RayActorError:
            time.sleep(0.1)
    w.close()  # in the learner: ends the writer its first life held
    buf.collect()
    assert len(buf) == first_life * 8  # nothing of its second life
    nxt = Restartable.remote(buf.writer(rows=8, transport="ray"), 1, 2, 111)
    assert drain(buf, [nxt.run.remote(1, 4)]) == [4]
    assert len(buf) == first_life * 8 + 8
