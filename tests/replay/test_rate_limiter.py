"""RateLimiter: Reverb's samples-per-insert semantics on a replay buffer, held over long random schedules, blocking
calls from threads that never deadlock, exact counts through state_dict, copies and storage_dir."""

import copy
import math
import threading

import numpy as np
import pytest
import torch

from gpubuf import PrioritizedTransitionBuffer, RateLimiter, Transition, TransitionBuffer

E = 2


def rollout(T: int) -> Transition:
    return Transition(observation=np.random.rand(T, E, 3).astype(np.float32), action=np.zeros((T, E), np.float32),
                      reward=np.zeros((T, E), np.float32), terminated=np.zeros((T, E), bool),
                      truncated=np.zeros((T, E), bool))


def buffer(limiter, cls=TransitionBuffer, **kw):
    return cls(E * 64, 4, rollout(1), device="cpu", seed=0, rate_limiter=limiter, **kw)


@pytest.mark.parametrize("spi, min_size, error", [(4.0, 10, 12.0), (0.5, 6, 3.0), (1.0, 1, (2.0, 5.0))])
def test_a_random_schedule_holds_the_ratio_within_the_error_buffer(spi, min_size, error):
    """Single thread, non-blocking: every call the limiter allows runs, every other one times out at once and
    changes nothing; the counts are exact and ``inserts * spi - samples`` stays in its band."""
    lim = RateLimiter.sample_to_insert_ratio(spi, min_size, error, timeout=0)
    buf = TransitionBuffer(E * 64, 3, rollout(1), device="cpu", seed=0, rate_limiter=lim)  # default: the largest B
    below, above = error if isinstance(error, tuple) else (error, error)
    lo, hi = spi * min_size - below, spi * min_size + above
    rng = np.random.default_rng(0)
    inserted = sampled = refused = 0
    for _ in range(1500):
        if rng.random() < 0.5:
            T = int(rng.integers(1, 3))
            allowed = buf.can_insert(T * E)
            try:
                buf.insert(rollout(T))
                inserted += T * E
                assert allowed
            except TimeoutError:
                assert not allowed
                refused += 1
        else:
            B = int(rng.integers(1, 4))
            allowed = buf.can_sample(B)
            try:
                buf.sample(batch_size=B)
                sampled += B
                assert allowed
            except TimeoutError:
                assert not allowed
                refused += 1
        assert (lim.inserts, lim.samples) == (inserted, sampled)  # exact counts
        diff = lim.inserts * spi - lim.samples
        assert diff <= hi + 1e-9
        if lim.samples:
            assert diff >= lo - 1e-9
    assert refused and sampled and inserted
    assert abs(sampled / inserted - spi) <= (hi + 4) / inserted  # the ratio, within the band's width


def test_min_size_only_waits_for_the_first_rows():
    lim = RateLimiter.min_size(6, timeout=0)
    buf = buffer(lim)
    buf.insert(rollout(2))  # 4 transitions
    assert not buf.can_sample(1)
    with pytest.raises(TimeoutError, match="rate_limiter: a sample of 4 waited 0 s"):
        buf.sample()
    assert lim.samples == 0
    buf.insert(rollout(1))
    for _ in range(50):  # then nothing is limited
        buf.sample()
    assert lim.samples == 200 and lim.inserts == 6


def test_actor_and_learner_threads_block_on_each_other_and_never_deadlock():
    lim = RateLimiter.sample_to_insert_ratio(2.0, 8, 16.0, timeout=10)
    buf = buffer(lim, PrioritizedTransitionBuffer)
    errors, diffs = [], []

    def actor():
        try:
            for _ in range(150):
                buf.insert(rollout(1))
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    def learner():
        try:
            for _ in range(150):
                _, idx = buf.sample(batch_size=4, with_replacement=True)
                buf.update_priorities(idx, torch.rand(4))
                diffs.append(lim.inserts * 2.0 - lim.samples)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=actor), threading.Thread(target=learner)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    assert lim.inserts == 300 and lim.samples == 600
    assert min(diffs) >= 0 and max(diffs) <= 32  # within the band (16 +- 16), as seen after each sample


def test_a_blocked_call_times_out_holding_no_lock():
    lim = RateLimiter.sample_to_insert_ratio(1.0, 4, 3.0, timeout=0.3)  # band [1, 7]
    buf = buffer(lim)
    buf.insert(rollout(2))
    buf.insert(rollout(1))  # inserts 6: diff 6, one more row would take it past max_diff
    done = threading.Event()

    def blocked():
        with pytest.raises(TimeoutError, match="rate_limiter: an insert of 2 waited 0.3 s"):
            buf.insert(rollout(1))
        done.set()

    t = threading.Thread(target=blocked)
    t.start()
    assert len(buf) == 6 and buf.state_dict()["count"] == 3  # the buffer answers while the insert waits
    t.join(5)
    assert done.is_set() and lim.inserts == 6


