"""One re-entrant lock per buffer: every public call runs whole, between any two others.

An actor thread inserting while a learner thread samples and updates priorities is the usual split
of a training loop. Each buffer (and what composes one: an env source, a graph sampler, the local
side of a sharded buffer) owns a :class:`CallGuard`; its public methods are :func:`locked`, so a
call sees the buffer as it was before or after each other call, never between. The lock is
re-entrant (a method may call another; a signal handler run at the end of a write may call the
buffer) and public as ``buffer.lock``: hold it to make several calls one step
(``with buf.lock: batch, idx = buf.sample(); buf.update_priorities(idx, td)``).

CUDA streams: calls from threads on different streams are ordered on the device as they were on
the host. A call on a stream other than the previous call's makes its stream wait for everything
queued so far on that one (``Stream.wait_stream``), so a sample never reads rows an insert has
queued but not finished, and an insert never overwrites rows a queued sample still reads. Calls on
one stream pay nothing for it. A captured CUDA graph replays outside any call: replay it holding
``buffer.lock`` when other threads use the buffer.

Fork: a process forked while another thread is inside a call would inherit a half-made write and
a lock nobody releases. Before a fork, the forking thread takes every guard's lock (sources before
buffers, the order calls nest in), so the child starts between calls; both processes release them
after the fork.
"""

import functools
import os
import threading
import weakref

import torch

# guards by level: 0 = sources (a source's call enters its buffers' calls), 1 = buffers
_GUARDS: tuple[weakref.WeakSet, weakref.WeakSet] = (weakref.WeakSet(), weakref.WeakSet())
_HELD_FOR_FORK: list = []


class CallGuard:
    """The lock of one object's calls and, on CUDA, the stream its last call ran on.

    ``level``: 0 for an object whose calls enter other guarded objects' calls (an env source),
    1 for a buffer."""

    __slots__ = ("lock", "device", "cuda", "stream", "__weakref__")

    def __init__(self, device: torch.device, level: int = 1):
        self.lock = threading.RLock()
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = None  # the stream of the last call (CUDA only)
        _GUARDS[level].add(self)

    def order_streams(self) -> None:
        """Make the current stream wait for the last call's stream when they differ (not while a
        CUDA graph is captured: a graph's order is its capture's)."""
        if torch.cuda.is_current_stream_capturing():
            return
        stream = torch.cuda.current_stream(self.device)
        last = self.stream
        if last is not None and last != stream:
            stream.wait_stream(last)
        self.stream = stream


def locked(method):
    """``method`` run holding its object's ``_guard`` (re-entrant; on CUDA, streams ordered)."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        guard = self._guard
        lock = guard.lock
        lock.acquire()  # (cheaper than ``with``: this runs on every call of a steady-state path)
        try:
            if guard.cuda:
                guard.order_streams()
            return method(self, *args, **kwargs)
        finally:
            lock.release()

    return call


def _before_fork() -> None:
    for level in _GUARDS:
        for guard in list(level):
            guard.lock.acquire()
            _HELD_FOR_FORK.append(guard)


def _after_fork() -> None:
    while _HELD_FOR_FORK:
        _HELD_FOR_FORK.pop().lock.release()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork,
                        after_in_child=_after_fork)
