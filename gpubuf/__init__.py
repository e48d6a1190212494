"""gpubuf: GPU-resident history and replay buffers for reinforcement learning.

The package is layered; each layer imports only the ones before it:
``gpubuf._core`` (input checks, staging, state, checkpoints, signals, locks, copies, host memory, device names,
``Transition``) <-
``gpubuf.ops`` (one module per kernel family; the Triton kernels live in ``gpubuf.kernels``) <-
``gpubuf.replay`` and ``gpubuf.history`` (the buffers) <- ``gpubuf.sources`` and ``gpubuf.planning`` <-
``gpubuf.apps`` (MBRL, demo, CLI, benchmarking).

``import gpubuf`` loads the core only: the buffers, their samplers and storages, the device ops and the checkpoints.
The rest loads on first use, by name: the sources (``EnvPoolSource``, ``VectorEnvSource``, ``TensorSource``,
``Step``, ``StepStager``), planning (``Planner``, ``CEMSolver``, ``PlanConfig``) and the sharded buffer
(``ShardedBuffer``). Every module path of the flat layout of earlier releases (``gpubuf.envpool``,
``gpubuf.distributed``, ``gpubuf.prioritized``, ``gpubuf.copies``, ...) imports the module that now holds it, so
their imports and their pickles of buffers still load.
"""

import importlib
import importlib.abc
import importlib.util
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from gpubuf._core.checkpoint import CheckpointError
from gpubuf._core.transition import Transition
from gpubuf.history import HistoryBuffer
from gpubuf.replay import GraphSampler, PrioritizedTransitionBuffer, RateLimiter, TransitionBuffer

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers and go-to-definition
    from gpubuf.planning import CEMSolver, PlanConfig, Planner
    from gpubuf.replay.sharded import ShardedBuffer
    from gpubuf.sources.envpool import EnvPoolSource, Step, StepStager
    from gpubuf.sources.tensors import TensorSource
    from gpubuf.sources.vector_env import VectorEnvSource

# public name -> the module that defines it, imported on first access
_LAZY = {
    "CEMSolver": "gpubuf.planning", "PlanConfig": "gpubuf.planning", "Planner": "gpubuf.planning",
    "EnvPoolSource": "gpubuf.sources.envpool", "Step": "gpubuf.sources.envpool",
    "StepStager": "gpubuf.sources.envpool", "ShardedBuffer": "gpubuf.replay.sharded",
    "VectorEnvSource": "gpubuf.sources.vector_env", "TensorSource": "gpubuf.sources.tensors",
}
# earlier module paths -> the modules that hold them now
_MOVED = {
    **{f"gpubuf.{m}": f"gpubuf._core.{m}"
       for m in ("checkpoint", "concurrency", "copies", "inputs", "staging", "state", "transition")},
    **{f"gpubuf.{m}": f"gpubuf.replay.{m}" for m in ("episode_marks", "prioritized", "ring", "samplers",
                                                     "steady_insert", "storage", "storage_dir", "tiers")},
    **{f"gpubuf.{m}": f"gpubuf.apps.{m}" for m in ("benchmarking", "cli", "demo", "mbrl")},
    **{f"gpubuf.{m}": f"gpubuf.sources.{m}" for m in ("envpool", "wrappers")},
    # renamed as they moved
    "gpubuf.distributed": "gpubuf.replay.sharded", "gpubuf.graph_sampling": "gpubuf.replay.graph_sampler",
    "gpubuf.interrupts": "gpubuf._core.signals", "gpubuf.prefix_tree": "gpubuf.replay.tree",
    "gpubuf.replay_config": "gpubuf.replay.config", "gpubuf.stacked_sampling": "gpubuf.replay.stacked",
}

# submodules reachable as attributes (``gpubuf.planning``) after ``import gpubuf`` alone
_LAZY_MODULES = ("apps", "planning", "sources") + tuple(name.split(".")[1] for name in _MOVED)


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an earlier module path (``import gpubuf.envpool``) as the module that holds it now: both
    names are the same module object, whose spec stays its own."""

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in _MOVED else None

    def create_module(self, spec):
        module = importlib.import_module(_MOVED[spec.name])
        self.specs = getattr(self, "specs", {})
        self.specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module):
        module.__spec__ = self.specs.pop(module.__spec__.name, module.__spec__)  # the real module's spec

    def get_code(self, fullname):
        """The code of the module that holds an earlier path, for ``python -m gpubuf.cli`` (runpy)."""
        spec = importlib.util.find_spec(_MOVED[fullname])
        return spec.loader.get_code(spec.name)


sys.meta_path.append(_MovedModules())

__all__ = [
    "CEMSolver", "CheckpointError", "EnvPoolSource", "GraphSampler", "HistoryBuffer", "PlanConfig",
    "Planner",
    "PrioritizedTransitionBuffer", "RateLimiter", "ShardedBuffer", "Step", "StepStager", "Transition",
    "TensorSource", "TransitionBuffer", "VectorEnvSource",
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
        module = importlib.import_module(f"{__name__}.{name}")
        globals()[name] = module  # an earlier path is bound by hand: its import binds the new one
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_LAZY_MODULES))
