"""Writers in other processes: actor processes insert rows into one buffer that its owner samples.

The owner hands out one :class:`ReplayWriter` per actor (``buffer.writer(envs=..., rows=...)``) and
passes it to the actor process as a ``torch.multiprocessing`` process argument (spawn or fork). Each
writer owns a queue of ``rows`` rows in memory both processes see, allocated once when the writer is
made: shared host memory for a buffer that stores on the host (including ``storage_dir``), CUDA
memory shared through CUDA IPC for one that stores on a GPU. Nothing is exchanged per call: the actor
copies an insert's rows into the queue and then publishes them by advancing a counter in shared host
memory (on CUDA after its copies finished); the owner commits published rows into the buffer, under
its lock, as an ordinary insert, when it samples, asks ``can_sample``, waits in its rate limiter, or
calls ``buffer.collect()``. So the owner never sees a torn row: a row is sampleable once committed,
and it is committed only once published whole. An actor killed mid-insert (SIGKILL) loses the rows it
had not published, nothing else.

Vectorized buffers: a writer owns a contiguous range of env lanes (``envs=range(a, b)``; ``None``: all
of them) and inserts ``(T, b - a, ...)`` rows; row ``t`` of the buffer is committed once every lane's
writer has published its row ``t`` (lockstep, as one vector env of all the actors' envs), so each
lane holds one env's stream, in order. Not vectorized: each writer's inserts are committed whole, one
writer's after another's, in the order collected.

A dead actor (its process exited or was killed without ``writer.close()``) is reported once by the
owner's next ``sample``/``collect`` as :class:`WriterDied`, after every row it published was
committed; its lanes then stop the commits until a new writer is handed out for the same lanes
(``buffer.writer(envs=the same range)``), whose first row starts new episodes there: the dead
writer's last row is marked ``truncated`` (where the buffer stores that leaf). An actor waits while
its queue is full (the owner commits what the rate limiter allows, so a limiter holds actors back
too); ``insert(..., timeout=)`` ends the wait with ``TimeoutError``, and a dead owner with
``RuntimeError``. Liveness is read from ``/proc`` (Linux).
"""

import dataclasses
import math
import multiprocessing.context
import os
import time

import numpy as np
import torch

from gpubuf._core.transition import Transition, unflatten
from gpubuf.replay.config import ReplayConfig

# the int64 control words of one writer, in shared host memory
PUBLISHED, CONSUMED, PID, CLOSED = range(4)
CLOSED_BY_ACTOR, RETIRED = 1, 2  # values of CLOSED: closed by its actor; ended by the owner (dead or replaced)
_POLL_S = (0.0002, 0.005)  # first and longest sleep of a waiting actor


