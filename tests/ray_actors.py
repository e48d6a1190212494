"""Ray actors of the Ray-writer tests and benchmark: each steps real gymnasium CartPole envs (or writes numbered
rows) and inserts through the RayWriter it was handed. Workers import this module (the tests put tests/ on their
path)."""

import os
import sys
import tempfile
import time

import numpy as np
import process_actors

from gpubuf import Transition

TESTS = os.path.dirname(os.path.abspath(__file__))


def start_ray(paths: tuple = (), env: dict | None = None, **kwargs) -> None:
    """``ray.init(**kwargs)`` whose workers import the gpubuf this process imported (the installed wheel under
    ``scripts/test``, not the checkout, which Ray would put first: it hands its workers this process's
    ``sys.path``), this folder's modules and ``paths``; ``env``: more variables for them."""
    import ray

    import gpubuf

    home = os.path.dirname(os.path.dirname(os.path.abspath(gpubuf.__file__)))
    root = os.path.dirname(TESTS)
    path = os.pathsep.join([home, TESTS, *paths] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    saved, here = sys.path[:], os.getcwd()
    if home != root:  # Ray's workers get this process's sys.path and its working directory
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != root]
        os.chdir(tempfile.gettempdir())
    try:
        ray.init(log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": path, **(env or {})}}, **kwargs)
    finally:
        sys.path[:] = saved
        os.chdir(here)
    try:
        where = ray.get(ray.remote(num_cpus=0)(_gpubuf_file).remote())
        assert where == gpubuf.__file__, f"Ray workers import gpubuf from {where}, this process from {gpubuf.__file__}"
    except BaseException:
        ray.shutdown()
        raise


def _gpubuf_file() -> str:
    import gpubuf

    return gpubuf.__file__


class CartPoleActor:
    """``E`` native-vector CartPole envs seeded ``seed``; rows numbered by ``info.step`` and named by ``actor``."""

    def __init__(self, writer, actor: int, E: int, seed: int):
        import gymnasium as gym

        self.writer, self.actor, self.E, self.seed = writer, actor, E, seed
        self.env = gym.make_vec("CartPole-v1", num_envs=E, vectorization_mode="vector_entry_point")
        self.obs, _ = self.env.reset(seed=seed)
        self.rng, self.step = np.random.default_rng(seed), 0

    def run(self, inserts: int, T: int, close: bool = True, timeout: float = 120.0) -> int:
        """Insert ``inserts`` blocks of ``T`` rows (then close the writer); returns the rows published."""
        for _ in range(inserts):
            rows, self.obs = process_actors.cartpole_rows(T, self.E, self.actor, self.step, self.env, self.obs,
                                                          self.rng)
            self.writer.insert(rows, timeout=timeout)
            self.step += T
        if close:
            self.writer.close()
        else:
            self.writer.flush()  # every row sent is published: the learner commits them, whatever happens next
        return self.step

    def published(self) -> int:
        return self.step

    def insert(self, rows, timeout=None):
        """One insert as given (bad input reaches the writer's checks here)."""
        self.writer.insert(rows, timeout=timeout)
        return self.writer.pending

    def close(self) -> None:
        self.writer.close()


def cartpole_log(actor: int, E: int, seed: int, n: int):
    """The first ``n`` rows a :class:`CartPoleActor` with these arguments publishes (its log, replayed)."""
    import gymnasium as gym

    env = gym.make_vec("CartPole-v1", num_envs=E, vectorization_mode="vector_entry_point")
    obs, _ = env.reset(seed=seed)
    rows, _ = process_actors.cartpole_rows(n, E, actor, 0, env, obs, np.random.default_rng(seed))
    return rows


class NumberedActor:
    """Inserts blocks of ``T`` rows whose every element is the row's number, as fast as the writer takes them;
    ``E`` lanes (``None``: a buffer that is not vectorized)."""

    def __init__(self, writer, E, shape: tuple):
        self.writer, self.E, self.shape = writer, E, shape

    def run(self, T: int, rows: int, start: int = 0) -> float:
        """Insert ``rows`` rows from ``start``; returns the seconds it took."""
        lanes = () if self.E is None else (self.E,)
        began = time.perf_counter()
        for first in range(start, start + rows, T):
            n = np.arange(first, first + T, dtype=np.float32)
            at = n.reshape(T, *([1] * len(lanes)))
            self.writer.insert(Transition(
                observation=np.broadcast_to(at[..., None], (T, *lanes, *self.shape)).copy(),
                action=np.broadcast_to(at, (T, *lanes)).copy(), reward=np.zeros((T, *lanes), np.float32),
                terminated=np.zeros((T, *lanes), bool), truncated=np.zeros((T, *lanes), bool)), timeout=120)
        return time.perf_counter() - began


def reported_dead(buf, hang_s: float = 300.0) -> str:
    """The learner commits until its buffer reports a writer dead (``WriterDied``); the report."""
    import warnings

    from gpubuf.replay.feeds.process_writers import RowsWaiting, WriterDied

    end = time.monotonic() + hang_s
    while time.monotonic() < end:
        try:
            with warnings.catch_warnings():  # other writers' rows may wait for the dead one's lanes
                warnings.simplefilter("ignore", RowsWaiting)
                buf.collect()
        except WriterDied as err:
            return str(err)
        time.sleep(0.02)
    raise AssertionError("no writer was reported dead")
