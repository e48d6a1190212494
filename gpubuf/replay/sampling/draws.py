"""The two draw rules every sampler, selector and shard shares.

- :func:`proportional_draw`: picks by uniforms over a mass vector, in proportion to the masses (a selector's
  recency or uniform masses, a group's shard masses); never an entry of zero mass.
- :class:`MassSetAside`: some leaves of a prefix-sum tree zeroed for draws and restored afterwards, whatever happens
  (a draw without replacement between its rounds; a queue's or a shard requester's starts taken already).
"""

import torch

from gpubuf._core.signals import signals_held


def proportional_draw(mass: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(picks (K,) int64, total (1,) float64)``: index ``i`` with probability ``mass_i / total`` per uniform of ``u``
    (K,) in [0, 1), ``mass`` (N,) float64 on ``u``'s device; never past the last index of positive mass."""
    c = torch.cumsum(mass, 0)
    total = c[-1:]
    idx = torch.searchsorted(c, u * total, right=True)
    last = torch.searchsorted(c, total, right=False)  # the last index of positive mass
    return torch.minimum(idx, last), total


class MassSetAside:
    """``with MassSetAside(tree, starts) as aside:``: the leaves ``starts`` (K,) int64 (distinct; ``None``: none yet)
    of ``tree`` hold mass 0 inside the block, and :meth:`add` zeroes more; on leaving, every leaf set aside gets its
    mass back and its parents are recomputed, whatever happens. Signals are held inside, so no handler runs while
    the tree is not whole."""

    def __init__(self, tree, starts: torch.Tensor | None = None):
        self.tree, self._starts = tree, starts
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._signals = signals_held()

    def __enter__(self) -> "MassSetAside":
        self._signals.__enter__()
        try:
            if self._starts is not None and self._starts.numel():
                self.add(self._starts)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def add(self, starts: torch.Tensor, masses: torch.Tensor | None = None) -> None:
        """Zero the leaves ``starts`` (K,) int64, none set aside already (``masses``: their masses, else read here)."""
        saved = self.tree.leaves(starts) if masses is None else masses
        self._saved.append((starts, saved))  # first: restoring a leaf not zeroed yet is harmless
        self.tree.update(starts, torch.zeros_like(saved))

    def __exit__(self, kind, error, trace) -> None:
        try:
            if self._saved:
                starts, saved = zip(*self._saved, strict=True)
                self.tree.update(torch.cat(starts), torch.cat(saved))
        finally:
            self._signals.__exit__(kind, error, trace)
