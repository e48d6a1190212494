"""Random insert / update_priorities / sample sequences against the pure-Python model (torch backend)."""

import numpy as np
import pytest
import torch
from fixtures import Model, check_windows, make_transition
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpubuf import PrioritizedTransitionBuffer

op = st.one_of(
    st.tuples(st.just("insert"), st.integers(1, 6), st.lists(st.integers(0, 5), max_size=2)),
    st.tuples(st.just("update"), st.lists(st.integers(0, 10**6), min_size=1, max_size=8),
              st.lists(st.floats(-5, 5), min_size=8, max_size=8)),
    st.tuples(st.just("sample"), st.integers(1, 6), st.booleans(), st.booleans()),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(E=st.integers(1, 3), M=st.integers(3, 7), n=st.integers(1, 3), ops=st.lists(op, min_size=1, max_size=12),
       seed=st.integers(0, 2**31))
def test_random_sequences_match_model(E, M, n, ops, seed):
    if n > M:
        return
    alpha = 0.8
    buf = PrioritizedTransitionBuffer(M * E, 1, make_transition(0, 1, E), n_steps=n, alpha=alpha, device="cpu",
                                      seed=seed)
    model = Model(M, E, n)
    for step, o in enumerate(ops):
        if o[0] == "insert":
            T = min(o[1], M)
            trunc = {model.total + s for s in o[2] if s < T}
            buf.insert(make_transition(model.total, T, E, trunc_steps=trunc))
            model.insert(T, trunc)
        elif o[0] == "update":
            idx = [i % (M * E) for i in o[1]]
            td = o[2][:len(idx)]
            buf.update_priorities(np.array(idx), np.array(td))
            model.update(idx, td, buf.eps)
        else:
            _, B, replace, wno = o
            valid = model.valid_starts(wno)
            assert buf.num_valid(wno) == len(valid)
            if not valid or (not replace and B > len(valid)):
                with pytest.raises(ValueError):
                    buf.sample(key=step, batch_size=B, with_replacement=replace, with_next_obs=wno)
                continue
            batch, idx = buf.sample(key=step, batch_size=B, with_replacement=replace, with_next_obs=wno)
            check_windows(batch, idx, model, wno)
            if not replace:
                assert len(set(idx.tolist())) == B
        # tree leaves = priority**alpha on valid starts, 0 elsewhere
        for wno in (False, True):
            valid = model.valid_starts(wno)
            want = torch.tensor([model.prio.get(i, 0.0) ** alpha if i in valid else 0.0 for i in range(M * E)],
                                dtype=torch.float64)
            torch.testing.assert_close(buf.sampling_mass(wno).cpu(), want, rtol=1e-6, atol=0)
        assert buf.max_priority == pytest.approx(model.max_prio, rel=1e-6)
