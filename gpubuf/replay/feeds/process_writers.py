"""Writers in other processes: actor processes insert rows into one buffer that its owner samples.

The owner hands out one :class:`ReplayWriter` per actor (``buffer.writer(envs=..., rows=...)``) and passes it to the
actor process as a ``torch.multiprocessing`` process argument (spawn or fork). Each writer owns a queue of ``rows`` rows
in memory both processes see, allocated once when the writer is made: shared host memory for a buffer that stores on the
host (including ``storage_dir``), CUDA memory shared through CUDA IPC for one that stores on a GPU. Nothing is exchanged
per call: the actor copies an insert's rows into the queue and then publishes them by advancing a counter in shared host
memory (on CUDA after its copies finished); the owner commits published rows into the buffer, under its lock, as an
ordinary insert, when it samples, asks ``can_sample``, waits in its rate limiter, or calls ``buffer.collect()``. So the
owner never sees a torn row: a row is sampleable once committed, and it is committed only once published whole. An actor
killed mid-insert (SIGKILL) loses the rows it had not published, nothing else.

Vectorized buffers: a writer owns a contiguous range of env lanes (``envs=range(a, b)``; ``None``: all of them) and
inserts ``(T, b - a, ...)`` rows, committed in lockstep with the other lanes, so each lane holds one env's stream, in
order. Not vectorized: each writer's inserts are committed whole. How the owner commits and what it reports
(:class:`WriterDied` once for a dead actor, :class:`RowsWaiting` for rows that cannot be committed) is
:mod:`gpubuf.replay.feeds.writer_hub`. A dead writer's lanes stop the commits until a new writer is handed out for the
same lanes (``buffer.writer(envs=the same range)``), whose first row starts new episodes there: the dead writer's last
row is marked ``truncated`` (where the buffer stores that leaf). An actor waits while its queue is full (the owner
commits what the rate limiter allows, so a limiter holds actors back too); ``insert(..., timeout=)`` ends the wait with
``TimeoutError``, and a dead owner with ``RuntimeError``. Liveness is read from ``/proc`` (Linux)."""

import dataclasses
import multiprocessing.context
import os
import time

import numpy as np
import torch

from gpubuf._core.transition import Transition
from gpubuf.replay.config import ReplayConfig

# the int64 control words of one writer, in shared host memory
PUBLISHED, CONSUMED, PID, CLOSED = range(4)
# values of CLOSED: closed by its actor; ended by the owner (dead or replaced); its buffer closed or dropped
CLOSED_BY_ACTOR, RETIRED, OWNER_ENDED = 1, 2, 3
_POLL_S = (0.0002, 0.005)  # first and longest sleep of a waiting actor


class WriterDied(RuntimeError):
    """An actor process holding a :class:`ReplayWriter` exited or was killed without closing it."""


