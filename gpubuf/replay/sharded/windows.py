"""Windows of a shard as bytes on the wire: an owner packs each window it serves into one uint8 row (every
returned leaf's raw bytes, after a head of per-window values), the requester unpacks the rows into a batch.

Leaves are packed sorted by output path, so shards whose ``info`` dicts list the same keys in another order
pack the same rows; the batch comes back in the requester's own leaf order."""

import math

import torch

from gpubuf._core.transition import Transition, flatten, unflatten
from gpubuf.replay.sampling.plan import SamplePlan


def bytes_as(columns: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``columns`` (n, k) uint8, a slice of packed rows, as ``dtype`` values: copied into a fresh tensor first
    (``contiguous()`` does not copy a one-row slice, whose stride and offset need not fit ``dtype``)."""
    return torch.empty(columns.shape, dtype=torch.uint8, device=columns.device).copy_(columns).view(dtype)


class WindowPacker:
    """Packs the windows of ``local`` (the rank's own buffer) into rows on ``comm`` (the exchanges' device),
    and unpacks rows from any shard of the same configuration onto ``local``'s device."""

    def __init__(self, local, comm: torch.device):
        self.local, self.config, self.device, self.comm = local, local.config, local.device, comm

    def layout(self, with_next_obs: bool) -> list[tuple]:
        """``(output path, dtype, per-window shape, bytes)`` of every returned leaf, in row order."""
        dtypes = {leaf.path: leaf.dtype for leaf in self.config.leaves}
        return sorted(((d, dtypes[s], shape[1:], math.prod(shape[1:]) * dtypes[s].itemsize)
                       for d, s, _, shape in self.config.jobs(1, with_next_obs)), key=lambda leaf: leaf[0])

    def pack(self, idx: torch.Tensor, head: list[torch.Tensor], with_next_obs: bool) -> torch.Tensor:
        """``(n, R)`` uint8 rows on the exchanges' device: ``head`` (each ``(n, k)`` uint8), then the windows at
        local starts ``idx`` (n,)."""
        n, parts = idx.shape[0], list(head)
        layout = self.layout(with_next_obs)
        if n:
            plan = SamplePlan(self.local.reader, n, with_next_obs, "allow", None)  # fresh windows of these starts
            windows = flatten(plan.read(idx))
            parts += [windows[d].reshape(n, math.prod(shape)).view(torch.uint8) for d, _, shape, _ in layout]
        else:
            parts.append(torch.empty((0, sum(leaf[3] for leaf in layout)), dtype=torch.uint8, device=self.device))
        return torch.cat([p.to(self.device) for p in parts], 1).to(self.comm)

    def unpack(self, rows: torch.Tensor, at: int, with_next_obs: bool) -> Transition:
        """The batch held by ``rows`` (B, R) uint8 from byte ``at`` on, as :meth:`pack` packed it."""
        B, leaves = rows.shape[0], {}
        for d, dtype, shape, nbytes in self.layout(with_next_obs):
            if nbytes:
                t = bytes_as(rows[:, at:at + nbytes], dtype).view((B,) + shape)
            else:
                t = torch.empty((B,) + shape, dtype=dtype, device=rows.device)
            leaves[d] = t.to(self.device)
            at += nbytes
        return unflatten({d: leaves[d] for d, *_ in self.config.jobs(1, with_next_obs)})  # the local leaf order
