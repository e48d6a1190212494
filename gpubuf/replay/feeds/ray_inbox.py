"""The learner's side of Ray actors as writers: the inbox actor their rows go to, and the feed that moves them into
the writers' queues in the learner's process, where :mod:`gpubuf.replay.feeds.writer_hub` commits them like any
writer's.

Transport: an actor's :meth:`~gpubuf.replay.feeds.ray_writers.RayWriter.insert` sends its rows (numpy arrays) to one
inbox actor per buffer, placed on the learner's node; the inbox keeps each insert as a Ray object it owns, so rows
an actor published outlive the actor. The learner fetches them (object refs, read from its node's object store)
whenever it commits: a non-blocking check of an outstanding request in :meth:`sample`, :meth:`can_sample` and a rate
limiter's wait, a blocking round trip in :meth:`collect`. An actor's death is seen through a request pending on the
actor itself (``__ray_ready__``), which fails once the actor is gone (killed, crashed, or its node lost); the writer
is dead once every row it published was fetched. Ray is imported here only."""

import collections
import warnings
import weakref

import torch

from gpubuf.replay.feeds.process_writers import CLOSED, CLOSED_BY_ACTOR, ReplayWriter
from gpubuf.replay.feeds.ray_writers import RayWriter, import_ray


class Inbox:
    """The Ray actor (on the learner's node) that holds what writer actors published until the learner fetches it.

    Per writer ``key``: its objects (one per insert), rows ``published``, rows the learner ``consumed`` (committed,
    as it last said), the owner's ``state`` (its ``CLOSED`` word: nonzero refuses further rows), whether its actor
    closed it, and the actor's handle (claimed by the first actor that inserts)."""

    def __init__(self):
        self.streams = {}

    def _stream(self, key: int) -> dict:
        return self.streams.setdefault(key, dict(blocks=collections.deque(), published=0, consumed=0, state=0,
                                                 closed=False, actor=None, actor_id=None, sent_actor=False))

    def claim(self, key: int, actor, actor_id: str) -> str | None:
        """Bind writer ``key`` to one actor; the id of another actor that holds it already, else None."""
        s = self._stream(key)
        if s["actor_id"] is not None and s["actor_id"] != actor_id:
            return s["actor_id"]
        s["actor"], s["actor_id"] = actor, actor_id
        return None

    def publish(self, key: int, block: dict, T: int) -> tuple[int, int]:
        """Keep ``T`` rows (``block``: ``{path: array}``) unless the owner ended the writer; ``(in flight, state)``."""
        import ray

        s = self._stream(key)
        if s["state"] == 0 and not s["closed"]:
            s["blocks"].append((ray.put(block), T))  # owned here: it outlives the actor that sent it
            s["published"] += T
            return s["published"] - s["consumed"], 0
        return self.room(key)

    def room(self, key: int) -> tuple[int, int]:
        s = self._stream(key)
        return s["published"] - s["consumed"], s["state"] or (CLOSED_BY_ACTOR if s["closed"] else 0)

    def close(self, key: int) -> None:
        self._stream(key)["closed"] = True

    def take(self, acks: dict, states: dict) -> dict:
        """Hand over what was published since the last take: ``{key: (objects and row counts, closed, actor)}``
        (the actor's handle once); ``acks``: rows the learner committed per writer, ``states``: their words."""
        out = {}
        for key, consumed in acks.items():
            s = self._stream(key)
            s["consumed"], s["state"] = max(s["consumed"], consumed), states[key]
            blocks = list(s["blocks"])
            s["blocks"].clear()
            actor = s["actor"] if not s["sent_actor"] and s["actor"] is not None else None
            s["sent_actor"] = s["sent_actor"] or actor is not None
            out[key] = (blocks, s["closed"], actor, s["actor_id"])
        return out


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
    """The learner's end of the inbox: hands out :class:`RayLane` writers and moves their actors' rows in."""

    def __init__(self, owner_pid: int):
        ray = self.ray = import_ray()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.inbox = ray.remote(num_cpus=0)(Inbox).options(scheduling_strategy=here).remote()
        self.lanes: dict[int, RayLane] = {}
        self.actors: dict[int, object] = {}  # key -> its actor's handle, once it claimed the writer
        self.watches: dict[int, object] = {}  # key -> a pending request on its actor (fails once it is gone)
        self.request, self.serial, self.done = None, 0, 0  # the outstanding take; takes issued; takes processed
        self.owner_pid = owner_pid
        weakref.finalize(self, _end, ray, self.inbox)

    def lane(self, *args, **kwargs) -> RayLane:
        key = len(self.lanes)
        lane = self.lanes[key] = RayLane(*args, key=key, **kwargs)
        lane.handle = RayWriter(lane, self.inbox)
        return lane

    def pull(self, wait: bool = False) -> None:
        """Move what actors published into their lanes' queues: what an outstanding request brought (``wait``:
        after a fresh round trip, so that everything published before this call is in)."""
        ray = self.ray
        self._watch()
        if self.request is None:
            self._ask()
        if wait:
            self._process(ray.get(self.request))
            self._ask()
            self._process(ray.get(self.request))
            self._ask()
        elif ray.wait([self.request], timeout=0)[0]:
            self._process(ray.get(self.request))
            self._ask()

    def _ask(self) -> None:
        acks = {k: int(lane.control[1]) for k, lane in self.lanes.items()}  # CONSUMED
        states = {k: int(lane.control[CLOSED]) if lane.control[CLOSED] != CLOSED_BY_ACTOR else 0
                  for k, lane in self.lanes.items()}
        self.serial += 1
        self.request = self.inbox.take.remote(acks, states)

    def _process(self, taken: dict) -> None:
        self.done += 1
        refs = [ref for blocks, *_ in taken.values() for ref, _ in blocks]
        values = iter(self.ray.get(refs)) if refs else iter(())
        for key, (blocks, closed, actor, actor_id) in taken.items():
            lane = self.lanes[key]
            for _, T in blocks:
                block = next(values)
                if not lane.gone:  # rows a dead actor's last calls delivered late are not its published ones
                    lane.receive(block, T)
            if actor is not None:
                lane.actor_id, self.actors[key] = actor_id, actor
                self.watches[key] = actor.__ray_ready__.remote()
            if closed and not lane.control[CLOSED]:
                lane.control[CLOSED] = CLOSED_BY_ACTOR
            if lane.gone_seen is not None and self.done > lane.gone_seen:
                lane.gone = True  # a take asked for after its death came back: all it published is in

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
                self.lanes[key].gone_seen = self.serial  # the take after the current one brings all it sent


def _end(ray, inbox) -> None:
    """The buffer was dropped: its inbox goes, so its actors' next inserts fail (they hear the owner ended)."""
    try:
        if ray.is_initialized():
            ray.kill(inbox)
    except Exception:  # Ray shut down first: nothing is left to end
        pass
