"""HistoryBuffer equals the pure-Python model of its contract (``history_model.HistoryModel``) after
any random sequence of appends (all envs or subsets, NaN actions), resets and gets, on both
backends."""

import numpy as np
import pytest
from history_model import HistoryModel
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpubuf import HistoryBuffer


@st.composite
def scenarios(draw):
    n_envs = draw(st.integers(1, 5))
    cfg = dict(n_envs=n_envs, max_len=draw(st.integers(1, 7)), action_block=draw(st.integers(1, 3)))
    shape = draw(st.sampled_from([(), (1,), (2,), (1, 3)]))
    ids = st.lists(st.integers(-n_envs, n_envs - 1), max_size=2 * n_envs)
    op = st.one_of(
        st.tuples(st.just("append"), st.one_of(st.none(), ids), st.booleans()),
        st.tuples(st.just("reset"), st.one_of(st.none(), st.lists(st.integers(0, n_envs - 1), max_size=n_envs))),
        st.tuples(st.just("get"), st.integers(-1, 5), st.one_of(st.none(), ids)),
    )
    return cfg, shape, draw(st.lists(op, min_size=1, max_size=25))


@pytest.mark.parametrize("examples", [pytest.param(60, id="")])
def test_random_sequences_match_model(backend, device, examples):
    @settings(max_examples=examples if backend == "torch" else examples // 3, deadline=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(scenarios())
    def run(scenario):
        cfg, shape, ops = scenario
        buf = HistoryBuffer(**cfg, block_keys=("action",), device=device)
        model = HistoryModel(**cfg, block_keys=("action",))
        step = 0
        for op in ops:
            if op[0] == "append":
                _, env_ids, nan_action = op
                rows = cfg["n_envs"] if env_ids is None else len(env_ids)
                obs = (step * 100 + np.arange(rows * int(np.prod(shape)))).reshape(rows, *shape).astype(np.int64)
                action = np.full((rows, 1, 2), step, np.float32)
                if nan_action:  # the reset frame's action echo
                    action[::2] = np.nan
                info = {"obs": obs, "action": action}
                buf.append(info, env_ids=env_ids)
                model.append(info, env_ids=env_ids)
                step += 1
            elif op[0] == "reset":
                buf.reset(op[1])
                model.reset(op[1])
            else:
                _, n, env_ids = op
                out, expected = buf.get(n, env_ids), model.get(n, env_ids)
                assert (out is None) == (expected is None)
                if out is not None:
                    assert list(out) == list(expected)
                    for key in expected:
                        got = out[key].cpu().numpy()
                        want = expected[key] if expected[key] is not None else np.zeros(got.shape)
                        np.testing.assert_array_equal(got, want.reshape(got.shape), err_msg=key)
                assert buf.num_strided() == model.num_strided()

    run()
