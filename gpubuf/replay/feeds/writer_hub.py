"""The owner's side of writers in other processes: their lanes, the commits of their rows, the reports.

Commits (:mod:`gpubuf.replay.feeds.process_writers` for the actor's side): a vectorized buffer commits row ``t`` once
every lane's writer published its row ``t`` (lockstep; a rate limiter may let in fewer rows than are ready, one row
of all lanes at a time). A buffer that is not vectorized commits each writer's inserts whole: an insert the rate
limiter holds back waits whole, and that writer goes first at the next commit, so no other writer's row lands inside
it; a writer's inserts hold at most ``writer.max_insert`` rows (what the band holds beside a sample).

Reports, never silent:

- a dead writer (its process ended without ``close()``) raises :class:`WriterDied` once, from the first call that
  commits after every row it published was committed, or, where some of them can never be committed until new
  writers come (a vectorized buffer whose other lanes' writers all ended with fewer rows), at once, saying how many
  wait and for which lanes;
- rows a writer published beyond the rows of lanes whose writers all ended (closed or died) cannot be committed
  (a row holds every lane): a :class:`RowsWaiting` warning says so once, naming the lanes to hand to a new writer;
  the rows stay queued (``writer.pending``) and commit once that writer publishes as many;
- a closed ``storage_dir`` buffer commits nothing (it can no longer be written, and still samples): rows still
  queued then are named by a :class:`RowsWaiting` warning."""

import os
import warnings
import weakref

import numpy as np
import torch

from gpubuf._core.inputs import positive_int
from gpubuf._core.transition import unflatten
from gpubuf.replay.feeds.process_writers import CLOSED, OWNER_ENDED, RETIRED, ReplayWriter, RowsWaiting, WriterDied


