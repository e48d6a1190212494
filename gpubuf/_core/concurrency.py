"""One re-entrant lock per buffer: every public call runs whole, between any two others.

An actor thread inserting while a learner thread samples and updates priorities is the usual split of a training loop.
Each buffer (and what composes one: an env source, a graph sampler, the local side of a sharded buffer) owns a
:class:`CallGuard`; its public methods are :func:`locked`, so a call sees the buffer as it was before or after each
other call, never between. The lock is public as ``buffer.lock``: hold it to make several calls one step
(``with buf.lock: batch = buf.sample(); buf.update_priorities(batch.indices, td)``). It is re-entrant for the library's
own nested calls; a signal handler runs in the middle of whatever the main thread is doing, so one that calls a buffer
while the main thread is inside a call of it gets a ``RuntimeError`` (it would otherwise run between that call's steps).

CUDA streams: calls from threads on different streams are ordered on the device as they were on the host. A call on a
stream other than the previous call's makes its stream wait for everything queued so far on that one
(``Stream.wait_stream``), so a sample never reads rows an insert has queued but not finished, and an insert never
overwrites rows a queued sample still reads. Calls on one stream pay nothing for it. A captured CUDA graph replays
outside any call: replay it holding ``buffer.lock`` when other threads use the buffer. Likewise, calls traced by
``torch.compile`` (a ``GraphSampler``'s) run in the compiled code without the lock: hold ``buffer.lock`` around a
compiled step that other threads race.

Fork: a process forked while another thread is inside a call would inherit a half-made write and a lock nobody releases.
Before a fork, the forking thread takes every guard's lock, all at once (any lock busy: it lets go of the others and
waits for that one, so threads holding several locks in any order cannot deadlock it), so the child starts between
calls; both processes release them after the fork. Should a call of another thread outlast ``FORK_WAIT_S``, the fork
goes ahead with a warning, and the child gets fresh locks."""

import functools
import inspect
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable

import torch

_GUARDS: weakref.WeakSet = weakref.WeakSet()  # every live guard, for the fork hooks
_HELD_FOR_FORK: list = []
FORK_WAIT_S = 10.0  # the longest a fork waits for other threads' calls to end (then warns)


class CallGuard:
    """The lock of one object's calls, how deep the holding thread is in them, and, on CUDA, the
    stream the last call ran on. ``tracing()`` says whether ``torch.compile`` traces the call (its owner's
    backend table answers): traced calls run unlocked, as a replayed graph does."""

    __slots__ = ("lock", "depth", "device", "cuda", "stream", "tracing", "behind", "__weakref__")

    def __init__(self, device: torch.device, tracing: Callable[[], bool]):
        self.tracing = tracing
        self.lock = threading.RLock()
        self.depth = 0  # calls of the holding thread in progress (only the holder changes it)
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = None  # the stream of the last call (CUDA only)
        # once the owner's state may be ahead on its device (a GraphWriter's inserts): the call that brings the host's
        # copy up to date, made first by every outermost locked call that reads the host's copy
        self.behind = None
        _GUARDS.add(self)

    def check_nested(self, name: str, owner) -> None:
        """Raise unless a call arriving while the holding thread is inside another call of ``owner`` comes from the
        library itself (a signal handler's call landing mid-call does not)."""
        if not _called_by_library(3):
            raise RuntimeError(
                f"{name}: called while this thread is inside another call of this "
                f"{type(owner).__name__} (from a signal handler?); a handler may not use a buffer "
                "the interrupted code is using: set a flag in the handler and act on it after the call returns")

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


def _called_by_library(up: int) -> bool:
    """Whether the code ``up`` frames above this function (past torch's wrappers) is gpubuf's."""
    frame = inspect.currentframe()
    for _ in range(up):
        frame = frame.f_back
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not name.startswith(("torch", "functools", "contextlib")):
            return name == "gpubuf" or name.startswith("gpubuf.")
        frame = frame.f_back
    return False


