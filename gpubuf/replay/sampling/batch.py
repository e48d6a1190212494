"""Batch: what ``sample()`` returns, for every buffer that samples: a :class:`~gpubuf.Transition` that also says where
its rows came from.

Generations cost nothing unless read: a sample keeps the ring's position at the draw (a few host ints) and the first
read of ``generations`` computes them from it (a few device ops, no read-back), exactly as they were at the draw
whatever was written since.
"""

import torch

from gpubuf._core.transition import Transition
from gpubuf.replay.feeds import write_backs


class Batch(Transition):
    """A sampled batch: the :class:`~gpubuf.Transition` of its leaves (``(B, ...)`` or ``(B, n_steps, ...)``) plus

    - ``indices``: ``(B,)`` int64 on the buffer's device, the windows' flat starts ``row * n_envs + env``
      (:meth:`~gpubuf.TransitionBuffer.locate` maps them to env, ring row and step; a
      :class:`~gpubuf.ShardedBuffer`'s are global, ``rank * max_size + start``, and ``None`` for uniform shards);
    - ``weights``: ``(B,)`` float32 importance weights of a prioritized draw (the ``PER_weights`` field), ``None``
      for a uniform one;
    - ``generations``: ``(B,)`` int64 on the device, each start's generation at the draw: pass it to
      ``update_priorities(..., generations=)`` or ``update_rows(..., generations=)`` so that values for rows
      overwritten since are dropped (``None`` for a :class:`~gpubuf.ShardedBuffer`).

    Iterating yields the set leaf fields as a Transition's does (not these three); ``drawn_at`` keeps the ring's
    position at the draw, from which ``generations`` are computed. ``batch.to(device)`` moves the
    leaves and the indices and keeps the generations.
    """

    indices = None  # a Batch built by hand (Transition's fields only) was not drawn
    # the ring's position at the draw (write_backs.origin: host ints) that generations are computed from; None: none
    drawn_at = None

    @property
    def weights(self):
        """The ``(B,)`` float32 importance weights of a prioritized draw (``PER_weights``), else ``None``."""
        return self.PER_weights

    @property
    def generations(self) -> torch.Tensor | None:
        """``(B,)`` int64 generations of the starts as drawn, on the indices' device (computed on each read)."""
        if self.drawn_at is None:
            return None
        return write_backs.generations_at(self.drawn_at, self.indices)

    def to(self, device, non_blocking: bool = False) -> "Batch":
        """A new Batch with every leaf and the indices on ``device`` (as :meth:`Transition.to`)."""
        indices = None if self.indices is None else self.indices.to(device, non_blocking=non_blocking)
        return Batch.of(super().to(device, non_blocking), indices, self.drawn_at)

    @classmethod
    def of(cls, data: Transition, indices, drawn_at, out=None) -> "Batch":
        """``data`` (a sample's batch) as a Batch of ``indices`` drawn at ring position ``drawn_at``
        (:func:`~gpubuf.replay.feeds.write_backs.origin`; ``None``: no generations). A batch the sample built becomes
        one in place; a caller's ``out`` is returned itself when it is a Batch (its ``indices`` tensor refilled in place
        where it has the same shape), else a new Batch holds its tensors (``out`` stays as it is)."""
        held = None if out is None else getattr(out, "indices", None)
        if data is out and isinstance(held, torch.Tensor) and isinstance(indices, torch.Tensor) \
                and held.shape == indices.shape and held.dtype == indices.dtype and held.device == indices.device:
            indices = held.copy_(indices)  # refilled in place as the leaves are: a kept ``batch.indices`` stays current
        if type(data) is not cls:
            if data is out:
                copy = object.__new__(cls)
                copy.__dict__.update(data.__dict__)
                data = copy
            else:  # built by this sample and seen by no one yet: retyped, not copied (a Batch adds no slots)
                data.__class__ = cls
        data.indices = indices
        data.drawn_at = drawn_at
        return data


Batch.__module__ = "gpubuf"  # pickled batches name gpubuf.Batch, the public name no move breaks
