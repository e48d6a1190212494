"""The history ring buffer planners read strided frame histories and action blocks from."""

from gpubuf.history.buffer import HistoryBuffer

__all__ = ["HistoryBuffer"]
