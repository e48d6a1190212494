"""One helper registers an op ``torch.ops.gpubuf.<name>`` from its parts.

An op is a schema, a CPU implementation (the torch twin, or an adapter from the schema's argument order to
it), a CUDA implementation (the Triton launcher, :func:`kernel`) and the fake every op shares (ops write
into tensors they are given and return nothing). :class:`Op` holds the three ways a buffer's call can run
and picks one per call (:func:`~gpubuf.ops.device.route`): eager calls go straight to the twin or the
launcher, traced calls through the dispatcher.
"""

import importlib
from collections.abc import Callable

import torch

from gpubuf.ops import host_loops
from gpubuf.ops.device import route, writes_only

_compiling = torch.compiler.is_compiling
OPS: dict[str, "Op"] = {}  # every registered op by name, for the report of what runs where


def kernel(module: str, name: str) -> Callable[..., None]:
    """The launcher ``gpubuf.kernels.<module>.<name>``, imported when it first runs (Triton loads only
    when a kernel runs, so ``import gpubuf`` works without a GPU or driver)."""
    launch = None

    def launcher(*args) -> None:
        nonlocal launch
        if launch is None:
            launch = getattr(importlib.import_module(f"gpubuf.kernels.{module}"), name)
        launch(*args)

    launcher.__name__ = launcher.__qualname__ = f"{module}.{name}"
    return launcher


class Op:
    """``torch.ops.gpubuf.<name>`` registered with ``schema``: CPU runs ``cpu`` (default: ``twin``; ``host_loop``:
    it runs the compiled host loops when enabled), CUDA runs ``launcher``, the fake writes nothing.

    ``op(backend, device, *args)`` runs ``cpu(*args)`` (host tensors) or ``twin(*args)`` (device tensors),
    ``launcher(*args)`` or the dispatcher's op with ``args`` in the schema's order
    (:func:`~gpubuf.ops.device.route` picks by ``backend`` and ``device``); ``twin``, ``cpu`` and ``launcher``
    take the schema's arguments in its order.
    """

    __slots__ = ("dispatch", "host", "host_loop", "launcher", "twin")

    def __init__(self, name: str, schema: str, twin: Callable, launcher: Callable,
                 cpu: Callable | None = None, host_loop: bool = False):
        qualname = f"gpubuf::{name}"
        torch.library.define(qualname, schema)
        torch.library.impl(qualname, "CPU", cpu or twin)
        torch.library.impl(qualname, "CUDA", launcher)
        torch.library.register_fake(qualname, writes_only)
        self.dispatch = getattr(torch.ops.gpubuf, name).default
        self.twin, self.launcher, self.host = twin, launcher, cpu or twin
        self.host_loop = host_loop  # whether ``cpu`` runs the compiled host loops when they are enabled
        OPS[name] = self

    def implementation(self, backend: str, device: torch.device) -> str:
        """What an eager call with ``backend`` on ``device`` runs: ``"triton kernel"``, ``"numba loop"`` or
        ``"torch twin"``."""
        if route(backend, device) == "triton":
            return "triton kernel"
        if device.type == "cpu" and self.host_loop and host_loops.ENABLED:
            return "numba loop"
        return "torch twin"

    def __call__(self, backend: str, device: torch.device, *args) -> None:
        if backend == "torch" and not _compiling():  # what route() answers here, without its call
            (self.host if device.type == "cpu" else self.twin)(*args)
            return
        how = route(backend, device)
        if how == "torch":
            (self.host if device.type == "cpu" else self.twin)(*args)
        elif how == "triton":
            self.launcher(*args)
        else:
            self.dispatch(*args)
