"""gpubuf: GPU-resident history and replay buffers for reinforcement learning.

Everything a user needs is a name of this package (``gpubuf.__all__``): the buffers, what they sample (``Unit``,
``Batch``), the samplers and selectors, offline-to-online batches (``OfflineToOnline``), writers and the rate limiter,
the sources, the planner, episodes out and in (``export``, ``datasets``) and :func:`info`.

The package is layered; each layer imports only the ones before it: ``gpubuf._core`` (input checks, staging, state,
checkpoints, signals, locks, copies, host memory, device names, ``Transition``) <- ``gpubuf.ops`` (one module per kernel
family; the Triton kernels live in ``gpubuf.kernels``) <- ``gpubuf.replay`` and ``gpubuf.history`` (the buffers) <-
``gpubuf.sources``, ``gpubuf.planning`` and ``gpubuf.torchrl`` <- ``gpubuf.apps`` (MBRL, demo, CLI, benchmarking, info).

``import gpubuf`` loads the core only: the buffers, their samplers, selectors, writers and storages, the device ops and
the checkpoints. The rest loads on first use, by name: the sources (``EnvPoolSource``, ``VectorEnvSource``,
``TensorSource``, ``Step``, ``StepStager``), planning (``Planner``, ``CEMSolver``, ``PlanConfig``), the sharded buffer
(``ShardedBuffer``), ``export``, ``datasets`` and ``info``. The module paths of the flat layout before 0.2.0
(``gpubuf.envpool``, ``gpubuf.prioritized``, ...) still import, with a ``DeprecationWarning``, until 0.3.0."""

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from gpubuf import _deprecated
from gpubuf._core.checkpoint import CheckpointError
from gpubuf._core.copies import rebuild as _rebuild_buffer  # noqa: F401 (the stable target of every pickled buffer)
from gpubuf._core.transition import Transition
from gpubuf.history import HistoryBuffer
from gpubuf.replay import GraphSampler, PrioritizedTransitionBuffer, RateLimiter, TransitionBuffer
from gpubuf.replay.feeds.process_writers import ReplayWriter, RowsWaiting, WriterDied
from gpubuf.replay.sampling.batch import Batch
from gpubuf.replay.sampling.mixed import MixedBatch, OfflineToOnline
from gpubuf.replay.sampling.selectors import Fifo, Lifo, Mixture, Online, Recency
from gpubuf.replay.sampling.units import Unit

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers and go-to-definition
    from gpubuf.apps.info import info
    from gpubuf.planning import CEMSolver, PlanConfig, Planner
    from gpubuf.replay.feeds import datasets, export
    from gpubuf.replay.sharded.buffer import ShardedBuffer
    from gpubuf.sources.envpool import EnvPoolSource, Step, StepStager
    from gpubuf.sources.tensors import TensorSource
    from gpubuf.sources.vector_env import VectorEnvSource

# public name -> the module that defines it, imported on first access
_LAZY = {"CEMSolver": "gpubuf.planning", "PlanConfig": "gpubuf.planning", "Planner": "gpubuf.planning",
         "EnvPoolSource": "gpubuf.sources.envpool", "Step": "gpubuf.sources.envpool",
         "StepStager": "gpubuf.sources.envpool", "ShardedBuffer": "gpubuf.replay.sharded.buffer",
         "VectorEnvSource": "gpubuf.sources.vector_env", "TensorSource": "gpubuf.sources.tensors",
         "info": "gpubuf.apps.info"}
# public modules: ``gpubuf.export`` (episodes out as Minari datasets and HDF5 files), ``gpubuf.datasets`` (episodes
# in from them), and the subpackages reachable
# as attributes after ``import gpubuf`` alone
_LAZY_MODULES = {"export": "gpubuf.replay.feeds.export", "datasets": "gpubuf.replay.feeds.datasets",
                 **{name: f"gpubuf.{name}" for name in ("apps", "history", "ops", "planning", "replay", "sources")}}

_deprecated.install()

__all__ = ["Batch", "CEMSolver", "CheckpointError", "EnvPoolSource", "Fifo", "GraphSampler", "HistoryBuffer", "Lifo",
           "MixedBatch", "Mixture", "OfflineToOnline", "Online", "PlanConfig", "Planner",
           "PrioritizedTransitionBuffer", "RateLimiter", "Recency", "ReplayWriter", "RowsWaiting", "ShardedBuffer",
           "Step", "StepStager", "TensorSource", "Transition", "TransitionBuffer", "Unit", "VectorEnvSource",
           "WriterDied", "datasets", "export", "info"]
try:
    __version__ = version("gpubuf")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"


def __getattr__(name: str):
    """Import a lazy public name, a public module, or (deprecated) an earlier module path on first use; later
    lookups find it in the globals."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _LAZY_MODULES:
        value = importlib.import_module(_LAZY_MODULES[name])
    elif f"{__name__}.{name}" in _deprecated.MOVED:
        return importlib.import_module(f"{__name__}.{name}")  # warns at its import (not bound: warns each time)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(__all__) | set(_LAZY_MODULES) | {"__version__"})