def test_a_failed_call_gives_its_counts_back():
    lim = RateLimiter.min_size(1, timeout=0)
    buf = buffer(lim)
    with pytest.raises(ValueError):
        buf.insert(Transition(observation=np.zeros((1, E, 4), np.float32), action=np.zeros((1, E), np.float32),
                              reward=np.zeros((1, E), np.float32), terminated=np.zeros((1, E), bool),
                              truncated=np.zeros((1, E), bool)))
    assert lim.inserts == 0
    buf.insert(rollout(1))
    with pytest.raises(ValueError, match="boundaries"):
        buf.sample(boundaries="nope")
    assert lim.samples == 0


def test_counts_ride_along_state_dict_copies_and_storage_dir(tmp_path):
    lim = RateLimiter.sample_to_insert_ratio(1.0, 4, 8.0, timeout=0)
    buf = buffer(lim)
    buf.insert(rollout(4))
    buf.sample(batch_size=3)
    state = buf.state_dict()
    assert state["rate_limiter"] == {"inserts": 8, "samples": 3}

    other = buffer(RateLimiter.sample_to_insert_ratio(1.0, 4, 8.0, timeout=0))
    other.load_state_dict(state)
    assert (other.rate_limiter.inserts, other.rate_limiter.samples) == (8, 3)
    plain = buffer(None)
    plain.load_state_dict(state)  # a buffer without a limiter ignores the counts
    centred = buffer(RateLimiter.sample_to_insert_ratio(1.0, 4, 8.0, timeout=0))
    centred.load_state_dict(plain.state_dict())  # no counts: inserts = held, ratio in the middle of its band
    assert centred.rate_limiter.inserts == 8 and centred.rate_limiter.diff == pytest.approx(4.0)

    twin = copy.deepcopy(buf)
    assert twin.rate_limiter is not lim and (twin.rate_limiter.inserts, twin.rate_limiter.samples) == (8, 3)
    twin.sample(batch_size=2)
    assert lim.samples == 3  # independent

    d = tmp_path / "r"
    disk = buffer(RateLimiter.sample_to_insert_ratio(1.0, 4, 8.0, timeout=0), storage_dir=d)
    disk.insert(rollout(4))
    disk.sample(batch_size=5)
    disk.flush()
    disk.insert(rollout(1))  # after the flush: counted from the journal on re-open
    disk.close()
    again = buffer(RateLimiter.sample_to_insert_ratio(1.0, 4, 8.0, timeout=0), storage_dir=d)
    assert (again.rate_limiter.inserts, again.rate_limiter.samples) == (10, 5)
    again.close()