# the wrapper :func:`locked` writes for each method: the method's own parameters, forwarded as
# they are (no ``*args``/``**kwargs`` packing: the wrapper runs on every steady-state call)
_WRAPPER = """
def {name}({params}):
    guard = self._guard
    if guard.tracing():  # traced by torch.compile: the compiled code runs unlocked, as a replayed graph does
        return method({args})
    with guard.lock:
        depth = guard.depth
        try:
            guard.depth = depth + 1
            if depth:
                guard.check_nested({name!r}, self)
            {catch_up}
            if guard.cuda:
                guard.order_streams()
            return method({args})
        finally:
            guard.depth = depth
"""


def locked(method, catch_up: bool = True):
    """``method`` run holding its object's ``_guard`` (on CUDA, streams ordered), through a
    wrapper with the method's own signature; ``catch_up``: an outermost call first runs ``guard.behind`` when set
    (:func:`locked_on_device` is the wrapper of calls that read device state only).

    The lock is re-entrant for the library's own nested calls. A call that arrives while the same thread is inside
    another call of the object from outside the library, which is a signal handler's call landing mid-call, raises
    ``RuntimeError`` instead of running between the interrupted call's steps."""
    params, args, defaults = [], [], {}
    star = False
    for i, p in enumerate(inspect.signature(method).parameters.values()):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            packed = ("*" if p.kind is p.VAR_POSITIONAL else "**") + p.name
            params.append(packed)
            args.append(packed)
            star = star or p.kind is p.VAR_POSITIONAL
            continue
        if p.kind is p.KEYWORD_ONLY and not star:
            params.append("*")
            star = True
        text = p.name
        if p.default is not p.empty:
            defaults[f"_default{i}"] = p.default
            text += f"=_default{i}"
        params.append(text)
        args.append(f"{p.name}={p.name}" if p.kind is p.KEYWORD_ONLY else p.name)
    scope = {"method": method, **defaults}
    catch = "elif guard.behind is not None:\n                guard.behind()" if catch_up else ""
    exec(_WRAPPER.format(name=method.__name__, params=", ".join(params), args=", ".join(args), catch_up=catch), scope)
    return functools.wraps(method)(scope[method.__name__])


def locked_on_device(method):
    """:func:`locked` for a call that reads and writes the device state only (a ``GraphSampler``'s, a
    ``GraphWriter``'s): it does not bring the host's copy up to date first."""
    return locked(method, catch_up=False)


def _take_all(guards: list) -> list:
    """Every guard's lock, all at once, within ``FORK_WAIT_S``: try each without waiting; on one
    that is busy, release those taken and wait for that one (so no order of taking can deadlock
    against a thread holding two). Returns the guards taken (all, or none after the wait)."""
    deadline = time.monotonic() + FORK_WAIT_S
    while True:
        taken = []
        for guard in guards:
            if not guard.lock.acquire(blocking=False):
                break
            taken.append(guard)
        else:
            return taken
        for held in reversed(taken):
            held.lock.release()
        left = deadline - time.monotonic()
        if left <= 0 or not guard.lock.acquire(timeout=left):
            return []
        guard.lock.release()


def _before_fork() -> None:
    guards = list(_GUARDS)
    _HELD_FOR_FORK[:] = _take_all(guards)
    if guards and not _HELD_FOR_FORK:
        warnings.warn(f"fork: a gpubuf buffer was still inside a call of another thread after "
                      f"{FORK_WAIT_S:g} s; the child may see it between two steps of that call "
                      "(fork between calls, or start children before the threads)", stacklevel=2)


def _after_fork_in_parent() -> None:
    while _HELD_FOR_FORK:
        _HELD_FOR_FORK.pop().lock.release()


def _after_fork_in_child() -> None:
    held = {id(g) for g in _HELD_FOR_FORK}
    _after_fork_in_parent()
    for guard in list(_GUARDS):  # a lock another thread held at the fork has no owner here
        if id(guard) not in held:
            guard.lock, guard.depth = threading.RLock(), 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)
