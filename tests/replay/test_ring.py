"""StartRing on its own (host only): write position, flag counts and per-kind validity against a
brute-force model that replays every write into a list of rows of (truncated, episode end) flags."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpubuf.replay.ring import IN_EPISODE, NEXT_OBS, StartRing


@settings(max_examples=60, deadline=None)
@given(M=st.integers(1, 9), E=st.integers(1, 3), n=st.integers(1, 4), seed=st.integers(0, 2**16),
       writes=st.lists(st.integers(1, 9), min_size=1, max_size=8))
def test_validity_and_counts_match_a_replay_of_every_write(M, E, n, seed, writes):
    if n > M:
        n = M
    rng = np.random.default_rng(seed)
    kinds = (0, NEXT_OBS, IN_EPISODE, NEXT_OBS | IN_EPISODE)
    ring = StartRing(M, E, n, kinds)
    truncs, ends = [], []  # (E,) flags per written row, oldest first (unbounded)
    for T in writes:
        T = min(T, M)
        trunc = rng.random((T, E)) < 0.2
        end = trunc | (rng.random((T, E)) < 0.2)  # terminated or truncated
        old_pos = ring.pos
        pos, first = ring.write(T, trunc, end)
        assert pos == old_pos and first == min(T, M - old_pos)
        truncs.extend(trunc)
        ends.extend(end)
        kept, kept_ends = truncs[-M:], ends[-M:]
        count = len(kept)
        assert ring.count == count and ring.pos == len(truncs) % M
        assert ring.n_trunc == int(np.count_nonzero(kept)) and ring.n_ends == int(np.count_nonzero(kept_ends))
        oldest_row = ring.pos if count == M else 0
        for kind in kinds:
            W = n + (kind & NEXT_OBS)
            want = np.zeros((M, E), dtype=bool)
            for t in range(count - W + 1):  # time index t = t-th oldest row
                row = (oldest_row + t) % M
                ok = np.ones(E, dtype=bool)
                if kind & NEXT_OBS:  # no truncation in the first n rows
                    ok &= ~np.any(kept[t:t + n], axis=0)
                if kind & IN_EPISODE and n > 1:  # no episode end in the first n - 1 rows
                    ok &= ~np.any(kept_ends[t:t + n - 1], axis=0)
                want[row] = ok
            ring.refresh(kind, 0, M)
            np.testing.assert_array_equal(ring.valid[kind], want)
            assert ring.n_valid[kind] == int(want.sum())
            if ring.one_range(kind):
                base, n_starts = ring.range_starts(kind)
                assert n_starts == int(want.sum()) and (n_starts == 0 or want[base].all())


@pytest.mark.parametrize("old_pos, T, M, W, want", [
    (0, 3, 10, 2, [(9, 10), (0, 3)]),  # rows 9 (its window now reaches row 0) and the three new rows
    (5, 2, 10, 3, [(3, 7)]),
    (8, 4, 10, 1, [(8, 10), (0, 2)]),
    (2, 10, 10, 4, [(2, 10), (0, 2)]),  # everything changed: all M rows, once
])
def test_changed_rows_cover_the_new_rows_and_the_windows_reaching_them(old_pos, T, M, W, want):
    ring = StartRing(M, 1, W, (0,))
    assert ring.changed_rows(old_pos, T, (0,)) == want


def test_restore_forgets_validity():
    ring = StartRing(4, 2, 1, (0, 1))
    flags = np.array([[0, 1], [0, 0], [0, 0]], dtype=bool)
    ring.write(3, flags, flags)
    ring.refresh(0, 0, 4)
    assert ring.n_valid[0] == 6
    ring.restore(1, 4, np.zeros((4, 2), dtype=bool), np.zeros((4, 2), dtype=bool))
    assert ring.n_valid == {0: 0, 1: 0} and not ring.valid[0].any() and ring.n_trunc == 0 and ring.n_ends == 0
    assert ring.range_starts(0) == (1, 8) and ring.range_starts(1) == (1, 6)
