"""gpubuf: GPU-resident history and replay buffers for reinforcement learning."""

from gpubuf.history import HistoryBuffer
from gpubuf.prioritized import PrioritizedTransitionBuffer
from gpubuf.replay import Transition, TransitionBuffer

__all__ = ["HistoryBuffer", "PrioritizedTransitionBuffer", "Transition", "TransitionBuffer"]
__version__ = "0.1.0"
