"""Signals during writes: a thread sends Ctrl-C at a high rate while the main thread inserts, appends
and flushes. Afterwards every handler the user had is back, every write is whole, and signals held
during a write are delivered exactly once."""

import gc
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from fixtures import index_rows

from gpubuf import HistoryBuffer, PrioritizedTransitionBuffer, Transition, TransitionBuffer

E = 3
# the sender: ``python -c SENDER pid signum``, until killed
SENDER = ("import os, sys, time\n"
          "pid, signum = int(sys.argv[1]), int(sys.argv[2])\n"
          "while True:\n"
          "    os.kill(pid, signum)\n"
          "    time.sleep(0.0002)\n")
HANG_S = 600.0  # a storm that lands too few interrupts in this long is broken, not slow
USER_SIGNALS = [s for s in ("SIGTERM", "SIGALRM", "SIGUSR1", "SIGUSR2", "SIGHUP") if hasattr(signal, s)]


def rows(T: int, start: int) -> Transition:
    return index_rows(T, E, start, int_action=True)


@pytest.fixture
def user_handlers():
    """A counting handler of the user's own on each of the signals a write holds (Ctrl-C keeps
    Python's default, which raises KeyboardInterrupt)."""
    counts = {name: 0 for name in USER_SIGNALS}
    handlers = {}
    for name in USER_SIGNALS:
        def handler(signum, frame, name=name):
            counts[name] += 1
        handlers[name] = handler
    old = {name: signal.signal(getattr(signal, name), h) for name, h in handlers.items()}
    old_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield handlers, counts
    for name, h in old.items():
        signal.signal(getattr(signal, name), h)
    signal.signal(signal.SIGINT, old_int)


def storm(work, landed: int, signum=signal.SIGINT) -> int:
    """Run ``work()`` over and over while another process sends ``signum`` every ~0.2 ms (a
    process: its signals arrive at any instant, not only when it holds the GIL), until the loop
    caught ``landed`` KeyboardInterrupts (interrupts landing anywhere in it) and ran ``work()``
    whole a few times: bounded by progress, not time (a loaded machine only takes longer; the
    caller's asserts fail after ``HANG_S``). Returns how many it caught."""
    gc.collect()  # no finalizer of earlier garbage runs inside the storm
    # a Ctrl-C landing in a finalizer is reported as unraisable, and pytest's report of it may be
    # interrupted in turn: neither says anything about the buffers, so both are dropped here
    hook, sys.unraisablehook = sys.unraisablehook, lambda unraisable: None
    sender = subprocess.Popen([sys.executable, "-c", SENDER, str(os.getpid()), str(int(signum))])
    caught, runs, end, stopped = 0, 0, time.monotonic() + HANG_S, False
    while True:  # any line here may be interrupted: each step is safe to run again
        try:
            while (caught < landed or runs < 5) and time.monotonic() < end:
                try:
                    work()
                    runs += 1
                except KeyboardInterrupt:
                    caught += 1
            if not stopped:
                sender.kill()
                stopped = True
            sender.wait(30)
            time.sleep(0.05)  # the last signals in flight
            break
        except KeyboardInterrupt:
            caught += 1
    sys.unraisablehook = hook
    return caught


