"""The collectives of a :class:`~gpubuf.replay.sharded.buffer.ShardedBuffer`: one object per rank that moves tensors
between the ranks of its process group and makes an error on one rank an error on every rank.

Exchanges run on ``device`` (the shard's CUDA device under NCCL, else the host: gloo stages a CUDA shard
through it). Split sizes are read back to the host, one sync per exchange."""

import torch
import torch.distributed as dist

# errors of a call's arguments: caught on the rank that made them, raised on every rank
ARG_ERRORS = (TypeError, ValueError, IndexError)


class ShardTransport:
    """Collectives over ``group`` (``None``: the default group) on ``device``; ``rank``, ``world_size`` in it."""

    def __init__(self, group, device: torch.device):
        self.group, self.device = group, device
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)

    def gather_objects(self, obj) -> list:
        """Every rank's ``obj`` (picklable), in rank order."""
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, obj, group=self.group)
        return everyone

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """``(W, *t.shape)``: every rank's ``t``."""
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.stack(parts)

    def all_to_all(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """Rows ``x`` (n, ...) in destination order, ``send[s]`` of them to rank ``s``; returns the ``sum(recv)``
        rows received, in source order."""
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=self.group)
        return out

    def sum(self, value: int) -> int:
        """``value`` summed over the group."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, group=self.group)
        return int(t.item())

    def max(self, value: float) -> float:
        """The largest ``value`` of the group."""
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return float(t.item())

    def route(self, owner: torch.Tensor, payload: torch.Tensor, recv: list[int] | None = None, width: int = 0):
        """Send row ``i`` of ``payload`` (n, ...) to rank ``owner[i]`` (n,); returns ``(rows received, in source
        order; route for :meth:`reply`)``. ``recv``: how many rows each rank sends here, when every rank knows;
        else ``payload`` is (n,) float64 and ``width`` the largest ``n`` of any rank: each rank sends each other
        one padded block of ``width + 1`` float64 (its count, then its rows), one exchange instead of two."""
        order = torch.argsort(owner, stable=True)
        send_t = torch.bincount(owner, minlength=self.world_size)
        send = send_t.tolist()
        if recv is not None:
            return self.all_to_all(payload[order], send, recv), (order, send, recv)
        dest = owner[order]
        block = payload.new_zeros((self.world_size, width + 1))
        block[:, 0] = send_t
        block[dest, 1 + torch.arange(dest.numel(), device=dest.device)
              - (send_t.cumsum(0) - send_t)[dest]] = payload[order]
        blocks = torch.empty_like(block)
        dist.all_to_all_single(blocks, block, group=self.group)
        counts = blocks[:, 0].long()
        got = blocks[:, 1:][torch.arange(width, device=counts.device) < counts[:, None]]
        return got, (order, send, counts.tolist())

    def reply(self, rows: torch.Tensor, route) -> torch.Tensor:
        """The answer ``rows`` to what :meth:`route` delivered, back on the requesters in their own order."""
        order, send, recv = route
        back = self.all_to_all(rows, recv, send)
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=order.device)
        return back[inv]

    @staticmethod
    def fail(call: str, bad_ranks: list[int], error: Exception | None, what: str = "the arguments") -> None:
        """Raise on every rank once any rank's ``what`` failed: its own error, else a RuntimeError naming them."""
        if error is not None:
            raise error
        if bad_ranks:
            raise RuntimeError(f"{call}: {what} of rank(s) {bad_ranks} failed (see the error raised there); "
                               "every rank of the group stops with it")

    def failed_ranks(self, error: Exception | None) -> list[int]:
        """The ranks whose ``error`` is not None (one ``all_gather``), for :meth:`fail`."""
        failed = self.all_gather(torch.tensor([error is not None], dtype=torch.int64, device=self.device))
        return torch.nonzero(failed.cpu().view(-1)).view(-1).tolist()
