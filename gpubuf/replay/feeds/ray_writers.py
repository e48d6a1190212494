"""Ray actors as writers: the handle an actor inserts through (``buffer.writer(envs, rows, transport="ray")``).

The learner hands one :class:`RayWriter` to each Ray actor, on any node of the cluster (as an argument of the
actor's constructor or of a method). The actor's :meth:`RayWriter.insert` checks the rows as the buffer would and
sends them to the buffer's inbox (:mod:`gpubuf.replay.feeds.ray_inbox`) without waiting for its answer; rows are
**published** once the inbox holds them (:meth:`RayWriter.flush` waits for that). The learner commits published
rows with the same hub, the same rules and the same reports as ``buffer.writer()`` processes
(:mod:`gpubuf.replay.feeds.writer_hub`): rows are sampleable whole, a vectorized buffer's lanes commit in lockstep so
each lane keeps its env's episode order, a rate limiter holds actors back, and a dead actor (killed, crashed, its
node lost) loses only the rows it had not published and is reported once by ``WriterDied``, after everything it
published was committed. At most ``rows`` rows per env are in flight (sent, not yet committed); an insert waits for
room (``timeout=``)."""

import os
import threading

import numpy as np

from gpubuf.replay.feeds import process_writers as pw


def import_ray():
    """The ``ray`` module; ``ImportError`` naming the extra to install without it."""
    try:
        import ray
    except ImportError as err:
        raise ImportError("transport='ray' needs Ray, which is not installed: pip install 'gpubuf[ray]'") from err
    return ray


