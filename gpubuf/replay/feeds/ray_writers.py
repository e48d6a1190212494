"""Ray actors as writers: the handle an actor inserts through (``buffer.writer(envs, rows, transport="ray")``).

The learner hands one :class:`RayWriter` to each Ray actor, on any node of the cluster (as an argument of the
actor's constructor or of a method). The actor's :meth:`RayWriter.insert` checks the rows as the buffer would and
sends them to the buffer's inbox (:mod:`gpubuf.replay.feeds.ray_inbox`); an insert is **published** once that call
returned. The learner commits published rows with the same hub, the same rules and the same reports as
``buffer.writer()`` processes (:mod:`gpubuf.replay.feeds.writer_hub`): rows are sampleable whole, a vectorized
buffer's lanes commit in lockstep so each lane keeps its env's episode order, a rate limiter holds actors back, and a
dead actor (killed, crashed, its node lost) loses only the rows it had not published and is reported once by
``WriterDied``, after everything it published was committed. At most ``rows`` rows per env are in flight
(published, not yet committed); an insert waits for room (``timeout=``)."""

import os

import numpy as np

from gpubuf.replay.feeds import process_writers as pw


def import_ray():
    """The ``ray`` module; ``ImportError`` naming the extra to install without it."""
    try:
        import ray
    except ImportError as err:
        raise ImportError("transport='ray' needs Ray, which is not installed: pip install 'gpubuf[ray]'") from err
    return ray


class RayWriter:
    """A Ray actor's handle on a buffer owned by the learner process (made by ``buffer.writer(..., transport="ray")``).

    Picklable: hand it to one Ray actor, on any node. The first actor that inserts through it holds it; another
    actor's insert is refused. ``rows``: the most rows per env in flight; :attr:`max_insert`: the most per insert."""

    def __init__(self, lane, inbox):
        self.config, self.envs, self.rows, self.max_insert = lane.config, lane.envs, lane.rows, lane.max_insert
        self.key, self.name, self.owner_pid, self.inbox = lane.key, lane.name, lane.owner_pid, inbox
        self.in_flight, self.claimed = 0, False
        self._lane = lane  # in the learner's process only (not pickled)

    def insert(self, transition, timeout: float | None = None) -> "RayWriter":
        """Publish ``T`` rows (leaves ``(T, len(envs), ...)``, ``(T, ...)`` not vectorized; the buffer's leaves,
        shapes and value-preserving dtypes; numpy arrays or CPU tensors; ``1 <= T <=`` :attr:`max_insert`) to the
        learner; returns ``self``. Waits while ``rows`` rows are in flight (``timeout`` seconds, ``None``: no
        limit, then ``TimeoutError``). Nothing is published on any error; ``RuntimeError`` once the learner
        ended this writer or its buffer."""
        pw.check_timeout(timeout)
        values, T = pw.insert_rows(self, transition)
        self._claim()

        def room() -> bool:
            if self.in_flight + T <= self.rows:
                return True
            self._answer(self._call(self.inbox.room, self.key))
            return self.in_flight + T <= self.rows

        pw.wait_for_room(room, T, timeout, self)
        block = {p: _array(t) for p, t in values.items()}
        self._answer(self._call(self.inbox.publish, self.key, block, T), T)
        return self

    def close(self) -> None:
        """This writer inserts no more (it is not reported as dead): what it published is still committed."""
        ray = import_ray()
        try:
            ray.get(self.inbox.close.remote(self.key))
        except ray.exceptions.RayActorError:
            pass  # the buffer is gone: nothing to close

    @property
    def vectorized_env(self) -> bool:
        return self.config.vectorized_env

    @property
    def n_envs(self) -> int:
        """Env lanes this writer writes (1 not vectorized)."""
        return self.config.n_envs

    @property
    def pending(self) -> int:
        """Rows published and not yet committed: as the learner last said, in the actor; in the learner, those it
        fetched and did not commit yet (a dead actor's, once reported: all it published and the buffer lacks)."""
        return self.in_flight if self._lane is None else self._lane.pending

    def __getstate__(self):
        return {**self.__dict__, "_lane": None}

    def _claim(self) -> None:
        if self.claimed:
            return
        ray = import_ray()
        context = ray.get_runtime_context()
        actor_id = context.get_actor_id()
        if actor_id is None:
            raise RuntimeError(f"{self}: insert from inside a Ray actor (the one it was handed to); the learner's "
                               "own process inserts into the buffer directly")
        holder = self._call(self.inbox.claim, self.key, context.current_actor, actor_id)
        if holder is not None:
            raise RuntimeError(f"{self}: held by Ray actor {holder}; one actor writes through a writer "
                               "(ask the learner for one writer per actor)")
        self.claimed = True

    def _call(self, method, *args):
        ray = import_ray()
        try:
            return ray.get(method.remote(*args))
        except ray.exceptions.RayActorError as err:
            raise RuntimeError(f"{self}: the learner's buffer is gone (its process ended, or it dropped the buffer); "
                               "nothing was published") from err

    def _answer(self, answer: tuple, T: int = 0) -> None:
        """Read the inbox's ``(in flight, state)`` after a call that would have published ``T`` rows."""
        self.in_flight, state = answer
        if state == pw.OWNER_ENDED:
            raise RuntimeError(f"{self}: its buffer was closed or dropped by the learner and takes no more rows; "
                               "nothing was published")
        if state == pw.RETIRED:
            raise RuntimeError(f"{self}: retired by the learner (its lanes went to another writer); ask the "
                               "learner for a new writer")
        if state == pw.CLOSED_BY_ACTOR:
            raise RuntimeError(f"{self}: closed")

    def __repr__(self) -> str:
        lanes = "" if self.envs is None else f"envs {self.envs.start}..{self.envs.stop - 1} of "
        where = "" if os.getpid() == self.owner_pid else f", owner pid {self.owner_pid}"
        return f"RayWriter({lanes}{self.name}, rows={self.rows}{where})"


def _array(t):
    """A CPU tensor as the numpy array Ray sends without copying (a dtype numpy lacks stays a tensor)."""
    try:
        return np.asarray(t.numpy(force=True))
    except TypeError:
        return t.cpu()
