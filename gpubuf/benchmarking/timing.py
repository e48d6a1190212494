"""Interleaved timing: every contender runs in the same process, in rotating order; medians per call."""

import os
import platform
import statistics
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version

import torch


def syncer(device: torch.device) -> Callable[[], None]:
    """A function that waits for the device's queued work (a no-op on CPU)."""
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def median_us(fns: dict, repeats: int, block: int, sync: Callable[[], None]) -> dict:
    """Name -> median microseconds per call of ``fns[name]`` (synced before and after each call).

    Every repeat runs each fn for ``block + 1`` consecutive calls, in an order rotated by one per repeat; the
    first call of each block is not timed, so what a previous contender left in the caches or spinning
    (XLA's thread pools) does not land on the next one. One untimed call of each warms up first (compiles).
    """
    for fn in fns.values():
        fn()
    sync()
    names = list(fns)
    times = {k: [] for k in fns}
    for r in range(repeats):
        for k in names[r % len(names):] + names[:r % len(names)]:
            for i in range(block + 1):
                sync()
                t0 = time.perf_counter()
                fns[k]()
                sync()
                if i:
                    times[k].append((time.perf_counter() - t0) * 1e6)
    return {k: statistics.median(v) for k, v in times.items()}


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