class RayWriter(pw.WriterShape):
    """A Ray actor's handle on a buffer owned by the learner process (made by ``buffer.writer(..., transport="ray")``).

    Picklable: hand it to one Ray actor, on any node. The first actor that inserts through it holds it; another
    actor's insert is refused. ``rows``: the most rows per env in flight (sent, not yet committed by the learner);
    :attr:`max_insert`: the most per insert. Inserts are sent without waiting for the inbox to answer, as Reverb's
    writers do: rows are **published** once the inbox holds them, which :meth:`flush` (and :meth:`close`) wait for."""

    def __init__(self, lane, inbox):
        self.config, self.envs, self.rows, self.max_insert = lane.config, lane.envs, lane.rows, lane.max_insert
        self.key, self.name, self.owner_pid, self.inbox = lane.key, lane.name, lane.owner_pid, inbox
        self.sent, self.consumed, self.claimed = 0, 0, False  # rows sent; rows the learner committed, as last heard
        self.closed, self.ended = False, None  # ended: why the learner takes no more rows (the error, every call)
        self.replies = []  # the inbox's answers to sends not yet read
        self._lane = lane  # in the learner's process only (not pickled)
        self._lock = threading.Lock()  # threads of one actor insert one at a time

    def insert(self, transition, timeout: float | None = None) -> "RayWriter":
        """Send ``T`` rows (leaves ``(T, len(envs), ...)``, ``(T, ...)`` not vectorized; the buffer's leaves,
        shapes and value-preserving dtypes; numpy arrays or CPU tensors; ``1 <= T <=`` :attr:`max_insert`) to the
        learner; returns ``self`` once they are sent. Waits while ``rows`` rows are in flight (``timeout`` seconds,
        ``None``: no limit, then ``TimeoutError``). Bad rows are refused here (``ValueError``/``TypeError`` naming the
        leaf), nothing sent; ``RuntimeError`` once the learner ended this writer or its buffer (rows sent after
        that are not published)."""
        pw.check_timeout(timeout)
        values, T = pw.insert_rows(self, transition)
        with self._lock:
            return self._send(values, T, timeout)

    def _send(self, values: dict, T: int, timeout) -> "RayWriter":
        if self.ended or self.closed:
            raise RuntimeError(self.ended or f"{self}: closed")
        self._claim()
        self._read(wait=False)

        def room() -> bool:  # the answers to earlier sends first; then asks the inbox, which answers once there is
            if self.sent - self.consumed + T <= self.rows:  # room (or after a while)
                return True
            self._read(wait=True)
            if self.sent - self.consumed + T > self.rows:
                self._heard(self._call(self.inbox.room, self.key, self.rows - T, 0.05))
            return self.sent - self.consumed + T <= self.rows

        pw.wait_for_room(room, T, timeout, self)
        block = {p: _array(t) for p, t in values.items()}
        self.replies.append(self.inbox.publish.remote(self.key, self.sent, block, T, self.rows))
        self.sent += T
        return self

    def flush(self) -> "RayWriter":
        """Wait until the inbox holds every row sent (published: a dead actor's published rows are committed);
        ``RuntimeError`` as :meth:`insert`."""
        with self._lock:
            if self.ended:
                raise RuntimeError(self.ended)
            self._read(wait=True)
        return self

    def close(self) -> None:
        """:meth:`flush`, then this writer inserts no more (it is not reported as dead): what it published is still
        committed. In the learner's process, ends a writer whose actor never inserted (died before it could)."""
        ray = import_ray()
        with self._lock:
            self.closed = True
            try:
                self._read(wait=True)
            finally:
                actor_id = ray.get_runtime_context().get_actor_id()
                try:
                    holder = ray.get(self.inbox.close.remote(self.key, actor_id))
                except ray.exceptions.RayActorError:
                    holder = None  # the buffer is gone: nothing to close
                if holder is not None:
                    raise RuntimeError(f"{self}: held by Ray actor {holder}, which alone closes it")

    @property
    def pending(self) -> int:
        """Rows sent and not yet committed (as the learner last said), in the actor; in the learner, rows fetched and
        not committed yet (a dead actor's, once reported: all it published that the buffer lacks)."""
        return self.sent - self.consumed if self._lane is None else self._lane.pending

    def __getstate__(self):
        return {**self.__dict__, "_lane": None, "_lock": None, "replies": []}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()
        ray = import_ray()
        context = ray.get_runtime_context() if ray.is_initialized() else None
        if context is not None and context.get_actor_id() is not None and not self.claimed:
            try:  # arrived in an actor: claimed now, so that its death is seen before its first insert
                self._claim()
            except RuntimeError:
                pass  # held by another actor, or the buffer is gone: its inserts say so

    def _claim(self) -> None:
        if self.claimed:
            return
        ray = import_ray()
        context = ray.get_runtime_context()
        actor_id = context.get_actor_id()
        if actor_id is None:
            raise RuntimeError(f"{self}: insert from inside a Ray actor (the one it was handed to); the learner's "
                               "own process inserts into the buffer directly")
        if context.was_current_actor_reconstructed:
            raise RuntimeError(f"{self}: this actor was restarted by Ray, and its writer's episodes ended with its "
                               "first life; ask the learner for a new writer (buffer.writer(..., transport='ray'))")
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
            raise self._gone() from err

    def _gone(self) -> RuntimeError:
        return RuntimeError(f"{self}: the learner's buffer is gone (its process ended, or it dropped the buffer); "
                            "rows not yet published are lost")

    def _read(self, wait: bool) -> None:
        """Read the inbox's answers to earlier sends (``wait``: all of them, else those already in)."""
        if not self.replies:
            return
        ray = import_ray()
        ready = self.replies if wait else ray.wait(self.replies, num_returns=len(self.replies), timeout=0)[0]
        if not ready:
            return
        try:
            answers = ray.get(ready)
        except ray.exceptions.RayActorError as err:
            self.replies = []
            raise self._gone() from err
        done = set(ready)
        self.replies = [r for r in self.replies if r not in done]
        for answer in answers:
            self._heard(answer)

    def _heard(self, answer: tuple) -> None:
        """Take in the inbox's ``(rows committed, state)``; ``RuntimeError`` for a writer the learner ended."""
        consumed, state = answer
        self.consumed = max(self.consumed, consumed)
        if state == pw.OWNER_ENDED:
            self.ended = (f"{self}: its buffer was closed or dropped by the learner and takes no more rows; rows "
                          "sent since are not published")
        elif state == pw.RETIRED:
            self.ended = (f"{self}: retired by the learner (its lanes went to another writer); ask the learner "
                          "for a new writer")
        elif state == pw.CLOSED_BY_ACTOR:
            self.ended = f"{self}: closed"
        if self.ended:
            raise RuntimeError(self.ended)

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