class WriterDied(RuntimeError):
    """An actor process holding a :class:`ReplayWriter` exited or was killed without closing it."""


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not yet joined, counts as dead); ``pid`` 0:
    not started yet, alive."""
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


class ReplayWriter:
    """An actor's handle on a buffer owned by another process (made by ``buffer.writer``).

    Args of ``buffer.writer``: ``envs`` (a vectorized buffer: ``range(a, b)`` of its env lanes, or
    ``None`` for all; not vectorized: ``None``), ``rows`` (the queue's length in rows per env; an insert
    may hold at most that many).

    Pass it to the actor as an argument of a ``torch.multiprocessing`` process (or use it in a forked
    child or a thread): one process writes through it. A plain ``pickle``/``copy`` of it holds no
    shared memory and refuses to write.
    """

    def __init__(self, config: ReplayConfig, envs: range | None, rows: int, device: torch.device,
                 name: str, owner_pid: int):
        width = len(envs) if envs is not None else 1
        self.envs, self.rows, self.device, self.name, self.owner_pid = envs, rows, device, name, owner_pid
        self.config = dataclasses.replace(config, n_envs=width, max_rows=rows, max_size=rows * width)
        lane = (width,) if config.vectorized_env else ()
        self.queue = {}
        for leaf in config.leaves:
            t = torch.zeros((rows, *lane, *leaf.shape), dtype=leaf.dtype, device=device)
            self.queue[leaf.path] = t if device.type == "cuda" else t.share_memory_()
        self.control = torch.zeros(4, dtype=torch.int64).share_memory_()
        self.copied = False
        self._started = None  # (owner side) the process it was handed to at a spawn: its pid before the actor claims

    # ------------------------------------------------------------------ actor side

    def insert(self, transition: Transition, timeout: float | None = None) -> "ReplayWriter":
        """Publish ``T`` rows (leaves ``(T, len(envs), ...)``, ``(T, ...)`` not vectorized; the buffer's leaves,
        shapes and value-preserving dtypes; ``1 <= T <= rows``) to the owner; returns ``self``. Waits while the
        queue has no room for them (``timeout`` seconds, ``None``: no limit, then ``TimeoutError``); nothing is
        published on any error."""
        self._check_writer()
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.number))
                                    or not timeout >= 0 or math.isnan(timeout)):
            raise ValueError(f"timeout: expected None or seconds >= 0, got {timeout!r}")
        values, _, T = self.config.rows(transition)
        control = self.control
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        pause = _POLL_S[0]
        while self.rows - int(control[PUBLISHED] - control[CONSUMED]) < T:
            if not process_alive(self.owner_pid):
                raise RuntimeError(f"{self}: the owner (pid {self.owner_pid}) is gone; nothing was published")
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"{self}: the owner did not make room for {T} rows in {timeout} s "
                                   "(is it sampling or calling collect()?)")
            time.sleep(pause)
            pause = min(2 * pause, _POLL_S[1])
        published = int(control[PUBLISHED])
        start = published % self.rows
        first = min(T, self.rows - start)
        for path, t in values.items():
            q = self.queue[path]
            q[start:start + first].copy_(t[:first])
            if first < T:
                q[:T - first].copy_(t[first:])
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the rows are whole before they are published
        control[PUBLISHED] = published + T
        return self

    def close(self) -> None:
        """This writer inserts no more: its published rows are still committed, then its lanes may be handed
        to a new writer (not reported as dead)."""
        if not self.control[CLOSED]:
            self.control[CLOSED] = CLOSED_BY_ACTOR

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

    @property
    def pending(self) -> int:
        """Rows published and not yet committed by the owner."""
        return int(self.control[PUBLISHED] - self.control[CONSUMED])

    def _check_writer(self) -> None:
        control = self.control
        if self.copied or not control.is_shared():
            raise RuntimeError(f"{self}: this is a copy holding no shared memory (a plain pickle or copy); pass the "
                               "writer to the actor as a torch.multiprocessing process argument, or fork")
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

    def consumed(self, n: int) -> None:
        self.control[CONSUMED] += n

    def pid(self) -> int:
        """The process writing through it: the one that claimed it, else the one it was spawned into (0: none
        known)."""
        pid = int(self.control[PID])
        if pid == 0 and self._started is not None:
            pid = getattr(self._started, "pid", None) or 0
        return pid

    def dead(self) -> bool:
        """Not closed, and its process gone."""
        return not self.control[CLOSED] and not process_alive(self.pid())

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


class WriterHub:
    """The owner's side: the writers of one buffer, their lanes, and the commits of their rows."""

    def __init__(self, buffer):
        self.buffer = buffer
        self.owner_pid = os.getpid()
        self.groups: dict[range | None, list[ReplayWriter]] = {}  # lanes -> writers in order (the last current)
        self.reported: set[int] = set()  # ids of writers reported dead

    def add(self, envs, rows: int) -> ReplayWriter:
        buffer, config = self.buffer, self.buffer.config
        envs = self._lanes(envs)
        rows = min(64, config.max_rows) if rows is None else _positive_int("rows", rows)
        if rows > config.max_rows:
            raise ValueError(f"rows: expected at most the buffer's {config.max_rows} rows per env, got {rows}")
        for lanes, writers in self.groups.items():
            if lanes is None:  # not vectorized: writers share no lanes
                break
            if lanes == envs:
                old = writers[-1]
                if not old.finished():
                    raise ValueError(f"envs: {old} still writes these lanes (close it, or let it end, first)")
            elif lanes is not None and envs is not None and lanes.start < envs.stop and envs.start < lanes.stop:
                raise ValueError(f"envs: {_show(envs)} overlaps the lanes {_show(lanes)} of another writer; "
                                 "give each writer its own range, or exactly the range of a writer that ended")
        writer = ReplayWriter(config, envs, rows, buffer.storage_device, type(buffer).__name__, self.owner_pid)
        self._check_band(envs)
        group = self.groups.setdefault(envs, [])
        if group and config.vectorized_env:
            group[-1].control[CLOSED] = max(int(group[-1].control[CLOSED]), RETIRED)  # its handle writes no more
            self._cut(group[-1], envs)
        group.append(writer)
        return writer

    def _check_band(self, envs) -> None:
        """``ValueError`` when the rate limiter's band is narrower than one committed row (all lanes)."""
        limiter, config = self.buffer.rate_limiter, self.buffer.config
        if limiter is None or not config.vectorized_env:
            return
        step, span = config.n_envs * limiter.samples_per_insert, limiter.max_diff - limiter.min_diff
        if step > span:
            raise ValueError(f"envs: a row of all {config.n_envs} lanes (committed whole) moves the rate limiter's "
                             f"inserts * samples_per_insert - samples by {step:g}, more than max_diff - min_diff = "
                             f"{span:g}, so it could never be committed (widen error_buffer)")

    def _lanes(self, envs) -> range | None:
        config = self.buffer.config
        if not config.vectorized_env:
            if envs is not None:
                raise ValueError(f"envs: a buffer with vectorized_env=False has no env lanes; expected None, "
                                 f"got {envs!r}")
            return None
        E = config.n_envs
        if envs is None:
            return range(E)
        if isinstance(envs, slice):
            envs = range(E)[envs]
        if not isinstance(envs, range) or envs.step != 1 or len(envs) == 0 or envs.start < 0 or envs.stop > E:
            raise ValueError(f"envs: expected a non-empty range(a, b) of consecutive env lanes within range(0, {E}), "
                             f"got {envs!r}")
        return envs

    def _cut(self, old: ReplayWriter, envs: range) -> None:
        """A new writer takes over ``envs`` after ``old``: end their episodes at ``old``'s last row."""
        paths = self.buffer.config.paths("truncated")
        if not paths or old.mark_last_truncated(paths):
            return
        lanes = np.zeros(self.buffer.config.n_envs, bool)
        lanes[envs.start:envs.stop] = True
        self.buffer.cut_episodes(lanes)

    # ------------------------------------------------------------------ commits

    def collect(self, report: bool = True) -> int:
        """Commit what the writers published (as far as the rate limiter lets inserts run now); returns the
        transitions committed. ``WriterDied`` (``report``) for a writer that died since the last report."""
        if os.getpid() != self.owner_pid:
            return 0  # a forked child's copy of the buffer takes nobody's rows
        done = self._commit_lanes() if self.buffer.config.vectorized_env else self._commit_streams()
        self._drop_finished()
        if report:
            self._report()
        return done

    def _commit_lanes(self) -> int:
        config, limiter = self.buffer.config, self.buffer.rate_limiter
        groups = sorted((g for g in self.groups.items() if g[1]), key=lambda g: g[0].start)
        if sum(len(lanes) for lanes, _ in groups) != config.n_envs:
            return 0  # rows commit once every lane has a writer
        n = min(sum(w.pending for w in writers) for _, writers in groups)
        n = min(n, config.max_rows)
        if limiter is not None:
            n = _most(n, lambda k: limiter.can_insert(k * config.n_envs))
        if n == 0:
            return 0
        per_group, taken = [], []
        for _, writers in groups:  # a group's rows may come from two writers: the ended one's first
            left, pieces = n, []
            for w in writers:
                k = min(left, w.pending)
                if k:
                    pieces.append(w.take(k))
                    taken.append((w, k))
                    left -= k
            per_group.append({p: _cat([x[p] for x in pieces], 0) for p in pieces[0]})
        leaves = {p: _cat([g[p] for g in per_group], 1) for p in per_group[0]}  # lanes side by side
        self._insert(leaves, taken)
        return n * config.n_envs

    def _commit_streams(self) -> int:
        limiter, done = self.buffer.rate_limiter, 0
        for writers in list(self.groups.values()):
            for w in writers:
                n = min(w.pending, self.buffer.config.max_rows)
                if limiter is not None:
                    n = _most(n, limiter.can_insert)
                if n:
                    self._insert(w.take(n), [(w, n)])
                    done += n
        return done

    def _insert(self, leaves: dict, taken: list) -> None:
        self.buffer.insert(unflatten(leaves))
        if self.buffer.storage_device.type == "cuda":  # the queue rows are read before actors reuse them
            torch.cuda.current_stream(self.buffer.storage_device).synchronize()
        for w, k in taken:
            w.consumed(k)

    def _drop_finished(self) -> None:
        """Forget drained writers that ended, keeping each lane group's last (its lanes' owner of record)."""
        for lanes, writers in self.groups.items():
            last = writers[-1:] if lanes is not None else []
            keep = [w for w in writers[:len(writers) - len(last)] if w.pending or not w.finished()]
            self.groups[lanes] = keep + last

    def _report(self) -> None:
        for writers in self.groups.values():
            for w in writers:
                if id(w) not in self.reported and w.dead():
                    self.reported.add(id(w))
                    pid, pending = w.pid(), w.pending
                    w.control[CLOSED] = RETIRED  # another process taking the handle up cannot write through it
                    left = ("every row it published is committed" if pending == 0 else
                            f"the {pending} rows it published are committed with the other lanes' rows")
                    again = (f"; hand its lanes to a new writer: buffer.writer(envs={_show(w.envs)})"
                             if w.envs is not None else "")
                    raise WriterDied(f"{w}: its process {pid} exited or was killed; {left}, rows in flight are "
                                     f"lost{again}")


def _most(n: int, fits) -> int:
    """The largest ``k <= n`` with ``fits(k)`` (monotone: fits for small k), 0 if none."""
    if n == 0 or fits(n):
        return n
    lo, hi = 0, n  # fits(lo) or lo == 0; not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _cat(tensors: list, dim: int) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=dim)


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return int(value)


def _show(envs: range) -> str:
    return f"range({envs.start}, {envs.stop})"