class RowsWaiting(RuntimeWarning):
    """Rows writers published that cannot be committed now: they wait for rows of lanes whose writers ended (a
    new writer of those lanes commits them), or the buffer's ``storage_dir`` was closed."""


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not joined, is dead); ``pid`` 0: not started yet, alive."""
    if pid <= 0 or pid == os.getpid():
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X", "x")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: whether the pid exists at all
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False


def check_timeout(timeout) -> None:
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.number))
                                or not timeout >= 0):  # NaN included
        raise ValueError(f"timeout: expected None or seconds >= 0, got {timeout!r}")


def insert_rows(writer, transition) -> tuple[dict, int]:
    """``({path: (T, ...) tensor}, T)`` of an insert through ``writer`` (its ``config``, ``max_insert``), checked."""
    values, _, T = writer.config.rows(transition)
    if T > writer.max_insert:
        raise ValueError(f"transition: expected at most max_insert={writer.max_insert} rows per insert into this "
                         f"buffer (its inserts are committed whole, and its rate limiter's band holds no more "
                         f"beside a sample of its batch), got {T}; insert fewer rows at a time")
    return values, T


def wait_for_room(room, T: int, timeout: float | None, writer) -> None:
    """Wait, sleeping longer each time up to a limit, until ``room()`` (which may raise) says ``T`` rows fit;
    ``TimeoutError`` after ``timeout`` seconds (``None``: no limit)."""
    deadline = None if timeout is None else time.monotonic() + float(timeout)
    pause = _POLL_S[0]
    while not room():
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"{writer}: the owner did not make room for {T} rows in {timeout} s "
                               "(is it sampling or calling collect()?)")
        time.sleep(pause)
        pause = min(2 * pause, _POLL_S[1])


class WriterShape:
    """What a writer's ``config`` (the buffer's, narrowed to its lanes and queue) says about its inserts."""

    @property
    def vectorized_env(self) -> bool:
        return self.config.vectorized_env

    @property
    def n_envs(self) -> int:
        """Env lanes this writer writes (1 not vectorized)."""
        return self.config.n_envs

    @property
    def n_steps(self) -> int:
        return self.config.n_steps


class ReplayWriter(WriterShape):
    """An actor's handle on a buffer owned by another process (made by ``buffer.writer(envs, rows)``: ``rows`` is the
    queue's length in rows per env, the most an insert may hold, with at most :attr:`max_insert`).

    Pass it to the actor as an argument of a ``torch.multiprocessing`` process (or use it in a forked child or a
    thread): one process writes through it. A plain ``pickle``/``copy`` of it holds no shared memory and refuses to
    write."""

    def __init__(self, config: ReplayConfig, envs: range | None, rows: int, device: torch.device,
                 name: str, owner_pid: int, max_insert: int | None = None):
        width = len(envs) if envs is not None else 1
        self.envs, self.rows, self.device, self.name, self.owner_pid = envs, rows, device, name, owner_pid
        # rows one insert may hold: not vectorized, inserts commit whole, so at most what the rate limiter's band
        # holds beside a sample of the buffer's batch
        self.max_insert = rows if max_insert is None else min(rows, max_insert)
        self.config = dataclasses.replace(config, n_envs=width, max_rows=rows, max_size=rows * width)
        lane = (width,) if config.vectorized_env else ()
        self.queue = {}
        for leaf in config.leaves:
            t = torch.zeros((rows, *lane, *leaf.shape), dtype=leaf.dtype, device=device)
            self.queue[leaf.path] = t if device.type == "cuda" else t.share_memory_()
        self.control = torch.zeros(4, dtype=torch.int64).share_memory_()
        # not vectorized: which queue rows end an insert (commits take whole inserts)
        self.ends = None if config.vectorized_env else torch.zeros(rows, dtype=torch.bool).share_memory_()
        self.copied = False
        self._started = None  # (owner side) the process it was handed to at a spawn: its pid before the actor claims

    # ------------------------------------------------------------------ actor side

    def insert(self, transition: Transition, timeout: float | None = None) -> "ReplayWriter":
        """Publish ``T`` rows (leaves ``(T, len(envs), ...)``, ``(T, ...)`` not vectorized; the buffer's leaves,
        shapes and value-preserving dtypes; ``1 <= T <= rows``, and ``T <=`` :attr:`max_insert`) to the owner;
        returns ``self``. Waits while the queue has no room for them (``timeout`` seconds, ``None``: no limit,
        then ``TimeoutError``); nothing is published on any error."""
        self._check_writer()
        check_timeout(timeout)
        values, T = insert_rows(self, transition)
        control = self.control

        def room() -> bool:
            if self.rows - int(control[PUBLISHED] - control[CONSUMED]) >= T:
                return True
            if not process_alive(self.owner_pid):
                raise RuntimeError(f"{self}: the owner (pid {self.owner_pid}) is gone; nothing was published")
            if control[CLOSED] == OWNER_ENDED:
                self._check_writer()  # its RuntimeError: the buffer takes no more rows
            return False

        wait_for_room(room, T, timeout, self)
        self.publish(values, T)
        return self

    def publish(self, values: dict, T: int) -> None:
        """Copy ``T`` checked rows (``{path: (T, ...)}``) into the queue, which has room for them, and publish them."""
        control = self.control
        published = int(control[PUBLISHED])
        start = published % self.rows
        first = min(T, self.rows - start)
        for path, t in values.items():
            q = self.queue[path]
            q[start:start + first].copy_(t[:first])
            if first < T:
                q[:T - first].copy_(t[first:])
        if self.ends is not None:
            ends = self.ends
            ends[(published + np.arange(T)) % self.rows] = False
            ends[(published + T - 1) % self.rows] = True
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the rows are whole before they are published
        control[PUBLISHED] = published + T

    def close(self) -> None:
        """This writer inserts no more (it is not reported as dead): its published rows are still committed, then
        its lanes may be handed to a new writer. A vectorized buffer's in lockstep with the other lanes: rows it
        published beyond the rows of lanes whose writers all ended wait for a new writer of those lanes
        (:class:`RowsWaiting` says so; :attr:`pending` counts them)."""
        if not self.control[CLOSED]:
            self.control[CLOSED] = CLOSED_BY_ACTOR

    @property
    def pending(self) -> int:
        """Rows published and not yet committed by the owner."""
        return int(self.control[PUBLISHED] - self.control[CONSUMED])

    def _check_writer(self) -> None:
        control = self.control
        if self.copied or not control.is_shared():
            raise RuntimeError(f"{self}: this is a copy holding no shared memory (a plain pickle or copy); pass the "
                               "writer to the actor as a torch.multiprocessing process argument, or fork")
        if control[CLOSED] == OWNER_ENDED:
            raise RuntimeError(f"{self}: its buffer was closed or dropped by the owner (pid {self.owner_pid}) and "
                               "takes no more rows; nothing was published")
        if control[CLOSED] == RETIRED:
            raise RuntimeError(f"{self}: retired by the owner (its process died, or its lanes went to another "
                               "writer); ask the owner for a new writer")
        if control[CLOSED]:
            raise RuntimeError(f"{self}: closed")
        pid, me = int(control[PID]), os.getpid()
        if pid == 0 or (pid != me and not process_alive(pid)):
            control[PID] = pid = me
        if pid != me:
            raise RuntimeError(f"{self}: held by process {pid}; one process writes through a writer "
                               f"(ask the owner for one writer per actor)")

    # ------------------------------------------------------------------ copies

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_started"] = None
        popen = multiprocessing.context.get_spawning_popen()
        if popen is not None and os.getpid() == self.owner_pid:  # handed to a process being spawned: watch it
            self._started = popen
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        # a plain pickle copies the tensors: such a handle would write where nobody reads
        self.copied = not self.control.is_shared()
        if not self.copied and int(self.control[PID]) == 0:
            self.control[PID] = os.getpid()

    def __copy__(self):
        copy = object.__new__(type(self))
        copy.__dict__.update(self.__dict__)
        copy.copied = True  # a copy in this process would be a second writer of the same queue
        return copy

    def __deepcopy__(self, memo):
        return self.__copy__()

    def __repr__(self) -> str:
        lanes = "" if self.envs is None else f"envs {self.envs.start}..{self.envs.stop - 1} of "
        return f"ReplayWriter({lanes}{self.name}, rows={self.rows}, owner pid {self.owner_pid})"

    # ------------------------------------------------------------------ owner side

    def take(self, n: int) -> dict:
        """``{path: (n, ...)}`` views (a copy where the queue wraps) of the next ``n`` published rows."""
        start = int(self.control[CONSUMED]) % self.rows
        if start + n <= self.rows:
            return {p: q[start:start + n] for p, q in self.queue.items()}
        return {p: torch.cat([q[start:], q[:start + n - self.rows]]) for p, q in self.queue.items()}

    def insert_ends(self, n: int) -> list:
        """The row counts, within the next ``n`` published rows, after which a whole insert ends (ascending)."""
        start = int(self.control[CONSUMED])
        rows = (start + np.arange(n)) % self.rows
        return (np.flatnonzero(self.ends.numpy()[rows]) + 1).tolist()

    def consumed(self, n: int) -> None:
        self.control[CONSUMED] += n

    def pid(self) -> int:
        """The process writing through it: the one that claimed it, else the one it was spawned into (0: none known)."""
        pid = int(self.control[PID])
        if pid == 0 and self._started is not None:
            pid = getattr(self._started, "pid", None) or 0
        return pid

    def dead(self) -> bool:
        """Not closed, and its process gone."""
        return not self.control[CLOSED] and not process_alive(self.pid())

    transport_arg = ""  # how buffer.writer() is asked for another writer like it (after its envs)

    def death(self) -> str:
        """How it died, for the report."""
        return f"its process {self.pid()} exited or was killed"

    def finished(self) -> bool:
        """Closed or retired, or its process gone."""
        return bool(self.control[CLOSED]) or self.dead()

    def mark_last_truncated(self, paths: list) -> bool:
        """Set ``truncated`` on the newest published row (the writer is gone); False when none is pending."""
        if self.pending == 0:
            return False
        row = (int(self.control[PUBLISHED]) - 1) % self.rows
        for p in paths:
            self.queue[p][row] = True
        return True
