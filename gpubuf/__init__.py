"""gpubuf: GPU-resident history and replay buffers for reinforcement learning."""

from importlib.metadata import PackageNotFoundError, version

from gpubuf.checkpoint import CheckpointError
from gpubuf.distributed import ShardedBuffer
from gpubuf.envpool import EnvPoolSource, Step, StepStager
from gpubuf.graph_sampling import GraphSampler
from gpubuf.history import HistoryBuffer
from gpubuf.planning import CEMSolver, PlanConfig, Planner
from gpubuf.prioritized import PrioritizedTransitionBuffer
from gpubuf.replay import Transition, TransitionBuffer

__all__ = [
    "CEMSolver", "CheckpointError", "EnvPoolSource", "GraphSampler", "HistoryBuffer", "PlanConfig", "Planner",
    "PrioritizedTransitionBuffer", "ShardedBuffer", "Step", "StepStager", "Transition", "TransitionBuffer",
]
try:
    __version__ = version("gpubuf")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"
