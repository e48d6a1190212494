"""The sharded buffer: one replay buffer split over the ranks of a ``torch.distributed`` group (``buffer``), its
global draw (``sampling``, ``priorities``, ``windows``) and the collectives it runs on (``transport``). Loaded when
used (``gpubuf.ShardedBuffer``), not by ``import gpubuf``."""

from gpubuf.replay.sharded.buffer import ShardedBuffer

__all__ = ["ShardedBuffer"]
