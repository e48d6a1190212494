"""A HistoryBuffer fed by a real async EnvPool Pong-v5, rows routed by ``env_id`` and flushed on reset frames, holds
what a pure-python history model holds, on both backends."""

import numpy as np
import pytest
from extras import needs
from history_model import HistoryModel

from gpubuf import HistoryBuffer

envpool = needs("envpool")  # absent on the GPU machine, which has no registry


@pytest.mark.parametrize("n_envs,batch", [(4, 2)])
def test_async_pong_history_matches_model(backend, device, n_envs, batch):
    env = envpool.make("Pong-v5", env_type="gymnasium", num_envs=n_envs, batch_size=batch, seed=3)
    buf = HistoryBuffer(n_envs, max_len=6, action_block=2, block_keys=("action",), device=device)
    model = HistoryModel(n_envs, 6, 2, ("action",))
    rng = np.random.default_rng(0)
    last_action = np.full(n_envs, np.nan, np.float32)  # NaN echo on reset frames
    env.async_reset()
    seen = np.zeros(n_envs, np.int64)
    for step in range(40):
        obs, reward, terminated, truncated, info = env.recv()
        ids = info["env_id"]
        fresh = info["elapsed_step"] == 0
        buf.reset(ids[fresh])
        model.reset(ids[fresh])
        echo = np.where(fresh, np.nan, last_action[ids]).astype(np.float32)
        row = {"pixels": obs[:, None], "action": echo[:, None, None], "reward": reward.astype(np.float32)}
        buf.append(row, env_ids=ids)
        model.append(row, env_ids=ids)
        seen[ids] += 1
        if step % 5 == 4:
            probe = rng.permutation(n_envs)[:3]
            got, want = buf.get(3, env_ids=probe), model.get(3, probe.tolist())
            assert (got is None) == (want is None)  # async: a probed env may not have stepped yet
            for key in want or ():
                np.testing.assert_array_equal(got[key].cpu().numpy(), want[key], err_msg=key)
        action = rng.integers(0, 6, size=len(ids)).astype(np.int32)
        last_action[ids] = action
        env.send(action, ids)
    env.close()
    assert seen.sum() == 40 * batch and (seen > 0).all()
    assert buf.num_strided() == model.num_strided()
