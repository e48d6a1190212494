"""Holding asynchronous signals while a buffer commits a write, so that a write is all or nothing.

Python runs a signal handler (``KeyboardInterrupt`` on Ctrl-C, a timeout's ``SIGALRM``) in the main
thread between any two bytecodes; one arriving between the copies of a commit would leave a write
half-done. Inside :func:`signals_held` the Python handlers of those signals are swapped for one that
only records them; on exit the original handlers are put back and each recorded signal is raised
again, so every original handler runs once, as it would have. A handler that raises does not stop
the others: the first exception propagates once all have run.
"""

import contextlib
import signal
import threading

# the C functions behind ``signal.signal``/``getsignal``: the same, without the enum wrapping
# (much faster; README, Benchmarks: Host overhead per call)
try:
    import _signal as _raw
except ImportError:  # pragma: no cover - other Python implementations
    _raw = signal

HELD = tuple(int(getattr(signal, name))
             for name in ("SIGINT", "SIGTERM", "SIGALRM", "SIGVTALRM", "SIGPROF",
                          "SIGHUP", "SIGUSR1", "SIGUSR2")
                                                      if hasattr(signal, name))


@contextlib.contextmanager
def signals_held():
    """Delay the Python handlers of Ctrl-C, termination, timer and user signals until the block
    exits.

    Only the main thread runs Python signal handlers, so elsewhere this does nothing (nothing can
    interrupt). Signals left to the OS's default action (``SIG_DFL``) are not Python handlers: they
    still end the process at once, as they would anyway."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: h for s in HELD if callable(h := _raw.getsignal(s))}
    pending: list[int] = []

    def record(signum, frame):
        if signum not in pending:
            pending.append(signum)

    swapped = []
    try:
        # a signal arriving half-way through this loop still finds its handler restored below
        for s in saved:
            # listed first: restoring a handler that was not swapped yet is harmless
            swapped.append(s)
            _raw.signal(s, record)
        yield
    finally:
        for s in swapped:
            _raw.signal(s, saved[s])
        first_err = None
        for signum in pending:  # delivered again: Python runs the original handler at once
            try:
                signal.raise_signal(signum)
            except BaseException as err:  # noqa: B036 - re-raised below, after the others ran
                first_err = first_err or err
        if first_err is not None:
            raise first_err
