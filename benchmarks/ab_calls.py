"""Large-input calls of one checkout, for before/after comparisons of two checkouts on one quiet machine.

    PYTHONPATH=CHECKOUT python benchmarks/ab_calls.py [BLOCKS] [GROUP ...]    # one JSON line; GROUP: per window history

Times, in microseconds per call, the median and the minimum over BLOCKS blocks (default 100) of: PER ``sample``,
``insert`` and ``update_priorities`` of 256 rows on a full buffer of 2**17 (obs float32[17], action float32[6]; the
update's priorities are drawn in the timed call, ``torch.rand(256) + 0.1``, alike in both checkouts); a
window ``sample`` of 32 x 16 steps from 64 envs x 1024 steps of 64x64x3 uint8 frames; ``HistoryBuffer`` ``append``
and ``get(3)`` at 1024 envs (the peer harness's shapes). Run it alternately on the two checkouts, several times each,
and compare the medians of the per-run minimums: on a shared machine a block's minimum is the statistic that the
machine's noise moves least. It runs on checkouts from before ``gpubuf.Unit`` too (their default unit is a window).
"""

import json
import sys
import time
import warnings

import numpy as np
import torch

import gpubuf
from gpubuf import HistoryBuffer, PrioritizedTransitionBuffer, Transition, TransitionBuffer
from gpubuf.apps.benchmarking.history import AB, ACT, MAX_LEN, PIX

UNIT = {"unit": gpubuf.Unit.window()} if hasattr(gpubuf, "Unit") else {}


def rows(obs: np.ndarray, act: np.ndarray) -> Transition:
    lead = act.shape[:-1]
    return Transition(observation=torch.as_tensor(obs), action=torch.as_tensor(act), reward=torch.zeros(lead),
                      terminated=torch.zeros(lead, dtype=torch.bool), truncated=torch.zeros(lead, dtype=torch.bool))


def per_calls(rng: np.random.Generator) -> dict:
    n = 2**17
    buf = PrioritizedTransitionBuffer(n, 256, rows(np.zeros((1, 17), np.float32), np.zeros((1, 6), np.float32)),
                                      vectorized_env=False, seed=0)
    for _ in range(n // 4096):
        buf.insert(rows(rng.standard_normal((4096, 17), np.float32), rng.standard_normal((4096, 6), np.float32)))
    batch = rows(rng.standard_normal((256, 17), np.float32), rng.standard_normal((256, 6), np.float32))
    key = torch.Generator().manual_seed(1)
    idx = torch.randint(0, n, (256,), generator=key)
    return {"PER sample 256": lambda: buf.sample(key=key, **UNIT), "PER insert 256": lambda: buf.insert(batch),
            "PER update 256": lambda: buf.update_priorities(idx, torch.rand(256) + 0.1)}


def window_calls(rng: np.random.Generator) -> dict:
    envs, steps = 64, 1024
    buf = TransitionBuffer(envs * steps, 32, rows(np.zeros((1, envs, 64, 64, 3), np.uint8),
                                                  np.zeros((1, envs, 2), np.float32)), n_steps=16, seed=0)
    for _ in range(0, steps, 64):
        buf.insert(rows(rng.integers(0, 255, (64, envs, 64, 64, 3), dtype=np.uint8),
                        rng.standard_normal((64, envs, 2), np.float32)))
    key = torch.Generator().manual_seed(2)
    return {"window sample 32x16": lambda: buf.sample(key=key, **UNIT)}


def history_calls(rng: np.random.Generator) -> dict:
    envs = 1024
    info = {"pixels": rng.integers(0, 255, (envs, *PIX), dtype=np.uint8),
            "action": rng.standard_normal((envs, *ACT)).astype(np.float32)}
    buf = HistoryBuffer(envs, MAX_LEN, AB, ("action",))
    for _ in range(MAX_LEN):
        buf.append(info)
    return {"history append 1024": lambda: buf.append(info), "history get(3) 1024": lambda: buf.get(3)}


GROUPS = {"per": per_calls, "window": window_calls, "history": history_calls}


def main(blocks: int, groups: list[str]) -> None:
    warnings.simplefilter("ignore")  # deprecated spellings of an older checkout
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    result = {}
    for group in groups:
        for name, call in GROUPS[group](rng).items():
            for _ in range(10):
                call()
            times = []
            for _ in range(blocks):
                start = time.perf_counter_ns()
                for _ in range(10):
                    call()
                times.append((time.perf_counter_ns() - start) / 10e3)
            result[name] = {"median": float(np.median(times)), "min": float(np.min(times))}
    print(json.dumps(result))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 100, sys.argv[2:] or list(GROUPS))
