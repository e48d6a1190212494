"""The one timing helper of every benchmark (``gpubuf bench``, ``benchmarks/*.py``, the demo's timers).

Contenders run in the same process, interleaved in rotating order, and are reported as medians per call. A clock is
``start() -> stop``, ``stop() -> microseconds`` (or anything a benchmark wants per sample): :func:`wall_clock` (host
wall time, the device synced around the call) or :func:`cuda_event_clock` (device time between two CUDA events).
:func:`interleaved` collects the samples, :func:`median_us` their medians."""

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version

import torch

# start() -> stop; stop() -> one sample (microseconds by default)
Clock = Callable[[], Callable[[], object]]


def syncer(device: torch.device) -> Callable[[], None]:
    """A function that waits for the device's queued work (a no-op on CPU)."""
    return torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)


def wall_clock(sync: torch.device | str | Callable[[], None] | None = None) -> Clock:
    """Host wall time of what runs between ``start()`` and ``stop()``, in microseconds, with ``sync`` (a device's
    :func:`syncer`, or a function) called before the start and before the stop."""
    sync = (lambda: None) if sync is None else sync if callable(sync) else syncer(sync)

    def start():
        sync()
        t0 = time.perf_counter()

        def stop() -> float:
            sync()
            return (time.perf_counter() - t0) * 1e6

        return stop

    return start


def cuda_event_clock() -> Clock:
    """Device time between two CUDA events recorded on the current stream, in microseconds."""

    def start():
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()

        def stop() -> float:
            b.record()
            b.synchronize()
            return a.elapsed_time(b) * 1e3

        return stop

    return start


def interleaved(fns: dict, repeats: int, clock: Clock, block: int = 1, *, skip: int = 1, calls: int = 1,
                warmup: int = 1) -> dict[object, list]:
    """Name -> the samples of ``fns[name]``, each what ``clock`` reads over ``calls`` consecutive calls.

    First ``warmup`` untimed calls of each fn (compiles, builds caches). Then ``repeats`` rounds; every round runs each
    fn in an order rotated by one per round: ``skip`` untimed calls (what a previous contender left in the caches or
    spinning, XLA's thread pools, does not land on the next one), then ``block`` samples."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    names = list(fns)
    samples = {k: [] for k in names}
    for r in range(repeats):
        for k in names[r % len(names):] + names[:r % len(names)]:
            for _ in range(skip):
                fns[k]()
            for _ in range(block):
                stop = clock()
                for _ in range(calls):
                    fns[k]()
                samples[k].append(stop())
    return samples


def median_us(fns: dict, repeats: int, block: int = 1, sync: Callable[[], None] | None = None, *,
              clock: Clock | None = None, skip: int = 1, calls: int = 1, warmup: int = 1) -> dict:
    """Name -> median microseconds per call of ``fns[name]``, timed by :func:`interleaved` with
    ``clock`` (default: :func:`wall_clock` synced by ``sync``). The defaults time every repeat as
    ``block + 1`` consecutive calls, the first untimed, after one untimed call of each fn."""
    samples = interleaved(fns, repeats, clock or wall_clock(sync), block, skip=skip, calls=calls, warmup=warmup)
    return {k: statistics.median(v) / calls for k, v in samples.items()}


def step_variants(fns: dict, repeats: int, device: torch.device, title: str, about: dict, out: str | None) -> dict:
    """Warm each of ``fns`` (variant -> one training step; the first is the baseline) up, time them interleaved
    (medians of ``repeats`` blocks of 5), print each against the baseline under ``title`` and write the result (the
    machine, ``about``, the medians, the speed-ups) to ``out`` as JSON when given; returns the result."""
    for fn in fns.values():  # compiles, warms up
        for _ in range(3):
            fn()
    med = median_us(fns, repeats, 5, syncer(device))
    base = next(iter(med))
    result = {"machine": machine(device), **about, "us": med,
              f"speedup_vs_{base}": {k: med[base] / v for k, v in med.items()}}
    print(f"{title}, median us per step:")
    for k, v in med.items():
        print(f"  {k:14s} {v:9.1f} us   {med[base] / v:5.2f}x {base}")
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    return result


def machine(device: torch.device) -> dict:
    """Where the numbers come from: platform, CPU count, torch threads, device name."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    return {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "device": str(device), "device_name": name}


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo where there is one, else what :mod:`platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def versions(packages) -> dict[str, str | None]:
    """Installed version of each package (None when absent)."""
    out = {}
    for name in packages:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out
