"""gpubuf: GPU-resident history and replay buffers for reinforcement learning.

``import gpubuf`` loads the core only: the buffers, their samplers and storages, the device ops and
the checkpoints. The apps around them load on first use, by name: the EnvPool glue
(``EnvPoolSource``, ``Step``, ``StepStager``; :mod:`gpubuf.envpool`), planning
(``Planner``, ``CEMSolver``, ``PlanConfig``; :mod:`gpubuf.planning`), the sharded buffer
(``ShardedBuffer``; :mod:`gpubuf.distributed`) and the modules :mod:`gpubuf.mbrl`,
:mod:`gpubuf.demo`, :mod:`gpubuf.wrappers`, :mod:`gpubuf.benchmarking` and :mod:`gpubuf.cli`.
"""

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from gpubuf.checkpoint import CheckpointError
from gpubuf.graph_sampling import GraphSampler
from gpubuf.history import HistoryBuffer
from gpubuf.prioritized import PrioritizedTransitionBuffer
from gpubuf.replay import TransitionBuffer
from gpubuf.transition import Transition

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers and go-to-definition
    from gpubuf.distributed import ShardedBuffer
    from gpubuf.envpool import EnvPoolSource, Step, StepStager
    from gpubuf.planning import CEMSolver, PlanConfig, Planner

# public name -> the app module that defines it, imported on first access
_LAZY = {
    "CEMSolver": "gpubuf.planning", "PlanConfig": "gpubuf.planning", "Planner": "gpubuf.planning",
    "EnvPoolSource": "gpubuf.envpool", "Step": "gpubuf.envpool", "StepStager": "gpubuf.envpool",
    "ShardedBuffer": "gpubuf.distributed",
}
# app submodules, reachable as attributes (``gpubuf.planning``) after ``import gpubuf`` alone, as
# before
_LAZY_MODULES = ("benchmarking", "cli", "demo", "distributed", "envpool", "mbrl", "planning",
                 "wrappers")

__all__ = [
    "CEMSolver", "CheckpointError", "EnvPoolSource", "GraphSampler", "HistoryBuffer", "PlanConfig",
    "Planner",
    "PrioritizedTransitionBuffer", "ShardedBuffer", "Step", "StepStager", "Transition",
    "TransitionBuffer",
]
try:
    __version__ = version("gpubuf")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"


def __getattr__(name: str):
    """Import an app's public name (or an app module) on first use; later lookups find it in the
    globals."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _LAZY_MODULES:
        # the import binds it as an attribute too
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_LAZY_MODULES))
