"""Priority updates of a prioritized :class:`~gpubuf.replay.sharded.buffer.ShardedBuffer`: each update travels to the
shard that owns its global index, and ``max_priority`` stays the same on every rank."""

import math

import torch

from gpubuf._core.inputs import priority_updates
from gpubuf.replay.sharded.transport import ARG_ERRORS, ShardTransport


class PriorityRouter:
    """Routes ``update_priorities`` calls over ``transport``'s group to the shards (``local``: this rank's
    :class:`~gpubuf.PrioritizedTransitionBuffer`, ``max_size`` start slots each)."""

    def __init__(self, local, transport: ShardTransport):
        self.local, self.transport, self.sampler = local, transport, local.sampler
        self.shard_size = local.max_size

    def _check(self, indices, td_errors) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Checked ``(global indices (K,) int64, td_errors (K,) float64, largest new priority or 0)``."""
        idx, td = priority_updates(indices, td_errors)
        idx, td = idx.to(self.transport.device, torch.int64), td.to(self.transport.device, torch.float64)
        if not idx.numel():
            return idx, td, 0.0
        L = self.transport.world_size * self.shard_size
        out = (idx < 0) | (idx >= L)
        if bool(out.any()):
            raise IndexError(f"indices: expected global start indices in [0, {L}) ({self.transport.world_size} "
                             f"shards of {self.shard_size}), got {idx[out][:5].tolist()}")
        top = float(td.to(torch.float32).abs().add_(self.local.eps).max())
        if not math.isfinite(top):
            raise ValueError("td_errors: |td| + eps must be finite (float32), got "
                             f"{td[~torch.isfinite(td.to(torch.float32))][:5].tolist()}")
        self.sampler.check_mass("td_errors, alpha", top)
        return idx, td, top

    def update(self, indices, td_errors) -> None:
        """Set the priorities of global ``indices`` (K,) from ``td_errors`` (K,) on their owners (collective);
        invalid arguments on any rank raise on every rank before anything is written."""
        t, S = self.transport, self.shard_size
        error, top = None, 0.0
        try:
            idx, td, top = self._check(indices, td_errors)
        except ARG_ERRORS as err:
            error = err
            idx = torch.empty(0, dtype=torch.int64, device=t.device)
            td = torch.empty(0, dtype=torch.float64, device=t.device)
        owner = idx.div(S, rounding_mode="floor")
        order = torch.argsort(owner, stable=True)
        send = torch.bincount(owner, minlength=t.world_size)
        head = torch.tensor([error is not None, top], dtype=torch.float64, device=t.device)
        plan = t.all_gather(torch.cat([send.double(), head])).cpu()  # (W, W + 2): counts, failed, top
        t.fail("update_priorities", torch.nonzero(plan[:, -2]).view(-1).tolist(), error)
        payload = torch.stack([(idx % S).double(), td], 1)[order]
        got = t.all_to_all(payload, send.tolist(), plan[:, t.rank].long().tolist()).to(self.local.device)
        self.local.update_priorities(got[:, 0].long(), got[:, 1])
        # every rank's max_priority was the same before: the new one is the largest new priority anywhere
        self.sampler.raise_max_priority(float(plan[:, -1].max()))

    def sync_max_priority(self) -> None:
        """Make ``max_priority`` the largest of the group's (collective)."""
        self.sampler.raise_max_priority(self.transport.max(self.local.max_priority))