class WriterHub:
    """The owner's side: the writers of one buffer, their lanes, and the commits of their rows."""

    def __init__(self, buffer):
        self._buffer = weakref.ref(buffer)  # the buffer holds its hub: a weak reference back (dropped, it is freed)
        self.owner_pid = os.getpid()
        self.groups: dict[range | None, list[ReplayWriter]] = {}  # lanes -> writers in order (the last current)
        self.reported: set[int] = set()  # ids of writers reported dead
        self.warned: set = set()  # the stalls warned about (RowsWaiting)
        self.first = None  # not vectorized: the writer whose insert the rate limiter held back (goes first)
        self.feed = None  # the Ray actors' inbox (RayFeed), once a writer with transport="ray" was handed out
        weakref.finalize(self, end_writers, self.groups)  # the buffer dropped: its actors hear of it at once

    @property
    def buffer(self):
        """The buffer these writers insert into."""
        return self._buffer()

    def add(self, envs, rows: int, transport: str = "shared"):
        buffer, config = self.buffer, self.buffer.config
        envs = self._lanes(envs)
        if self.feed is not None and os.getpid() == self.owner_pid:
            self.feed.pull(wait=True)  # which Ray writers closed, as of now
        rows = min(64, config.max_rows) if rows is None else positive_int("rows", rows)
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
        limiter = buffer.rate_limiter
        most = rows if limiter is None or config.vectorized_env else min(rows, limiter.insert_cap(
            config.sample_batch_size))
        make = ReplayWriter if transport == "shared" else self._ray_feed().lane
        writer = make(config, envs, rows, buffer.storage_device, type(buffer).__name__, self.owner_pid, most)
        group = self.groups.setdefault(envs, [])
        if group and config.vectorized_env:
            group[-1].control[CLOSED] = max(int(group[-1].control[CLOSED]), RETIRED)  # its handle writes no more
            self._cut(group[-1], envs)
        group.append(writer)
        return getattr(writer, "handle", writer)  # a Ray writer's actor holds its handle, not its queue

    def _ray_feed(self):
        if self.feed is None:
            from gpubuf.replay.feeds.ray_inbox import RayFeed

            self.feed = RayFeed(self.owner_pid)
        return self.feed

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

    def collect(self, report: bool = True, wait: bool = False) -> int:
        """Commit what the writers published (as far as the rate limiter lets inserts run now); returns the
        transitions committed. ``WriterDied`` (``report``) for a writer that died (module docstring: when). Ray
        actors' rows come in first: those that already arrived, or (``wait``) all published before this call."""
        if os.getpid() != self.owner_pid:
            return 0  # a forked child's copy of the buffer takes nobody's rows
        if self.buffer.storage.closed:
            self.warn_closed()
            return 0
        if self.feed is not None:
            self.feed.pull(wait)
        vectorized = self.buffer.config.vectorized_env
        done = self._commit_lanes() if vectorized else self._commit_streams()
        self._drop_finished()
        stuck = self._ended_lanes() if vectorized else {}
        self._warn_stuck(stuck)
        if report:
            self._report(stuck)
        return done

    def _groups(self) -> list:
        return sorted((g for g in self.groups.items() if g[1]), key=lambda g: g[0].start)

    def _commit_lanes(self) -> int:
        config, limiter = self.buffer.config, self.buffer.rate_limiter
        groups = self._groups()
        if sum(len(lanes) for lanes, _ in groups) != config.n_envs:
            return 0  # rows commit once every lane has a writer
        n = min(config.max_rows, *(sum(w.pending for w in writers) for _, writers in groups))  # rows every lane has
        if limiter is not None:  # within the band; one row of all lanes may cross min_size_to_sample
            E = config.n_envs
            n = _most(n, lambda k: limiter.fits(k * E)) or int(n > 0 and limiter.can_insert(E))
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
        self._insert(leaves, taken, n * config.n_envs)
        return n * config.n_envs

    def _commit_streams(self) -> int:
        """Whole inserts, writer after writer, starting with the one the rate limiter held back last time."""
        writers = [w for group in self.groups.values() for w in group]
        if self.first in writers:
            at = writers.index(self.first)
            writers = writers[at:] + writers[:at]
        limiter, done = self.buffer.rate_limiter, 0
        for w in writers:
            ends = w.insert_ends(min(w.pending, self.buffer.config.max_rows))  # rows after each whole insert
            fits = ends if limiter is None else [k for k in ends if limiter.fits(k)] or \
                [k for k in ends[:1] if limiter.can_insert(k)]  # its first insert may cross min_size_to_sample
            if fits:
                self._insert(w.take(fits[-1]), [(w, fits[-1])], fits[-1])
                done += fits[-1]
            if limiter is not None and w.pending:  # held back: it goes first next time, nobody passes it now
                self.first = w
                break
        return done

    def _insert(self, leaves: dict, taken: list, n: int) -> None:
        buffer = self.buffer
        if buffer.rate_limiter is None:
            buffer.insert(unflatten(leaves))
        else:  # its size is one the band holds: rows of all lanes, or inserts of at most max_insert rows
            buffer.insert_in_turn(unflatten(leaves), n, sized=True)
        if buffer.storage_device.type == "cuda":  # the queue rows are read before actors reuse them
            torch.cuda.current_stream(buffer.storage_device).synchronize()
        for w, k in taken:
            w.consumed(k)

    def _drop_finished(self) -> None:
        """Forget drained ended writers, but each lane group's last (its owner of record) and unreported dead ones."""
        for lanes, writers in self.groups.items():
            last = writers[-1:] if lanes is not None else []
            keep = [w for w in writers[:len(writers) - len(last)]
                    if w.pending or not w.finished() or (id(w) not in self.reported and w.dead())]
            self.groups[lanes] = keep + last

    # ------------------------------------------------------------------ reports

    def _ended_lanes(self) -> dict:
        """``{lanes: their last writer}`` of the lane groups whose writers all ended with no row left, while
        another group's writers published rows that now wait for them (none when every lane has rows)."""
        groups = self._groups()
        dry = [(lanes, ws) for lanes, ws in groups if not any(w.pending for w in ws)]
        if not dry or len(dry) == len(groups) or sum(len(lanes) for lanes, _ in groups) != self.buffer.config.n_envs:
            return {}  # every lane has rows, or none has: nothing waits (liveness is not read then)
        return {lanes: ws[-1] for lanes, ws in dry if all(w.finished() for w in ws)}

    def _warn_stuck(self, stuck: dict) -> None:
        for lanes, last in stuck.items():
            key = (id(last), "lanes")
            if key in self.warned:
                continue
            self.warned.add(key)
            rows = ", ".join(f"{sum(w.pending for w in ws)} of lanes {_show(g)}" for g, ws in self._groups()
                             if g not in stuck)
            warnings.warn(RowsWaiting(
                f"rows writers published ({rows}) wait for rows of lanes {_show(lanes)}, whose "
                f"writer {last} ended (closed or died) with fewer: a row holds every lane, so they are committed "
                f"once buffer.writer(envs={_show(lanes)}) hands those lanes to a new writer that publishes as many; "
                "until then they are in no checkpoint (writer.pending counts them)"), stacklevel=4)

    def warn_closed(self) -> None:
        """The buffer's ``storage_dir`` closed: its writers insert no more (``RuntimeError`` in their actors), and a
        :class:`RowsWaiting` warning (once) names the rows still queued."""
        end_writers(self.groups)
        if self.feed is not None:
            self.feed.pull(wait=True)  # Ray actors hear of it; rows they published since are counted below
        queued = sum(w.pending for ws in self.groups.values() for w in ws)
        if queued and "closed" not in self.warned:
            self.warned.add("closed")
            warnings.warn(RowsWaiting(
                f"the buffer's storage_dir is closed: {queued} rows its writers published are not committed and "
                "cannot be (call collect() before close(), or re-open the directory and hand out new writers)"),
                stacklevel=4)

    def _report(self, stuck: dict) -> None:
        for writers in self.groups.values():
            for w in writers:
                if id(w) in self.reported or not w.dead():
                    continue
                if w.pending and not stuck:
                    continue  # its rows still commit (the rate limiter lets them in, the other lanes catch up)
                self.reported.add(id(w))
                pending = w.pending
                w.control[CLOSED] = RETIRED  # another process taking the handle up cannot write through it
                left = ("every row it published is committed" if pending == 0 else
                        f"{pending} rows it published wait for rows of lanes "
                        f"{', '.join(_show(g) for g in stuck)}, whose writers ended (they commit once new writers "
                        "of those lanes publish as many)")
                again = (f"; hand its lanes to a new writer: buffer.writer(envs={_show(w.envs)}{w.transport_arg})"
                         if w.envs is not None else "")
                raise WriterDied(f"{w}: {w.death()}; {left}; rows in flight are lost{again}")


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


def _show(envs: range) -> str:
    return f"range({envs.start}, {envs.stop})"


def end_writers(groups: dict) -> None:
    """Every writer of ``groups`` (a hub's) refuses further inserts: its buffer was closed or dropped."""
    for writers in groups.values():
        for w in writers:
            if int(w.control[CLOSED]) != RETIRED:  # a retired one says so still
                w.control[CLOSED] = OWNER_ENDED

