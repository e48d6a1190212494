"""On CUDA the hot paths never wait for the device (the buffers' documented rule), checked by torch's sync debug mode.

Host inputs (numpy, as env outputs are) go through pinned staging; counters are host mirrors. Run on a
GPU machine (``bash benchmarks/device_check.sh``); skipped elsewhere.
"""

import numpy as np
import pytest
import torch

from gpubuf import HistoryBuffer, PrioritizedTransitionBuffer, Transition


def rollout(T, E, t0=0):
    return Transition(observation=np.full((T, E, 5), t0, np.float32), action=np.zeros((T, E, 2), np.float32),
                      reward=np.zeros((T, E), np.float32), terminated=np.zeros((T, E), bool),
                      truncated=np.zeros((T, E), bool))


@pytest.mark.cuda
def test_history_append_and_get_do_not_sync():
    buf = HistoryBuffer(8, 6, 2, ("action",), device="cuda")
    info = {"pixels": np.zeros((8, 1, 4, 4), np.uint8), "action": np.zeros((8, 1, 2), np.float32)}
    for _ in range(3):  # warm-up: storage, staging and kernel compilation
        buf.append(info)
        out = buf.get(3)
        buf.append({k: v[:3] for k, v in info.items()}, env_ids=[5, 1, 2])
        buf.get(2, env_ids=[3, 3, 0])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            buf.append(info)
            buf.append({k: v[:3] for k, v in info.items()}, env_ids=[5, 1, 2])
            buf.get(3, out=out)
            buf.get(2, env_ids=[3, 3, 0])
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.cuda
def test_replay_insert_sample_and_host_priority_updates_do_not_sync():
    per = PrioritizedTransitionBuffer(4 * 64, 16, rollout(1, 4), n_steps=2, device="cuda", seed=0)
    host_idx, host_td = np.array([0, 5, 9, 5]), np.array([0.5, -2.0, 1.0, 3.0], np.float32)
    for t in range(3):  # warm-up: trees built, staging allocated, kernels compiled
        per.insert(rollout(8, 4, t))
        per.sample(with_replacement=True, with_next_obs=True)
        per.update_priorities(host_idx, host_td)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for t in range(4):
            per.insert(rollout(8, 4, t))
            batch, idx = per.sample(with_replacement=True, with_next_obs=True)
            per.sample(with_replacement=True)
            per.update_priorities(host_idx, host_td)  # host inputs are checked on the host
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert batch.observation.device.type == "cuda" and idx.shape == (16,)
