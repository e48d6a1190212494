"""The learner's side of Ray actors as writers: the inbox actor their rows go to, and the feed that moves them into
the writers' queues in the learner's process, where :mod:`gpubuf.replay.feeds.writer_hub` commits them like any
writer's.

Transport: an actor's :meth:`~gpubuf.replay.feeds.ray_writers.RayWriter.insert` sends its rows (numpy arrays) to one
inbox actor per buffer, placed on the learner's node; the inbox keeps a copy of each insert, so rows an actor
published outlive the actor. The learner fetches them whenever it commits: a non-blocking check of an outstanding
request in :meth:`sample`, :meth:`can_sample` and a rate limiter's wait, a round trip in :meth:`collect`. An
actor's death is seen through a request pending on the actor itself (``__ray_ready__``), which fails once the actor
is gone (killed, crashed, or its node lost); the writer is dead once every row it published was fetched. Ray is
imported here only."""

import threading
import warnings
import weakref

import numpy as np
import torch

from gpubuf.replay.feeds.process_writers import CLOSED, CLOSED_BY_ACTOR, ReplayWriter
from gpubuf.replay.feeds.ray_writers import RayWriter, import_ray


class Inbox:
    """The Ray actor (on the learner's node) that holds what writer actors published until the learner fetches it.

    Per writer ``key``: its inserts (copies in this process: they outlive the actor that sent them), rows
    ``published``, rows the learner ``consumed`` (committed, as it last said), the owner's ``state`` (its ``CLOSED``
    word: nonzero refuses further rows), whether its actor closed it, and the actor's handle (claimed by the first
    actor that inserts). Runs its calls in threads (each caller waits for its call before the next): a take or a
    wait for room lingers until there is something to answer, so neither side polls."""

    def __init__(self):
        self.streams, self.changed, self.handed = {}, threading.Condition(), 0  # takes answered

    def _stream(self, key: int) -> dict:
        return self.streams.setdefault(key, dict(blocks=[], published=0, consumed=0, state=0, closed=False,
                                                 actor=None, actor_id=None, sent_actor=False, sent_closed=False))

    def claim(self, key: int, actor, actor_id: str) -> str | None:
        """Bind writer ``key`` to one actor; the id of another actor that holds it already, else None."""
        with self.changed:
            s = self._stream(key)
            if s["actor_id"] is not None and s["actor_id"] != actor_id:
                return s["actor_id"]
            s["actor"], s["actor_id"] = actor, actor_id
            self.changed.notify_all()
            return None

    def publish(self, key: int, at: int, block: dict, T: int, rows: int) -> tuple[int, int]:
        """Keep ``T`` rows (``block``: ``{path: array}``), the writer's rows from ``at`` on, unless the owner ended
        the writer; ``(rows committed, state)``. Sends may run out of order (threads): a send waits for the sends
        before it, as the writer numbered them. ``RuntimeError`` for a send out of turn or beyond ``rows`` in
        flight (nothing kept)."""
        kept = {p: v.clone() if isinstance(v, torch.Tensor) else np.array(v)  # a copy: Ray's views of the sender's
                for p, v in block.items()}  # objects end with it (a tensor: a dtype numpy lacks)
        with self.changed:
            s = self._stream(key)
            self.changed.wait_for(lambda: s["published"] >= at or s["state"] or s["closed"], timeout=60)
            if s["state"] or s["closed"]:
                return self._said(s)
            if s["published"] != at or s["published"] + T - s["consumed"] > rows:
                raise RuntimeError(f"rows {at}..{at + T - 1} sent out of turn (the inbox holds {s['published']} "
                                   f"rows of this writer, {s['consumed']} committed, at most {rows} in flight)")
            s["blocks"].append((kept, T))
            s["published"] += T
            self.changed.notify_all()
            return self._said(s)

    def room(self, key: int, most: int, linger: float) -> tuple[int, int]:
        """``(rows committed, state)`` once at most ``most`` rows are in flight, the writer ended, or ``linger`` s
        passed."""
        with self.changed:
            s = self._stream(key)
            self.changed.wait_for(lambda: s["published"] - s["consumed"] <= most or s["state"] or s["closed"],
                                  timeout=linger)
            return self._said(s)

    @staticmethod
    def _said(s: dict) -> tuple[int, int]:
        return s["consumed"], s["state"] or (CLOSED_BY_ACTOR if s["closed"] else 0)

    def close(self, key: int, actor_id: str | None) -> str | None:
        """Close writer ``key`` for its actor (``actor_id``; None: the learner, or a process that is no actor);
        the id of the actor that holds it instead, else None."""
        with self.changed:
            s = self._stream(key)
            if actor_id is not None and s["actor_id"] not in (None, actor_id):
                return s["actor_id"]
            s["closed"] = True
            self.changed.notify_all()
            return None

    def take(self, asked: int, acks: dict, states: dict, linger: float) -> tuple[int, int, dict]:
        """Hand over what was published since the last take, once there is any (or ``linger`` s passed): ``(its
        place among the answers, asked, {key: (inserts with their row counts, closed (once), actor handle (once),
        actor id)})``; ``asked``: the learner's number for the take, ``acks``: rows the learner committed per
        writer, ``states``: their ``CLOSED`` words."""
        with self.changed:
            for key, consumed in acks.items():
                s = self._stream(key)
                s["consumed"], s["state"] = max(s["consumed"], consumed), states[key]
            self.changed.notify_all()  # room for writers waiting on it
            self.changed.wait_for(lambda: any(self._news(self._stream(k)) for k in acks), timeout=linger)
            out = {}
            for key in acks:
                s = self._stream(key)
                actor = s["actor"] if not s["sent_actor"] else None
                out[key] = (s["blocks"], s["closed"] and not s["sent_closed"], actor, s["actor_id"])
                s["sent_actor"], s["sent_closed"], s["blocks"] = s["actor"] is not None, s["closed"], []
            self.handed += 1
            return self.handed, asked, out

    @staticmethod
    def _news(s: dict) -> bool:
        return bool(s["blocks"]) or s["sent_actor"] != (s["actor"] is not None) or s["sent_closed"] != s["closed"]