def assert_handlers_back(handlers) -> None:
    for name, h in handlers.items():
        assert signal.getsignal(getattr(signal, name)) is h, f"{name}'s handler was not put back"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_storm_during_inserts_appends_and_flushes_restores_every_handler(user_handlers,
                                                                                tmp_path):
    handlers, _ = user_handlers
    per = PrioritizedTransitionBuffer(32 * E, 4, rows(1, 0), n_steps=2, device="cpu", seed=0)
    on_disk = TransitionBuffer(16 * E, 4, rows(1, 0), device="cpu", storage_dir=tmp_path / "d")
    hist = HistoryBuffer(E, 8, device="cpu")
    step = [0]

    def work():
        s = step[0]
        step[0] += 1
        per.insert(rows(1, s))
        on_disk.insert(rows(1, s))
        hist.append({"obs": np.full((E, 1), s, np.float32)})
        if s % 25 == 0:
            on_disk.flush()

    caught = storm(work, 20)
    assert caught >= 20  # the storm did land
    assert_handlers_back(handlers)
    for buf in (per, on_disk):  # every row held is whole: its leaves agree
        data = buf.state_dict()["data"]
        held = torch.from_numpy(buf.sampling_mass().numpy() > 0)
        r = data["reward"].reshape(-1)
        assert torch.equal(data["observation"].reshape(-1, 2)[:, 0], r)
        assert torch.equal(data["action"].reshape(-1).float(), r)
        assert held.any()
    fresh = type(per)(**per.copy_args())
    fresh.load_state_dict(per.state_dict())
    assert torch.equal(fresh.sampling_mass() > 0, per.sampling_mass() > 0)
    got = hist.get(3)["obs"]
    # whole appends (every env at one step), in order (an interrupted step skips its append)
    assert (got == got[:1]).all() and (got.diff(dim=1) > 0).all(), got
    on_disk.close()


def test_held_signals_are_delivered_exactly_once(user_handlers):
    """A user signal sent again and again during writes: each one reaches the user's handler once
    (the sender waits for each delivery before the next, so none is merged with another)."""
    handlers, counts = user_handlers
    buf = TransitionBuffer(32 * E, 4, rows(1, 0), device="cpu", seed=0)
    hist = HistoryBuffer(E, 8, device="cpu")
    stop, sent, errors = threading.Event(), [0], []

    def sender():
        try:
            for _ in range(300):
                want = counts["SIGUSR1"] + 1
                os.kill(os.getpid(), signal.SIGUSR1)
                sent[0] += 1
                deadline = time.monotonic() + 120  # a hang, not a speed
                while counts["SIGUSR1"] < want:
                    assert time.monotonic() < deadline, "a held signal was never delivered"
                    time.sleep(0.0001)
                assert counts["SIGUSR1"] == want, "a held signal was delivered twice"
        except AssertionError as err:
            errors.append(err)
        finally:
            stop.set()

    t = threading.Thread(target=sender, daemon=True)
    t.start()
    s = 0
    while not stop.is_set():
        buf.insert(rows(1, s))
        hist.append({"obs": np.full((E, 1), s, np.float32)})
        s += 1
    t.join(10)
    assert not errors, errors[0]
    assert counts["SIGUSR1"] == sent[0] == 300
    assert_handlers_back(handlers)


def test_an_event_loops_signal_handler_runs_once_per_signal():
    """asyncio's signal handlers read a wakeup fd that each signal writes once when it arrives; a
    signal held during a write is not written there again when it is delivered. The sender waits
    for each signal's handler before the next (so the OS merges none, however loaded the machine)."""
    import asyncio

    buf = TransitionBuffer(256 * E, 4, rows(1, 0), device="cpu", seed=0)
    calls, sent = [0], 200

    async def main():
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR1, lambda: calls.__setitem__(0, calls[0] + 1))
        try:
            def sender():
                for i in range(sent):
                    os.kill(os.getpid(), signal.SIGUSR1)
                    deadline = time.monotonic() + 120  # a hang, not a speed
                    while calls[0] <= i and time.monotonic() < deadline:
                        time.sleep(0.0005)

            t = threading.Thread(target=sender)
            t.start()
            block = rows(250, 0)
            while t.is_alive():
                buf.insert(block)  # long writes: most signals arrive while one is held
                await asyncio.sleep(0)
            t.join()
            await asyncio.sleep(0.2)
        finally:
            loop.remove_signal_handler(signal.SIGUSR1)

    old = signal.getsignal(signal.SIGUSR1)
    try:
        asyncio.run(main())
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert calls[0] == sent, calls  # each once: none lost, none written twice
