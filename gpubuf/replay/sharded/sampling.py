"""Sampling from the union of the shards: each request's shard drawn from the global masses, its start drawn by
the owner's own tree with the requester's uniforms (:mod:`gpubuf.replay.sharded.buffer` describes the exchanges
and the global indices)."""

import numpy as np
import torch

from gpubuf._core.inputs import check_bool, generator_for, int_seed, is_int
from gpubuf.replay.buffer import BOUNDARIES
from gpubuf.replay.sampling.draws import proportional_draw
from gpubuf.replay.sharded.transport import ARG_ERRORS, ShardTransport
from gpubuf.replay.sharded.windows import WindowPacker, bytes_as


class ShardSampler:
    """Draws each rank's batch from the shards of ``transport``'s group (``local``: this rank's)."""

    def __init__(self, local, transport: ShardTransport, packer: WindowPacker):
        self.local, self.transport, self.packer = local, transport, packer
        self.config, self.sampler = local.config, local.sampler
        self.prioritized, self.shard_size = self.sampler.prioritized, local.max_size

    def generator(self, key) -> torch.Generator:
        """The requester's generator: an int ``key`` is mixed with the rank, so ranks given one key draw apart."""
        if is_int(key):
            seed = np.random.SeedSequence([int_seed("key", key) % 2**64, self.transport.rank]).generate_state(
                1, np.uint64)[0]
            g = torch.Generator()
            g.manual_seed(int(seed))
            return g
        return generator_for(key, self.local.generator)

    def _shard_mass(self, kind: int) -> torch.Tensor:
        """1-element float64: this shard's total sampling mass for ``kind`` (the ``is_last`` rows excluded)."""
        if not self.prioritized:  # one per valid start
            return torch.tensor([float(self.sampler.count_valid(kind))], dtype=torch.float64,
                                device=self.transport.device)
        return self.sampler.total(kind).view(1).to(self.transport.device)

    @staticmethod
    def _owners(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """(k,) int64 shards drawn by uniforms ``u`` (k,) in proportion to ``weights`` (W,) float64 (host)."""
        return proportional_draw(weights.to(u.device), u)[0]

    def _uniforms(self, gen: torch.Generator, n: int) -> torch.Tensor:
        return torch.rand(n, dtype=torch.float64, generator=gen, device=gen.device).to(self.transport.device)

    def sample(self, key, with_replacement: bool, batch_size, with_next_obs: bool, boundaries: str,
               return_indices: bool, error: Exception | None = None):
        """:meth:`ShardedBuffer.sample <gpubuf.replay.sharded.buffer.ShardedBuffer.sample>` (``with_replacement`` and
        ``return_indices`` resolved; ``error``: this rank's refusal of an argument, raised on every rank with its
        own argument errors)."""
        B, kind, which, gen = 0, 0, -1, None
        if error is None:
            try:
                with_replacement = check_bool("with_replacement", with_replacement)
                B, kind = self.config.batch_size(batch_size), self.config.kind(with_next_obs, boundaries)
                which, gen = BOUNDARIES.index(boundaries), self.generator(key)
            except ARG_ERRORS as err:
                error = err
        batch = self._draw(B, kind, which, error, gen, with_replacement, with_next_obs, boundaries)
        return batch if return_indices or not self.prioritized else batch[0]

    def _draw(self, B, kind, which, error, gen, with_replacement, with_next_obs, boundaries):
        """:meth:`sample` once its arguments are read (``which``: the index of ``boundaries``)."""
        t = self.transport
        mass = self._shard_mass(kind) if error is None else torch.zeros(1, dtype=torch.float64, device=t.device)
        head = torch.tensor([self.sampler.count_valid(kind) if error is None else 0, B, bool(with_replacement),
                             bool(with_next_obs), error is not None, which], dtype=torch.float64, device=t.device)
        info = t.all_gather(torch.cat([mass, head])).cpu()
        masses, counts, sizes = info[:, 0], info[:, 1].long(), info[:, 2].long().tolist()
        t.fail("sample", torch.nonzero(info[:, 5]).view(-1).tolist(), error)
        for col, name, show in ((3, "with_replacement", bool), (4, "with_next_obs", bool),
                                (6, "boundaries", lambda v: BOUNDARIES[int(v)])):
            if not bool((info[:, col] == info[0, col]).all()):
                raise ValueError(f"{name}: must agree on every rank of the group, got "
                                 f"{[show(v) for v in info[:, col]]} by rank")
        N = int(counts.sum())
        if N == 0:
            raise ValueError("sample: no valid sequence start in any shard yet")
        n_steps = self.config.n_steps
        if sum(sizes) * (n_steps + 1) >= 2**31:
            raise ValueError("batch_size: expected fewer than 2**31 window rows per call over the group, got "
                             f"{sizes} windows of {n_steps} rows by rank")
        if with_replacement:
            batch, local_idx, owner, drawn = self._with_replacement(kind, B, max(sizes), gen, masses, with_next_obs)
        else:
            if B > N:
                raise ValueError(f"batch_size: {B} exceeds the {N} valid starts of the group, which sampling "
                                 "without replacement needs")
            t.fail("sample", [r for r, b in enumerate(sizes) if b > N], None)
            batch, local_idx, owner, drawn = self._without_replacement(kind, B, gen, masses, counts, with_next_obs)
        batch = self.config.with_flags(batch, boundaries, self.local.device)
        if not self.prioritized:
            return batch
        self.sampler.weigh(batch, drawn.to(self.local.device))  # the plans' weigh stage
        return batch, (owner * self.shard_size + local_idx).to(self.local.device)

    def _with_replacement(self, kind, B, width, gen, masses, with_next_obs):
        """Uniforms to the owners (one exchange padded to ``width``, the largest batch); rows back."""
        u = self._uniforms(gen, 2 * B)
        owner = self._owners(masses, u[:B])
        got, route = self.transport.route(owner, u[B:], width=width)
        n, head = got.shape[0], []
        if n:
            idx, mass = self.sampler.descend(kind, got.to(self.local.device))  # with the requesters' uniforms
            if self.prioritized:
                head = [idx.view(torch.uint8).view(n, 8), mass.view(torch.uint8).view(n, 8)]
        else:
            idx = torch.empty(0, dtype=torch.int64, device=self.local.device)
            if self.prioritized:
                head = [torch.empty((0, 16), dtype=torch.uint8, device=self.local.device)]
        rows = self.transport.reply(self.packer.pack(idx, head, with_next_obs), route)
        if not self.prioritized:
            return self.packer.unpack(rows, 0, with_next_obs), None, owner, None
        local_idx = bytes_as(rows[:, :8], torch.int64).view(B)
        drawn = bytes_as(rows[:, 8:16], torch.float64).view(B)
        return self.packer.unpack(rows, 16, with_next_obs), local_idx, owner, drawn

    def _without_replacement(self, kind, B, gen, masses, counts, with_next_obs):
        """Rounds of draws (see :meth:`ShardedBuffer.sample <gpubuf.replay.sharded.buffer.ShardedBuffer.sample>`), then
        one exchange fetching the windows of the chosen starts."""
        t, S = self.transport, self.shard_size
        W, dev = t.world_size, t.device
        chosen = torch.empty(0, dtype=torch.int64, device=dev)  # global starts, in order of first appearance
        drawn = torch.empty(0, dtype=torch.float64, device=dev)  # their masses
        spent = torch.zeros(W, dtype=torch.float64)  # host: mass drawn from each shard
        taken = torch.zeros(W, dtype=torch.int64)  # host: starts drawn from each shard
        need = B
        while True:
            k = max(2 * need, 16) if need else 0
            # remaining mass per shard; an exhausted shard (all its valid starts drawn) exactly 0, and rounding
            # never zeroes one that still has starts
            left = torch.where(taken < counts, torch.maximum(masses - spent, masses * 2**-52), 0.0)
            u = self._uniforms(gen, 2 * k)
            owner = self._owners(left, u[:k]) if k else torch.empty(0, dtype=torch.int64, device=dev)
            draws = torch.bincount(owner, minlength=W).cpu()
            # to each owner drawn from: the starts this rank already drew there, then the uniforms of the draws
            excluded = torch.where(draws > 0, taken, 0)
            plan = t.all_gather(torch.stack([excluded, draws, taken], 1).to(dev)).cpu()  # (requester, owner, 3)
            if not bool(plan[:, :, 1].any()):
                break
            t_order = torch.argsort(chosen.div(S, rounding_mode="floor"), stable=True)
            d_order = torch.argsort(owner, stable=True)
            old = torch.split((chosen[t_order] % S).double(), taken.tolist())
            new = torch.split(u[k:][d_order], draws.tolist())
            payload = torch.cat([torch.cat([o[:e], n]) for o, e, n in zip(old, excluded.tolist(), new, strict=True)])
            send, recv = (excluded + draws).tolist(), plan[:, t.rank, :2].sum(1).tolist()
            got = t.all_to_all(payload, send, recv)
            found = self._serve_round(kind, got, plan[:, t.rank, 0].tolist(), plan[:, t.rank, 1].tolist())
            back = t.all_to_all(found, plan[:, t.rank, 1].tolist(), draws.tolist())
            res = torch.empty_like(back)
            res[d_order] = back
            g = owner * S + res[:, 0].long()
            uniq, inv = torch.unique(g, return_inverse=True)  # keep first appearances, in order
            first_seen = torch.full_like(uniq, g.numel()).scatter_reduce_(
                0, inv, torch.arange(g.numel(), device=dev), "amin")
            keep = first_seen.sort().values[:need]
            chosen, drawn = torch.cat([chosen, g[keep]]), torch.cat([drawn, res[keep, 1]])
            spent.index_add_(0, owner[keep].cpu(), res[keep, 1].cpu())
            taken += torch.bincount(owner[keep].cpu(), minlength=W)
            need -= keep.numel()
        owner, local_idx = chosen.div(S, rounding_mode="floor"), chosen % S
        got, route = t.route(owner, local_idx, recv=plan[:, t.rank, 2].tolist())  # counts known to all
        rows = t.reply(self.packer.pack(got.to(self.local.device), [], with_next_obs), route)
        return self.packer.unpack(rows, 0, with_next_obs), local_idx, owner, drawn

    def _serve_round(self, kind: int, got: torch.Tensor, n_taken: list[int], n_draws: list[int]) -> torch.Tensor:
        """Owner side of a round: ``got`` holds per requester its already-drawn local starts and its uniforms
        (float64); returns ``(sum(n_draws), 2)`` float64 ``(local start, mass)`` per draw, in the same order."""
        got = got.to(self.local.device)
        out, at = [], 0
        for t, k in zip(n_taken, n_draws, strict=True):
            old, u = got[at:at + t].long(), got[at + t:at + t + k]
            at += t + k
            if k:  # the requester's starts drawn before are set aside for its draws
                idx, mass = self.sampler.descend_excluding(kind, old, u) if t else self.sampler.descend(kind, u)
                out.append(torch.stack([idx.double(), mass], 1))
        if not out:
            return torch.empty((0, 2), dtype=torch.float64, device=self.transport.device)
        return torch.cat(out).to(self.transport.device)