class RayLane(ReplayWriter):
    """A Ray writer as the hub sees it: a writer whose queue, in the learner's process, is filled by the
    :class:`RayFeed` from what its actor published (nothing else writes it); dead once its actor is gone and
    everything it published was fetched."""

    def __init__(self, *args, key: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.key, self.actor_id, self.gone = key, None, False
        self.gone_seen = None  # the take serial after which its actor was seen gone

    def receive(self, block: dict, T: int) -> None:
        """Publish ``T`` rows an actor sent (``{path: array}``) into the queue (it has room: the inbox lets at
        most ``rows`` rows be in flight)."""
        with warnings.catch_warnings():  # Ray's arrays are read-only views of its object store: only read here
            warnings.simplefilter("ignore", UserWarning)
            values = {p: torch.as_tensor(v) for p, v in block.items()}
        self.publish(values, T)

    transport_arg = ', transport="ray"'

    def dead(self) -> bool:
        return not self.control[CLOSED] and self.gone

    def death(self) -> str:
        who = f"its Ray actor {self.actor_id}" if self.actor_id else "the Ray actor it was handed to"
        return f"{who} died (killed, failed, or its node was lost)"

    def __repr__(self) -> str:
        return "Ray" + super().__repr__()


class RayFeed:
    """The learner's end of the inbox: hands out :class:`RayLane` writers and moves their actors' rows in.

    One take is outstanding at a time, lingering in the inbox until there is news; :meth:`pull` processes it when
    it came back (``wait``: plus a take that answers at once). Answers are processed in the order the inbox gave
    them (its count), so each writer's inserts arrive in order."""

    LINGER_S = 0.05  # how long an outstanding take waits in the inbox for news

    def __init__(self, owner_pid: int):
        ray = self.ray = import_ray()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.inbox = ray.remote(num_cpus=0, max_concurrency=1000)(Inbox).options(scheduling_strategy=here).remote()
        self.lanes: dict[int, RayLane] = {}
        self.actors: dict[int, object] = {}  # key -> its actor's handle, once it claimed the writer
        self.watches: dict[int, object] = {}  # key -> a pending request on its actor (fails once it is gone)
        self.request, self.asked = None, 0  # the outstanding take; takes asked for
        self.processed, self.early = 0, {}  # answers processed (the inbox's count); answers come before their turn
        self.owner_pid = owner_pid
        weakref.finalize(self, _end, ray, self.inbox)

    def lane(self, *args, **kwargs) -> RayLane:
        key = len(self.lanes)
        lane = self.lanes[key] = RayLane(*args, key=key, **kwargs)
        lane.handle = RayWriter(lane, self.inbox)
        return lane

    def pull(self, wait: bool = False) -> None:
        """Move what actors published into their lanes' queues: what the outstanding take brought (``wait``: and
        everything published before this call)."""
        ray = self.ray
        self._watch()
        if wait:
            self._answer(ray.get(self._ask(0.0)))
            while self.early:  # the outstanding take was answered before this one: its rows go first
                self._answer(ray.get(self.request))
                self.request = None
        elif self.request is not None and ray.wait([self.request], timeout=0)[0]:
            self._answer(ray.get(self.request))
            self.request = None
        if self.request is None:
            self.request = self._ask(self.LINGER_S)

    def _ask(self, linger: float):
        acks = {k: int(lane.control[1]) for k, lane in self.lanes.items()}  # CONSUMED
        states = {k: int(lane.control[CLOSED]) if lane.control[CLOSED] != CLOSED_BY_ACTOR else 0
                  for k, lane in self.lanes.items()}
        self.asked += 1
        return self.inbox.take.remote(self.asked, acks, states, linger)

    def _answer(self, answer: tuple) -> None:
        self.early[answer[0]] = answer
        while self.processed + 1 in self.early:
            self.processed += 1
            self._process(*self.early.pop(self.processed)[1:])

    def _process(self, asked: int, taken: dict) -> None:
        for key, (blocks, closed, actor, actor_id) in taken.items():
            lane = self.lanes[key]
            for block, T in blocks:
                if not lane.gone:  # rows a dead actor's last calls delivered late are not its published ones
                    lane.receive(block, T)
            if actor is not None:
                lane.actor_id, self.actors[key] = actor_id, actor
                self.watches[key] = actor.__ray_ready__.remote()
            if closed and not lane.control[CLOSED]:
                lane.control[CLOSED] = CLOSED_BY_ACTOR
            if lane.gone_seen is not None and asked > lane.gone_seen:
                lane.gone = True  # a take asked for after its death was answered: all it published is in

    def _watch(self) -> None:
        ray = self.ray
        ready, _ = ray.wait(list(self.watches.values()), num_returns=len(self.watches), timeout=0) \
            if self.watches else ([], None)
        ready = set(ready)
        for key, ref in list(self.watches.items()):
            if ref not in ready:
                continue
            try:
                ray.get(ref)
                self.watches[key] = self.actors[key].__ray_ready__.remote()  # it was idle: watch it again
            except ray.exceptions.RayActorError:
                del self.watches[key]
                self.lanes[key].gone_seen = self.asked  # a take asked for from now on brings all it sent


def _end(ray, inbox) -> None:
    """The buffer was dropped: its inbox goes, so its actors' next inserts fail (they hear the owner ended)."""
    try:
        if ray.is_initialized():
            ray.kill(inbox)
    except Exception:  # Ray shut down first: nothing is left to end
        pass
