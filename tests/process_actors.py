"""Actor processes of the multi-process writer tests and benchmark: each steps a real gymnasium vector env (or
writes numbered rows) and inserts through a ReplayWriter it was handed."""

import os
import signal
import time

import numpy as np

from gpubuf import Transition


def cartpole_rows(T: int, E: int, actor: int, first_step: int, env, obs, rng):
    """``T`` rows of ``E`` native-vector CartPole envs: the observation before each step, the action, reward and
    flags; ``info`` numbers every row (``step``) and names its ``actor``. Returns ``(rows, obs)``."""
    leaves = {k: [] for k in ("observation", "action", "reward", "terminated", "truncated")}
    for _ in range(T):
        action = rng.integers(0, 2, E)
        nxt, reward, terminated, truncated, _ = env.step(action)
        for k, v in zip(leaves, (obs, action, reward, terminated, truncated), strict=True):
            leaves[k].append(np.asarray(v))
        obs = nxt
    steps = np.arange(first_step, first_step + T, dtype=np.int64)[:, None].repeat(E, 1)
    rows = Transition(observation=np.stack(leaves["observation"]).astype(np.float32),
                      action=np.stack(leaves["action"]).astype(np.int64),
                      reward=np.stack(leaves["reward"]).astype(np.float32),
                      terminated=np.stack(leaves["terminated"]), truncated=np.stack(leaves["truncated"]),
                      info={"step": steps, "actor": np.full((T, E), actor, np.int64)})
    return rows, obs


def cartpole_actor(writer, actor: int, E: int, inserts: int, T: int, seed: int, timeout: float = 600.0) -> None:
    """Step ``E`` CartPole envs and insert ``inserts`` blocks of ``T`` rows through ``writer``, then close it."""
    import gymnasium as gym

    env = gym.make_vec("CartPole-v1", num_envs=E, vectorization_mode="vector_entry_point")
    obs, _ = env.reset(seed=seed)
    rng = np.random.default_rng(seed)
    for i in range(inserts):
        rows, obs = cartpole_rows(T, E, actor, i * T, env, obs, rng)
        writer.insert(rows, timeout=timeout)
    writer.close()


def numbered_actor(writer, E: int, shape: tuple, T: int, start: int = 0, rows_done=None, stop_after=None,
                   close: bool = True) -> None:
    """Insert blocks of ``T`` rows whose every element is the row's number (from ``start``), as fast as the writer
    takes them, forever (until killed) or ``stop_after`` rows; ``rows_done`` (a shared tensor) counts what was
    published. Then closes the writer (``close``)."""
    step = start
    while stop_after is None or step - start < stop_after:
        n = np.arange(step, step + T, dtype=np.float32)
        obs = np.broadcast_to(n.reshape(T, *([1] * (1 + len(shape)))), (T, E, *shape)).copy()
        rows = Transition(observation=obs, action=np.broadcast_to(n[:, None], (T, E)).astype(np.float32),
                          reward=np.zeros((T, E), np.float32), terminated=np.zeros((T, E), bool),
                          truncated=np.zeros((T, E), bool))
        writer.insert(rows, timeout=600)  # a hang bound: a loaded owner only commits later
        step += T
        if rows_done is not None:
            rows_done[0] = step - start
    if close:
        writer.close()


def kill_self_actor(writer, E: int) -> None:
    """Publish one row, then die by SIGKILL without closing the writer."""
    numbered_actor(writer, E, (3,), 1, stop_after=1, close=False)
    time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGKILL)
