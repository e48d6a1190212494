"""A replay buffer's doors for its writers and its rate limiter: writers in other processes (:meth:`writer`, their
commits in :meth:`collect`), and the limiter's questions (:meth:`can_sample`, :meth:`can_insert`) and turns
(:meth:`insert_in_turn`). The commits themselves live in :mod:`gpubuf.replay.feeds.writer_hub`."""

import numpy as np
import torch

from gpubuf._core.concurrency import locked
from gpubuf._core.transition import Transition
from gpubuf.replay.feeds.writer_hub import WriterHub


class WriterDoors:
    """Mixed into :class:`~gpubuf.TransitionBuffer`, which provides ``lock``, ``config``, ``rate_limiter``,
    ``_insert`` and ``_hub`` (the :class:`WriterHub`, made with the first writer)."""

    def insert_in_turn(self, transition: Transition, n: int, sized: bool = False):
        """:meth:`insert` of ``n`` transitions with a rate limiter (under the lock; for writers' commits): wait for the
        turn, write, or give the count back (``sized``: the caller checked ``n`` against the band already)."""
        limiter = self.rate_limiter
        limiter.take("insert", n, sized)
        try:
            return self._insert(transition)
        except BaseException:
            limiter.give_back("insert", n)
            raise

    def can_sample(self, n: int | None = None) -> bool:
        """Whether the :attr:`rate_limiter` lets a sample of ``n`` windows (``None``: the default batch) run now
        (always without one, the buffer's own checks aside), once what writers in other processes published is
        committed; ``WriterDied`` for a dead writer, as :meth:`collect`."""
        if self._hub is not None:
            with self.lock:
                self._hub.collect()
        return self.rate_limiter is None or self.rate_limiter.can_sample(self.config.batch_size(n))

    def can_insert(self, n: int) -> bool:
        """Whether the :attr:`rate_limiter` lets an insert of ``n`` transitions (``T * n_envs`` of a vectorized
        buffer) run now (always without one)."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"n: expected a positive int (transitions), got {n!r}")
        return self.rate_limiter is None or self.rate_limiter.can_insert(int(n))

    @torch.compiler.disable
    @locked
    def writer(self, envs=None, rows: int | None = None, transport: str = "shared"):
        """A :class:`~gpubuf.replay.feeds.process_writers.ReplayWriter` through which one other process (an actor, given
        it as a ``torch.multiprocessing`` process argument) inserts into this buffer.

        ``envs``: the env lanes it writes, ``range(a, b)`` (``None``: all; a buffer with ``vectorized_env=False`` has
        none). ``rows``: its queue's length in rows per env (at most ``max_size // n_envs``; ``None``: 64, or that if
        fewer). Its rows are committed by this process, in :meth:`sample`, :meth:`can_sample`, a rate limiter's wait and
        :meth:`collect`; a vectorized buffer's row once every lane's writer published it. A lane has one writer at a
        time: ``ValueError`` for lanes overlapping another writer's, except exactly the range of a writer that ended
        (closed, or its process gone), whose last row then ends those lanes' episodes. Not vectorized, each insert is
        committed whole (with a rate limiter, one insert holds at most ``writer.max_insert`` rows). The queue lives in
        shared host memory (CUDA memory for a buffer storing on a GPU), allocated here once.

        ``transport="ray"``: a :class:`~gpubuf.replay.feeds.ray_writers.RayWriter` for a Ray actor on any node of
        the cluster this process joined (``ray.init``; needs ``pip install 'gpubuf[ray]'``, else ``ImportError``):
        its rows travel through an inbox actor on this node (published once it holds them: ``writer.flush()``),
        at most ``rows`` rows per env in flight, and are committed here by the same rules as a process writer's; a
        dead actor is reported once (``WriterDied``) after what it published was committed."""
        if transport not in ("shared", "ray"):
            raise ValueError(f"transport: expected 'shared' (a process on this machine) or 'ray' (a Ray actor), "
                             f"got {transport!r}")
        if transport == "ray":
            from gpubuf.replay.feeds.ray_writers import import_ray

            import_ray()  # ImportError naming the extra, before anything is made
        if self._hub is None:
            self._hub = WriterHub(self)
            if self.rate_limiter is not None:
                self.rate_limiter.poll = self._hub.collect
        return self._hub.add(envs, rows, transport)

    @torch.compiler.disable
    @locked
    def collect(self) -> int:
        """Commit the rows that writers in other processes (:meth:`writer`) published, as far as the rate limiter
        lets inserts run now; returns the transitions committed (0 without writers); Ray actors' rows published
        before this call included (one round trip to their inbox). ``WriterDied`` once for a
        writer whose process ended without closing it, after its published rows were committed (or at once when
        some can never be until new writers come, saying how many wait); a ``RowsWaiting`` warning for rows that
        wait for lanes whose writers ended (:mod:`gpubuf.replay.feeds.writer_hub`). Rows still queued by writers are in
        no checkpoint: call this before ``save``/``state_dict``."""
        return 0 if self._hub is None else self._hub.collect(wait=True)
