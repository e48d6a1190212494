"""gpubuf's draws inside torchrl's replay buffers (needs ``torchrl``: ``pip install gpubuf[torchrl]``).

``PrioritizedSampler``: a drop-in for ``torchrl.data.PrioritizedSampler`` (same arguments, same call sequence,
same ``"priority_weight"``) whose segment trees are gpubuf's prefix-sum tree (:mod:`gpubuf.torchrl.prioritized`).
Importing this package imports torchrl; ``import gpubuf`` does not.
"""

from gpubuf.torchrl.prioritized import PrioritizedSampler

__all__ = ["PrioritizedSampler"]
