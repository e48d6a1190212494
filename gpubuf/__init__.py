"""gpubuf: GPU-resident history and replay buffers for reinforcement learning."""

from gpubuf.history import HistoryBuffer

__all__ = ["HistoryBuffer"]
__version__ = "0.1.0"
