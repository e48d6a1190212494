"""Holding asynchronous signals while a buffer commits a write, so that a write is all or nothing.

Python runs a signal handler (``KeyboardInterrupt`` on Ctrl-C, a timeout's ``SIGALRM``) in the main thread between any
two bytecodes; one arriving between the copies of a commit would leave a write half-done. Inside :func:`signals_held`
the Python handlers of those signals are swapped for one that only records them; on exit the original handlers are put
back and each recorded signal is raised again, so every original handler runs once, as it would have. A handler that
raises does not stop the others: the first exception propagates once all have run.

Putting the handlers back is itself interruptible: ``signal.signal`` first runs the handlers of signals already pending,
and a handler already put back may raise there (Ctrl-C arriving while the handlers are restored). :func:`put_back`
therefore retries until every handler is in place, keeping what such handlers raised for after the restore; the write
was complete by then."""

import signal
import threading

# the C functions behind ``signal.signal``/``getsignal``: the same, without the enum wrapping
# (much faster; README, Benchmarks: Host overhead per call)
try:
    import _signal as _raw
except ImportError:  # pragma: no cover - other Python implementations
    _raw = signal

HELD = tuple(int(getattr(signal, name)) for name in ("SIGINT", "SIGTERM", "SIGALRM", "SIGVTALRM", "SIGPROF", "SIGHUP",
                                                    "SIGUSR1", "SIGUSR2") if hasattr(signal, name))


def put_back(handlers: dict) -> list:
    """Install ``{signum: handler}``; returns what the handlers run meanwhile raised, in order.

    Every handler is installed however often a pending signal's handler raises on the way: an interrupted
    ``signal.signal`` is simply called again (installing a handler twice is harmless)."""
    try:  # the common case: nothing pending meanwhile
        for signum, handler in handlers.items():
            _raw.signal(signum, handler)
        return []
    except BaseException as err:  # noqa: B036 - kept, raised once every handler is back
        raised = [err]
    todo = list(handlers)
    while todo:
        try:
            while todo:
                _raw.signal(todo[-1], handlers[todo[-1]])
                todo.pop()
        except BaseException as err:  # noqa: B036 - kept, raised once every handler is back
            raised.append(err)
    return raised


class signals_held:  # noqa: N801 - used as a function: ``with signals_held():``
    """Delay the Python handlers of Ctrl-C, termination, timer and user signals until the block
    exits; on exit every handler the caller had is back, each signal recorded meanwhile is
    delivered once, and the first exception a handler raised propagates.

    Only the main thread runs Python signal handlers, so elsewhere this does nothing (nothing can
    interrupt). Signals left to the OS's default action (``SIG_DFL``) are not Python handlers: they
    still end the process at once, as they would anyway. Nesting is fine: an inner block records
    into the outer one's recorder. (A class rather than a generator: it runs on every write.)"""

    __slots__ = ("pending", "swapped")

    def _record(self, signum, frame) -> None:
        if signum not in self.pending:
            self.pending.append(signum)

    def __enter__(self):
        self.pending, self.swapped = [], {}
        if threading.get_ident() != threading.main_thread().ident:
            return self
        record, swapped = self._record, self.swapped
        try:
            for s in HELD:
                h = _raw.getsignal(s)
                if callable(h):
                    swapped[s] = h  # listed first: restoring one not swapped yet is harmless
                    _raw.signal(s, record)
        except BaseException:  # a pending signal's handler raised on the way: nothing held
            put_back(swapped)
            raise
        return self

    def __exit__(self, *exc) -> None:
        swapped = self.swapped
        try:  # put_back's common case, inline
            for signum, handler in swapped.items():
                _raw.signal(signum, handler)
            raised = []
        except BaseException as err:  # noqa: B036 - raised once every handler is back
            raised = [err, *put_back(swapped)]
        if self.pending:
            raised += _deliver(self.pending)
        if raised:
            raise raised[0]


def _deliver(pending: list) -> list:
    """Raise each held signal again (Python runs its original handler at once); returns what the handlers raised. A
    wakeup fd (``signal.set_wakeup_fd``: asyncio's signal handlers) got its byte when the signal arrived, so it is
    switched off meanwhile: an event loop wakes once per signal."""
    raised = []
    fd = signal.set_wakeup_fd(-1)
    try:
        for signum in pending:
            try:
                signal.raise_signal(signum)
            except BaseException as err:  # noqa: B036 - re-raised by the caller, after the others
                raised.append(err)
    finally:
        if fd != -1:
            signal.set_wakeup_fd(fd)
    return raised
