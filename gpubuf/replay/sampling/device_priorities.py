"""Priority updates that never read the device: the checks, the write and ``max_priority`` stay on it, so an update runs
without a host synchronisation and can be captured in a CUDA graph or traced whole by ``torch.compile``.

An update is all or nothing, as the checked host path is: when a check of :mod:`gpubuf.ops.priorities` fails (an index
outside ``[0, size)``, a NaN or infinite ``|td| + eps``, an overflowing ``**alpha`` mass), it writes nothing and a flag
records why. The flags reach the host at :meth:`DevicePriorityUpdates.raise_pending`: the buffer calls it wherever it
reads the device anyway (``max_priority``, ``state_dict``, a ``storage_dir`` flush) and ``GraphSampler.check_updates``
calls it on demand; it raises once per batch of failures and clears them.
"""

import weakref

import torch

from gpubuf.ops import BAD_INDEX, NOT_FINITE, OVERFLOW

_WHY = {BAD_INDEX: "indices outside [0, {size})", NOT_FINITE: "td_errors with |td| + eps NaN or infinite",
        OVERFLOW: "td_errors whose priority ** alpha over every start overflows float64"}


class DevicePriorityUpdates:
    """The device state of one prioritized sampler's sync-free updates: ``max`` (() float32, the running maximum
    priority), ``flags`` (() int32, why updates were dropped since the last check), ``dropped`` (() int64, how many)."""

    def __init__(self, sampler, max_priority: float):
        # the sampler holds this object: a weak reference back, so that dropping the buffer frees both at once
        dev, self._sampler, self.size = sampler.device, weakref.ref(sampler), sampler.size
        self.max = torch.full((), max_priority, dtype=torch.float32, device=dev)
        self.flags = torch.zeros((), dtype=torch.int32, device=dev)
        self.dropped = torch.zeros((), dtype=torch.int64, device=dev)

    @property
    def sampler(self):
        """The prioritized sampler these updates write (held weakly: it owns this object)."""
        return self._sampler()

    def apply(self, idx: torch.Tensor, td: torch.Tensor) -> None:
        """Priorities ``|td| + eps`` of flat starts ``idx`` (K,) int64, ``td`` (K,) real, both on the device, K >= 1
        (duplicates keep their largest), or nothing when any value fails a check; device ops only."""
        s = self.sampler
        s.write(idx, td.detach())  # checks first, then priorities, trees and max, or nothing: the code on the device
        code = s.written_code()
        self.flags.bitwise_or_(code)
        self.dropped.add_((code != 0).to(torch.int64))

    def raise_pending(self) -> None:
        """Raise ``ValueError`` (``IndexError`` when only indices failed) naming what the dropped updates held, once
        (one read of the device); nothing when every update since the last check was written."""
        flags, dropped = torch.stack([self.flags.to(torch.int64), self.dropped]).tolist()
        if not flags:
            return
        self.flags.zero_()
        self.dropped.zero_()
        why = "; ".join(w.format(size=self.size) for bit, w in _WHY.items() if flags & bit)
        error = IndexError if flags == BAD_INDEX else ValueError
        raise error(f"update_priorities: {dropped} device-side update(s) since the last check wrote nothing: {why}")
