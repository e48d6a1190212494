"""Holding asynchronous signals while a buffer commits a write, so that a write is all or nothing.

Python runs a signal handler (``KeyboardInterrupt`` on Ctrl-C, a timeout's ``SIGALRM``) in the main thread
between any two bytecodes; one arriving between the copies of a commit would leave a write half-done.
Inside :func:`signals_held` the Python handlers of those signals are swapped for one that only records
them; the originals run, in arrival order, when the block exits.
"""

import contextlib
import signal
import threading

HELD = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGALRM", "SIGVTALRM", "SIGPROF", "SIGHUP",
                                                 "SIGUSR1", "SIGUSR2") if hasattr(signal, name))


@contextlib.contextmanager
def signals_held():
    """Delay the Python handlers of Ctrl-C, termination, timer and user signals until the block exits.

    Only the main thread runs Python signal handlers, so elsewhere this does nothing (nothing can
    interrupt). Signals left to the OS's default action (``SIG_DFL``) are not Python handlers: they still
    end the process at once, as they would anyway."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: h for s in HELD if callable(h := signal.getsignal(s))}
    pending = []
    for s in saved:
        signal.signal(s, lambda signum, frame: pending.append((signum, frame)))
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
        for signum, frame in pending:
            saved[signum](signum, frame)
