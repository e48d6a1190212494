"""One helper registers an op ``torch.ops.gpubuf.<name>`` from its parts (:class:`Op`): a schema, a CPU implementation
(the torch twin, or an adapter from the schema's argument order to it), a CUDA implementation (the Triton launcher,
:func:`kernel`) and the fake every op shares (ops write into tensors they are given and return nothing). Which part a
buffer's call runs is the backend table's choice (:mod:`gpubuf.ops.backends`), made once per table.
"""

import importlib
from collections.abc import Callable

import torch

from gpubuf.ops.device import writes_only

OPS: dict[str, "Op"] = {}  # every registered op by name, for the report of what runs where


def kernel(module: str, name: str) -> Callable[..., None]:
    """The launcher ``gpubuf.kernels.<module>.<name>``, imported at its first run (``import gpubuf`` needs no GPU)."""
    launch = None

    def launcher(*args) -> None:
        nonlocal launch
        if launch is None:
            launch = getattr(importlib.import_module(f"gpubuf.kernels.{module}"), name)
        launch(*args)

    launcher.__name__ = launcher.__qualname__ = f"{module}.{name}"
    return launcher


def from_lists(fn: Callable) -> Callable:
    """``fn(jobs, *args)`` called in a schema's form ``(storages, outs, shifts, *args)``: the jobs zipped."""

    def call(storages: list, outs: list, shifts: list, *args) -> None:
        fn(list(zip(storages, outs, shifts, strict=True)), *args)

    call.__name__ = call.__qualname__ = f"{fn.__name__}_from_lists"
    return call


class Op:
    """``torch.ops.gpubuf.<name>`` registered with ``schema``: CPU runs ``cpu`` (default: ``twin``; ``host_loop``: it
    runs the compiled host loops when enabled), CUDA runs ``launcher``, the fake writes nothing. The parts a call runs,
    each taking the call's arguments: ``twin``, ``host`` (``cpu``), ``launcher`` and ``traced`` (the dispatcher's op),
    in the schema's order unless ``calls`` gives ``(twin, host, launcher, traced)`` of another call form (a job list,
    say, that the schema splits into lists)."""

    __slots__ = ("dispatch", "host", "host_loop", "launcher", "name", "traced", "twin")

    def __init__(self, name: str, schema: str, twin: Callable, launcher: Callable,
                 cpu: Callable | None = None, host_loop: bool = False, calls: tuple | None = None):
        qualname = f"gpubuf::{name}"
        torch.library.define(qualname, schema)
        torch.library.impl(qualname, "CPU", cpu or twin)
        torch.library.impl(qualname, "CUDA", launcher)
        torch.library.register_fake(qualname, writes_only)
        self.name, self.dispatch = name, getattr(torch.ops.gpubuf, name).default
        self.twin, self.host, self.launcher, self.traced = calls or (twin, cpu or twin, launcher, self.dispatch)
        self.host_loop = host_loop  # whether ``host`` runs the compiled host loops when they are enabled
        OPS[name] = self