@pytest.mark.parametrize("make, exc, match", [
    (lambda: RateLimiter(0.0, 1, -1, 1), ValueError, "samples_per_insert: expected a finite number > 0"),
    (lambda: RateLimiter(1.0, 0, -1, 1), ValueError, "min_size_to_sample: expected an int >= 1"),
    (lambda: RateLimiter(1.0, 1, 0, 1), ValueError, r"min_diff, max_diff: expected max_diff - min_diff >= 2"),
    (lambda: RateLimiter(1.0, 1, math.nan, 1), ValueError, "min_diff: expected a number"),
    (lambda: RateLimiter(1.0, 1, -1, 1, timeout=-1), ValueError, "timeout: expected None or seconds >= 0"),
    (lambda: RateLimiter.sample_to_insert_ratio(1.0, 1, -2), ValueError, "error_buffer: expected a number >= 0"),
    (lambda: RateLimiter.sample_to_insert_ratio(1.0, 1, (1.0,)), ValueError,
     r"error_buffer: expected a number >= 0 or two of them \(below, above\), got \(1.0,\)"),
    (lambda: RateLimiter.sample_to_insert_ratio(1.0, 1, (1, 2, 3)), ValueError, "error_buffer: expected a number"),
    (lambda: RateLimiter.sample_to_insert_ratio(2.0, 1, (1.0, 2.0)), ValueError,
     r"error_buffer: expected below \+ above >= 4 \(2 \* max\(1, samples_per_insert\).*got \(1.0, 2.0\)"),
    (lambda: RateLimiter.sample_to_insert_ratio(1.0, 1, 0.5), ValueError, "error_buffer: expected below"),
    (lambda: buffer("fast"), TypeError, "rate_limiter: expected a gpubuf.RateLimiter or None, got str"),
    (lambda: buffer(RateLimiter.min_size(E * 64 + 1)), ValueError, "rate_limiter: min_size_to_sample=129 exceeds"),
])
def test_bad_limiters_are_refused(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def test_one_limiter_per_buffer_and_requests_that_could_never_run_are_refused():
    lim = RateLimiter.sample_to_insert_ratio(1.0, 2, 3.0, timeout=0)
    buf = buffer(lim)
    with pytest.raises(ValueError, match="rate_limiter: this RateLimiter already limits another buffer"):
        buffer(lim)
    buf.insert(rollout(1))
    with pytest.raises(ValueError, match="rate_limiter: a sample of 8 moves inserts"):
        buf.sample(batch_size=8)
    with pytest.raises(ValueError, match="n: expected a positive int"):
        buf.can_insert(0)
    assert lim.samples == 0


def test_a_pickled_or_forked_limited_buffer_keeps_counting():
    import multiprocessing as mp
    import pickle

    lim = RateLimiter.min_size(4, timeout=0)
    buf = buffer(lim)
    buf.insert(rollout(2))
    buf.sample(batch_size=3)
    twin = pickle.loads(pickle.dumps(buf))
    assert (twin.rate_limiter.inserts, twin.rate_limiter.samples) == (4, 3) and twin.rate_limiter is not lim
    twin.sample(batch_size=2)
    assert twin.rate_limiter.samples == 5 and lim.samples == 3

    def child(q):
        buf.insert(rollout(1))  # the child's own copy: its limiter counts, waits and wakes as the parent's
        buf.sample(batch_size=2)
        q.put((buf.rate_limiter.inserts, buf.rate_limiter.samples))

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    got = q.get(timeout=60)
    p.join(60)
    assert got == (6, 5) and p.exitcode == 0 and lim.inserts == 4


def reachable_deadlock(spi, m, lo, hi, inserts, samples, capacity=40, most=60):
    """A state (size, inserts, samples) that the limiter's own rules reach from empty, where an insert of some size in
    ``inserts`` and a sample of some size in ``samples`` both wait; None when none is reached (breadth first, up to
    ``most`` inserted transitions)."""
    lim = RateLimiter(spi, m, lo, hi)
    seen, todo = set(), [(0, 0, 0)]
    while todo:
        state = todo.pop()
        if state in seen:
            continue
        seen.add(state)
        lim.size, lim.inserts, lim.samples = state
        for i in inserts:
            for s in samples:
                if not lim.can_insert(i) and not lim.can_sample(s):
                    return state, i, s
        for i in inserts:
            if lim.can_insert(i) and state[1] + i <= most:
                todo.append((min(state[0] + i, capacity), state[1] + i, state[2]))
        for s in samples:
            if lim.can_sample(s):
                todo.append((state[0], state[1], state[2] + s))
    return None


@pytest.mark.parametrize("spi", [0.5, 1.0, 2.0, 3.0])
def test_the_band_rule_proves_no_deadlock(spi):
    """Every configuration the limiter accepts (a band at least one insert's and one sample's moves wide) reaches no
    state where both wait, over every schedule; one narrower (the band [0, 8], inserts of 4, samples of 7) does."""
    for m in (1, 3, 7):
        for inserts, samples in (((1,), (1,)), ((4,), (7,)), ((1, 2, 4), (1, 3, 7)), ((3,), (2, 5))):
            span = max(max(inserts) * spi + max(samples), 2 * max(1.0, spi))  # the narrowest band accepted
            for lo in (-3.0, 0.0, 2.5):
                assert reachable_deadlock(spi, m, lo, lo + span, inserts, samples) is None, (m, inserts, samples, lo)
    assert reachable_deadlock(1.0, 1, 0.0, 8.0, (4,), (7,)) is not None


def flat(T: int) -> Transition:
    return Transition(observation=np.zeros((T, 3), np.float32), action=np.zeros(T, np.float32),
                      reward=np.zeros(T, np.float32), terminated=np.zeros(T, bool), truncated=np.zeros(T, bool))


def test_a_band_too_narrow_for_the_calls_is_refused_not_deadlocked():
    """The band [0, 8] with inserts of 4 transitions and samples of 7: the second size seen is refused, naming
    both; two threads then end with that error instead of waiting forever."""
    lim = RateLimiter(1.0, 1, 0.0, 8.0, timeout=0)
    buf = TransitionBuffer(64, 7, flat(1), vectorized_env=False,
                           device="cpu", seed=0, rate_limiter=lim)
    buf.insert(flat(4))  # filling up: never waits
    with pytest.raises(ValueError, match=r"rate_limiter: an insert of 4 moves .* by 4 and a sample \(7 windows\) "
                                         "seen before by 7: together more than max_diff - min_diff = 8, so both "
                                         "could wait for each other forever"):
        buf.insert(flat(4))  # the default sample of 7 counts as seen from the start
    assert lim.inserts == 4 and buf.insert(flat(1)) is buf  # a size the band holds runs
    lim = RateLimiter(1.0, 1, 0.0, 8.0, timeout=0)
    buf = TransitionBuffer(64, 4, flat(1), vectorized_env=False, device="cpu", seed=0, rate_limiter=lim)
    buf.insert(flat(4))
    buf.insert(flat(4))
    with pytest.raises(ValueError, match=r"rate_limiter: a sample of 7 moves .* by 7 and an insert \(4 transitions\) "
                                         "seen before by 4: together more than max_diff - min_diff = 8"):
        buf.sample(batch_size=7)  # a sample larger than the default: checked against the inserts seen
    assert lim.samples == 0 and buf.sample(batch_size=4) is not None

    lim = RateLimiter(1.0, 1, 0.0, 8.0, timeout=3)  # the actor left alone ends by this timeout
    buf = TransitionBuffer(64, 7, flat(1), vectorized_env=False,
                           device="cpu", seed=0, rate_limiter=lim)
    errors = []

    def run(fn):
        def go():
            try:
                for _ in range(50):
                    fn()
            except (ValueError, TimeoutError) as err:
                errors.append(err)
        return go

    threads = [threading.Thread(target=run(lambda: buf.insert(flat(4)))),
               threading.Thread(target=run(buf.sample))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    refused = [e for e in errors if isinstance(e, ValueError)]
    assert refused and "could wait for each other forever" in str(refused[0])


def test_a_buffer_narrower_than_a_row_and_a_batch_is_refused():
    lim = RateLimiter.sample_to_insert_ratio(1.0, 4, 2.0)  # band 4: a row of 2 envs and a batch of 4 need 6
    with pytest.raises(ValueError, match=r"rate_limiter: an insert of one row \(2 transitions\) .* by 2 and a sample "
                                         "of sample_batch_size=4 windows by 4, together more than its band"):
        buffer(lim)


def test_a_reopened_storage_dir_counts_every_insert_after_the_last_flush(tmp_path):
    d = tmp_path / "r"
    disk = buffer(RateLimiter.min_size(4, timeout=0), storage_dir=d)  # 64 rows per env
    disk.insert(rollout(10))
    disk.sample(batch_size=3)
    disk.flush()
    for _ in range(4):
        disk.insert(rollout(26))  # 104 rows after the flush: more than the ring holds
    counts = (disk.rate_limiter.inserts, disk.rate_limiter.samples)
    disk.storage.dir.close()  # as a killed process leaves it: no flush
    again = buffer(RateLimiter.min_size(4, timeout=0), storage_dir=d)
    assert (again.rate_limiter.inserts, again.rate_limiter.samples) == counts == (114 * E, 3)
    again.close()


def test_an_insert_that_would_shut_out_the_default_sample_is_refused():
    """The band holds a row and a default sample (12 >= 2 + 7), so the buffer is accepted; an insert of 4
    transitions (diff + 8) beside a sample of 7 would not fit, and the default sample counts as seen from the start:
    the insert is refused naming both, nothing counted, and the default sample keeps running."""
    lim = RateLimiter(2.0, 1, 0.0, 12.0, timeout=1)
    buf = TransitionBuffer(100, 7, flat(1), vectorized_env=False, device="cpu", seed=0, rate_limiter=lim)
    buf.insert(flat(1))  # filling up: never checked
    with pytest.raises(ValueError, match=r"rate_limiter: an insert of 4 moves .* by 8 and a sample \(7 windows\) "
                                         r"seen before by 7: together more than max_diff - min_diff = 12"):
        buf.insert(flat(4))
    assert lim.inserts == 1 and len(buf) == 1
    for _ in range(3):
        while not buf.can_sample():
            buf.insert(flat(2))  # moves diff by 4: fits beside 7
        assert buf.sample().observation.shape == (7, 3)  # the default sample is never refused


def test_numpy_numbers_configure_a_limiter_as_python_numbers_do():
    a = RateLimiter.sample_to_insert_ratio(np.float32(2), np.int64(10), (np.float32(2), np.int64(4)),
                                           timeout=np.float64(1))
    b = RateLimiter.sample_to_insert_ratio(2.0, 10, (2.0, 4), timeout=1.0)
    assert a.config() == b.config() and all(type(v) in (int, float) for v in a.config())
    assert RateLimiter.sample_to_insert_ratio(1.0, 4, np.int64(4)).config() == \
        RateLimiter.sample_to_insert_ratio(1.0, 4, 4).config()
    for bad in (np.True_, True):
        with pytest.raises(ValueError, match="min_size_to_sample: expected an int >= 1"):
            RateLimiter(1.0, bad, 0.0, 8.0)
        with pytest.raises(ValueError, match="error_buffer: expected a number >= 0"):
            RateLimiter.sample_to_insert_ratio(1.0, 4, bad)
