"""ShardedBuffer: one replay buffer sharded over the ranks of a ``torch.distributed`` process group.

Every rank holds one shard, its own :class:`~gpubuf.TransitionBuffer` or
:class:`~gpubuf.PrioritizedTransitionBuffer` built with the same configuration (checked collectively
at construction). Inserts stay local. :meth:`ShardedBuffer.sample` is collective: every rank
receives its own batch, drawn from the union of the shards with the exact global probabilities
(uniform over every valid start of every shard, or ``p**alpha / global sum``). Start ``j`` of the
shard on group rank ``r`` has the global index ``r * S + j``, ``S`` = ``max_size`` (the start slots
of one shard).

A sample with replacement, ``W`` ranks, ``B`` windows on this rank (three collectives):

1. ``all_gather`` of every shard's mass (its tree's root total; its valid-start count when uniform),
   valid count and the call's arguments: a bad argument on any rank raises on every rank, so none is
   left waiting.
2. The requester draws two float64 uniforms per window: the first picks the owner shard by inverse
   CDF over the shard masses; the second goes to the owner, in one ``all_to_all`` of padded blocks
   (to each rank: the count, then the uniforms, padded to the largest batch of the group).
3. Each owner descends its own tree with the uniforms it received, gathers the windows and sends
   back one byte row per window (``all_to_all`` with variable splits): every returned leaf as raw
   bytes, plus the local start (int64) and its mass (float64) when prioritized. The requester puts
   the rows back in its own order.

Bytes per window received: ``window_bytes`` (+ 16 when prioritized), where ``window_bytes`` sums
``n_steps * prod(shape) * itemsize`` over the returned leaves (inferred next observations included).
Sent per call: ``8 * W * (B_max + 1)`` bytes of padded uniforms and 48 bytes to every rank in the
first step. Without replacement the starts are drawn first, in rounds (see
:meth:`ShardedBuffer.sample`), then fetched: 8 bytes sent per window (its local start),
``window_bytes`` received.

Collectives run on the shard's device with NCCL (split sizes are read back to the host: one sync per
exchange) and on CPU tensors with gloo (a CUDA shard then stages through the host). Both backends
implement ``all_to_all_single`` with variable splits.
"""

import hashlib
import math
import os
import warnings

import numpy as np
import torch
import torch.distributed as dist

from gpubuf._core.concurrency import locked
from gpubuf._core.copies import refuse_copies
from gpubuf._core.inputs import generator_for, priority_updates
from gpubuf._core.signals import signals_held
from gpubuf._core.transition import Transition, flatten, unflatten
from gpubuf.replay.buffer import BOUNDARIES, TransitionBuffer
from gpubuf.replay.prioritized import PrioritizedTransitionBuffer

_ARG_ERRORS = (TypeError, ValueError, IndexError)


_RANK = "{rank}"


def _config(local: TransitionBuffer) -> dict:
    """What must agree between shards for their union to be one buffer: the local buffers'
    configuration (but the default batch size) and leaves."""
    leaves = {leaf.name: (leaf.shape, str(leaf.dtype)) for leaf in local.config.leaves}
    return {**local.config.as_dict(batch=False), "leaves": leaves}


def _bytes_as(columns: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``columns`` (n, k) uint8, a slice of packed rows, as ``dtype`` values: copied into a fresh
    tensor first (``contiguous()`` does not copy a one-row slice, whose stride and offset need not
    fit ``dtype``)."""
    return torch.empty(columns.shape, dtype=torch.uint8,
                       device=columns.device).copy_(columns).view(dtype)


@refuse_copies("it is bound to a torch.distributed process group; copy its local buffer (local) "
               "and build a ShardedBuffer from the copy in each rank")
class ShardedBuffer:
    """A replay buffer whose shards are the ``local`` buffers of the ranks of ``group`` (``None``:
    the default group). Construction is collective: every rank checks that all shards share class,
    ``max_size``, ``n_envs``, ``n_steps``, leaf shapes and dtypes (and ``alpha``, ``eps``); a
    mismatch raises ``ValueError`` on every rank naming the field.

    Collective methods (every rank of the group must call them, in the same order): :meth:`sample`,
    :meth:`update_priorities`, :meth:`num_valid`, :meth:`load`, :meth:`load_state_dict`. Local ones:
    :meth:`insert`, :meth:`state_dict`, :meth:`save`.

    Threads: every method holds the local buffer's lock (collectives too, while they wait for the
    other ranks), so an actor thread may insert into the local buffer while a learner thread runs
    the collective calls.
    """

    def __init__(self, local: TransitionBuffer, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ShardedBuffer: torch.distributed is not initialized (call "
                               "torch.distributed.init_process_group first)")
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError("group: this process is not a member of the group")
        self.group, self.rank, self.world_size = group, rank, dist.get_world_size(group)
        backend = str(dist.get_backend(group))
        mine: dict = {}
        if not isinstance(local, TransitionBuffer):
            mine["error"] = f"expected a gpubuf TransitionBuffer or PrioritizedTransitionBuffer, " \
                            f"got {type(local).__name__}"
        elif backend == "nccl" and local.device.type != "cuda":
            mine["error"] = f"an NCCL group needs the shard on a CUDA device, got {local.device}"
        else:
            rng = hashlib.sha1(local.generator.get_state().numpy().tobytes()).hexdigest()
            mine.update(config=_config(local), rng=rng)
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=group)
        bad = {r: e["error"] for r, e in enumerate(everyone) if "error" in e}
        if bad:
            raise TypeError("local: " + "; ".join(f"rank {r}: {msg}" for r, msg in bad.items()))
        configs = [e["config"] for e in everyone]
        for field in configs[0]:
            values = [c[field] for c in configs]
            if any(v != values[0] for v in values):
                raise ValueError(f"local: the shards' configurations differ in {field}: "
                                 + ", ".join(f"rank {r} has {v!r}" for r, v in enumerate(values)))
        if self.world_size > 1 and len({e["rng"] for e in everyone}) == 1:
            warnings.warn("ShardedBuffer: every shard's generator is in the same state, so "
                          "sample(key=None) draws the same uniforms on every rank; seed each "
                          "rank's buffer differently (seed=base + rank)",
                          stacklevel=2)
        self.local = local
        self._guard = local.guard  # calls hold the local buffer's lock
        self.prioritized = isinstance(local, PrioritizedTransitionBuffer)
        self.shard_size = local.max_size
        cuda_comm = local.device.type == "cuda" and "nccl" in backend
        self._comm = local.device if cuda_comm else torch.device("cpu")
        if self.prioritized:
            self._sync_max_priority()

    # ------------------------------------------------------------------ local

    @locked
    def insert(self, transition: Transition):
        """Insert into this rank's shard (no communication); returns ``self``."""
        self.local.insert(transition)
        return self

    @property
    def max_priority(self) -> float:
        """The running maximum priority over every shard (kept equal on all ranks)."""
        return self.local.max_priority

    @locked
    def update_beta(self, beta: float):
        """Set this rank's importance-sampling exponent; returns ``self``."""
        self.local.update_beta(beta)
        return self

    # ------------------------------------------------------------------ communication

    def _all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """``(W, *t.shape)``: every rank's ``t``."""
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.stack(parts)

    def _all_to_all(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """Rows ``x`` (n, ...) in destination order, ``send[s]`` of them to rank ``s``; returns the
        ``sum(recv)`` rows received, in source order."""
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=self.group)
        return out

    def _route(self, owner: torch.Tensor, payload: torch.Tensor, recv: list[int] | None = None,
               width: int = 0):
        """Send row ``i`` of ``payload`` (n, ...) to rank ``owner[i]`` (n,); returns ``(rows
        received, in source order; route for :meth:`_reply`)``. ``recv``: how many rows each rank
        sends here, when every rank knows; else ``payload`` is (n,) float64 and ``width`` the
        largest ``n`` of any rank: each rank sends each other one padded block of ``width + 1``
        float64 (its count, then its rows), one exchange instead of two."""
        order = torch.argsort(owner, stable=True)
        send_t = torch.bincount(owner, minlength=self.world_size)
        send = send_t.tolist()
        if recv is not None:
            return self._all_to_all(payload[order], send, recv), (order, send, recv)
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

    def _reply(self, rows: torch.Tensor, route) -> torch.Tensor:
        """The answer ``rows`` to what :meth:`_route` delivered, back on the requesters in their own
        order."""
        order, send, recv = route
        back = self._all_to_all(rows, recv, send)
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=order.device)
        return back[inv]

    def _fail(self, call: str, bad_ranks: list[int], error: Exception | None,
              what: str = "the arguments") -> None:
        """Raise on every rank when any rank's ``what`` failed: the rank's own error, else a
        RuntimeError."""
        if error is not None:
            raise error
        if bad_ranks:
            raise RuntimeError(f"{call}: {what} of rank(s) {bad_ranks} failed (see the error "
                               "raised there); every rank of the group stops with it")

    # ------------------------------------------------------------------ collective queries

    @locked
    def num_valid(self, with_next_obs: bool = False, boundaries: str = "allow") -> int:
        """Valid sequence starts over every shard (collective), as the local ``num_valid`` counts
        them."""
        n = torch.tensor([self.local.num_valid(with_next_obs, boundaries)], dtype=torch.int64,
                         device=self._comm)
        dist.all_reduce(n, group=self.group)
        return int(n.item())

    # ------------------------------------------------------------------ sample

    def _generator(self, key) -> torch.Generator:
        """The requester's generator: an int ``key`` is mixed with the rank, so ranks given one key
        draw apart."""
        if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
            if not -(2**63) <= int(key) < 2**64:
                raise ValueError(f"key: an int seed must lie in [-2**63, 2**64), got {key}")
            seed = np.random.SeedSequence(
                [int(key) % 2**64, self.rank]).generate_state(1, np.uint64)[0]
            g = torch.Generator()
            g.manual_seed(int(seed))
            return g
        return generator_for(key, self.local.generator)

    def _valid(self, kind: int) -> int:
        """This shard's valid starts of ``kind`` (the source's ``is_last`` rows never start one)."""
        return self.local.sampler.count_valid(kind)

    def _shard_mass(self, kind: int) -> torch.Tensor:
        """1-element float64: this shard's total sampling mass for ``kind`` (the ``is_last`` rows
        excluded)."""
        local = self.local
        if not self.prioritized:  # one per valid start
            return torch.tensor([float(self._valid(kind))], dtype=torch.float64, device=self._comm)
        local.sampler.activate(kind)
        return local.sampler.trees[kind].total().view(1).to(self._comm)

    def _owners(self, weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """(k,) int64 shards drawn by uniforms ``u`` (k,) in proportion to ``weights`` (W,) float64
        (host)."""
        cum = weights.cumsum(0).to(u.device)
        # rounding never sends a draw past the last shard with mass
        last = int(torch.nonzero(weights > 0).max())
        return torch.searchsorted(cum, u * cum[-1], right=True).clamp_max_(last)

    def _layout(self, with_next_obs: bool) -> list[tuple]:
        """``(output path, dtype, per-window shape, bytes)`` of every returned leaf, in row order:
        sorted by path, so shards whose ``info`` dicts list the same keys in another order pack the
        same rows."""
        dtypes = {leaf.path: leaf.dtype for leaf in self.local.config.leaves}
        return sorted(((d, dtypes[s], shape[1:], math.prod(shape[1:]) * dtypes[s].itemsize)
                       for d, s, _, shape in self.local.config.jobs(1, with_next_obs)),
                      key=lambda leaf: leaf[0])

    def _window_rows(self, idx: torch.Tensor, head: list[torch.Tensor],
                     with_next_obs: bool) -> torch.Tensor:
        """``(n, R)`` uint8 rows: ``head`` (each ``(n, k)`` uint8), then the windows at local starts
        ``idx`` (n,)."""
        local, n = self.local, idx.shape[0]
        parts = list(head)
        if n:
            jobs = local.storage.check_out(None, local.config.jobs(n, with_next_obs), local.device,
                                           ())
            windows = flatten(local.gather(idx, jobs))
            for d, _, shape, _ in self._layout(with_next_obs):
                parts.append(windows[d].reshape(n, math.prod(shape)).view(torch.uint8))
        else:
            parts.append(torch.empty((0, sum(r[3] for r in self._layout(with_next_obs))),
                                     dtype=torch.uint8, device=local.device))
        return torch.cat([p.to(local.device) for p in parts], 1).to(self._comm)

    def _unpack(self, rows: torch.Tensor, at: int, with_next_obs: bool) -> Transition:
        """The batch held by ``rows`` (B, R) uint8 from byte ``at`` on, as :meth:`_window_rows`
        packed it."""
        B, device, leaves = rows.shape[0], self.local.device, {}
        for d, dtype, shape, nbytes in self._layout(with_next_obs):
            if nbytes:
                t = _bytes_as(rows[:, at:at + nbytes], dtype).view((B,) + shape)
            else:
                t = torch.empty((B,) + shape, dtype=dtype, device=rows.device)
            leaves[d] = t.to(device)
            at += nbytes
        # the local leaf order
        return unflatten({d: leaves[d] for d, *_ in self.local.config.jobs(1, with_next_obs)})

    @torch.compiler.disable  # an opaque call under torch.compile, as the local buffers' sample
    @locked
    def sample(self, key=None, with_replacement: bool | None = None, batch_size: int | None = None,
               with_next_obs: bool = False, boundaries: str = "allow"):
        """A batch of ``B`` windows (collective; each rank gets its own) drawn from the union of the
        shards.

        Returns what the local buffer's ``sample`` does: a :class:`Transition` of ``(B, n_steps,
        ...)`` leaves (``(B, ...)`` when ``n_steps == 1``) when uniform; ``(batch, global_indices
        (B,) int64)`` when prioritized, with ``PER_weights = (N * P_i)**-beta / max over the batch``
        (float32, ``N`` and ``P`` global; computed as ``(P_i / min_batch P)**-beta``).
        ``with_replacement`` defaults to the local default (uniform: ``True``; prioritized:
        ``False``) and, like ``with_next_obs``, must agree on every rank; ``batch_size`` may differ.
        ``key``: ``None`` (the shard's own generator), a ``torch.Generator``, or an int seed, which
        is mixed with the rank. ``boundaries`` (``"allow"``, ``"mask"``, ``"forbid"``; must agree on
        every rank) draws the windows the local ``sample`` would, from every shard, and sets
        ``is_first``/``mask`` as it does; rows of an :class:`~gpubuf.EnvPoolSource` marked
        ``info["is_last"]`` never start a window.

        Without replacement, each rank's batch is exact sequential sampling without replacement from
        the union: rounds of draws with replacement from the shards' remaining masses (mass less
        what this rank already drew there), where each owner zeroes, for that requester only, the
        starts it already drew in its tree, descends and restores them; first appearances are kept
        (one ``all_gather`` of counts and two ``all_to_all`` per round, usually one or two rounds),
        then the windows are fetched. A shard's remaining mass is its total less what was drawn
        there, in float64: when one start's mass exceeds the rest of its shard by about ``2**52``
        (priority ratios no TD error produces in practice), that subtraction loses the rest and the
        shard's share after the big start is drawn is no longer exact; a local buffer has no such
        limit (its trees sum what remains).
        """
        local = self.local
        if with_replacement is None:
            with_replacement = not self.prioritized
        error, B, kind, which, gen = None, 0, 0, -1, None
        try:
            B = self.local.config.batch_size(batch_size)
            kind = local.config.kind(with_next_obs, boundaries)
            which = BOUNDARIES.index(boundaries)
            gen = self._generator(key)
        except _ARG_ERRORS as err:
            error = err
        return self._sample(B, kind, which, error, gen, with_replacement, with_next_obs, boundaries)

    def _sample(self, B, kind, which, error, gen, with_replacement, with_next_obs, boundaries):
        """:meth:`sample` once its arguments are read (``error``: this rank's argument error, raised
        everywhere)."""
        local = self.local
        mass = torch.zeros(1, dtype=torch.float64, device=self._comm)
        if error is None:
            mass = self._shard_mass(kind)
        head = torch.tensor([self._valid(kind) if error is None else 0, B, bool(with_replacement),
                             bool(with_next_obs), error is not None, which], dtype=torch.float64,
                            device=self._comm)
        info = self._all_gather(torch.cat([mass, head])).cpu()
        masses, counts, sizes = info[:, 0], info[:, 1].long(), info[:, 2].long().tolist()
        self._fail("sample", torch.nonzero(info[:, 5]).view(-1).tolist(), error)
        for col, name in ((3, "with_replacement"), (4, "with_next_obs")):
            if not bool((info[:, col] == info[0, col]).all()):
                raise ValueError(f"{name}: must agree on every rank of the group, got "
                                 f"{[bool(v) for v in info[:, col]]} by rank")
        if not bool((info[:, 6] == info[0, 6]).all()):
            raise ValueError(f"boundaries: must agree on every rank of the group, got "
                             f"{[BOUNDARIES[int(v)] for v in info[:, 6]]} by rank")
        N = int(counts.sum())
        if N == 0:
            raise ValueError("sample: no valid sequence start in any shard yet")
        if sum(sizes) * (local.n_steps + 1) >= 2**31:
            raise ValueError("batch_size: expected fewer than 2**31 window rows per call over the "
                             f"group, got {sizes} windows of {local.n_steps} rows by rank")
        if not with_replacement:
            over = [r for r, b in enumerate(sizes) if b > N]
            if B > N:
                raise ValueError(f"batch_size: {B} exceeds the {N} valid starts of the group, "
                                 "which sampling without replacement needs")
            self._fail("sample", over, None)
        if with_replacement:
            batch, local_idx, owner, drawn = self._sample_with_replacement(
                kind, B, max(sizes), gen, masses, with_next_obs)
        else:
            batch, local_idx, owner, drawn = self._sample_without_replacement(
                kind, B, gen, masses, counts, with_next_obs)
        batch = local.config.with_flags(batch, boundaries, local.device)
        if not self.prioritized:
            return batch
        batch.PER_weights = (drawn / drawn.min()).pow_(-local.beta).to(torch.float32).to(
            local.device)
        return batch, (owner * self.shard_size + local_idx).to(local.device)

    def _uniforms(self, gen: torch.Generator, n: int) -> torch.Tensor:
        return torch.rand(n, dtype=torch.float64, generator=gen, device=gen.device).to(self._comm)

    def _sample_with_replacement(self, kind, B, width, gen, masses, with_next_obs):
        """Uniforms to the owners (one padded exchange to ``width``, the largest batch), window rows
        (with start and mass) back."""
        u = self._uniforms(gen, 2 * B)
        owner = self._owners(masses, u[:B])
        got, route = self._route(owner, u[B:], width=width)
        n = got.shape[0]
        head = []
        if n:
            on_local = got.to(self.local.device)
            self.local.sampler.activate(kind)
            tree = self.local.sampler.trees[kind]
            idx = tree.sample(on_local)  # the owner's descent with the requesters' uniforms
            mass = tree.leaves(idx)
            if self.prioritized:
                head = [idx.view(torch.uint8).view(n, 8), mass.view(torch.uint8).view(n, 8)]
        else:
            idx = torch.empty(0, dtype=torch.int64, device=self.local.device)
            if self.prioritized:
                head = [torch.empty((0, 16), dtype=torch.uint8, device=self.local.device)]
        rows = self._reply(self._window_rows(idx, head, with_next_obs), route)
        if not self.prioritized:
            return self._unpack(rows, 0, with_next_obs), None, owner, None
        local_idx = _bytes_as(rows[:, :8], torch.int64).view(B)
        drawn = _bytes_as(rows[:, 8:16], torch.float64).view(B)
        return self._unpack(rows, 16, with_next_obs), local_idx, owner, drawn

    def _sample_without_replacement(self, kind, B, gen, masses, counts, with_next_obs):
        """Rounds of draws (see :meth:`sample`), then one exchange fetching the windows of the
        chosen starts."""
        W, S, dev = self.world_size, self.shard_size, self._comm
        # global starts, in order of first appearance
        chosen = torch.empty(0, dtype=torch.int64, device=dev)
        drawn = torch.empty(0, dtype=torch.float64, device=dev)  # their masses
        spent = torch.zeros(W, dtype=torch.float64)  # host: mass drawn from each shard
        taken = torch.zeros(W, dtype=torch.int64)  # host: starts drawn from each shard
        need = B
        while True:
            k = max(2 * need, 16) if need else 0
            # remaining mass per shard; an exhausted shard (all its valid starts drawn) exactly 0,
            # and rounding never zeroes one that still has starts
            left = torch.where(taken < counts, torch.maximum(masses - spent, masses * 2**-52), 0.0)
            u = self._uniforms(gen, 2 * k)
            owner = (self._owners(left, u[:k]) if k
                     else torch.empty(0, dtype=torch.int64, device=dev))
            draws = torch.bincount(owner, minlength=W).cpu()
            # to each owner drawn from: the starts this rank already drew there, then the uniforms
            # of the draws
            excluded = torch.where(draws > 0, taken, 0)
            # (requester, owner, 3)
            plan = self._all_gather(torch.stack([excluded, draws, taken], 1).to(dev)).cpu()
            if not bool(plan[:, :, 1].any()):
                break
            t_order = torch.argsort(chosen.div(S, rounding_mode="floor"), stable=True)
            d_order = torch.argsort(owner, stable=True)
            old = torch.split((chosen[t_order] % S).double(), taken.tolist())
            new = torch.split(u[k:][d_order], draws.tolist())
            payload = torch.cat([torch.cat([o[:e], n])
                                 for o, e, n in zip(old, excluded.tolist(), new, strict=True)])
            send, recv = (excluded + draws).tolist(), plan[:, self.rank, :2].sum(1).tolist()
            got = self._all_to_all(payload, send, recv)
            found = self._serve_round(kind, got, plan[:, self.rank, 0].tolist(),
                                      plan[:, self.rank, 1].tolist())
            back = self._all_to_all(found, plan[:, self.rank, 1].tolist(), draws.tolist())
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
        owner = chosen.div(S, rounding_mode="floor")
        local_idx = chosen % S
        # counts known to all
        got, route = self._route(owner, local_idx, recv=plan[:, self.rank, 2].tolist())
        rows = self._reply(self._window_rows(got.to(self.local.device), [], with_next_obs), route)
        return self._unpack(rows, 0, with_next_obs), local_idx, owner, drawn

    def _serve_round(self, kind: int, got: torch.Tensor, n_taken: list[int],
                     n_draws: list[int]) -> torch.Tensor:
        """Owner side of a round: ``got`` holds per requester its already-drawn local starts and its
        uniforms (float64); returns ``(sum(n_draws), 2)`` float64 ``(local start, mass)`` per draw,
        in the same order."""
        sampler, device = self.local.sampler, self.local.device
        sampler.activate(kind)
        tree = sampler.trees[kind]
        got = got.to(device)
        out = []
        at = 0
        for t, k in zip(n_taken, n_draws, strict=True):
            old, u = got[at:at + t].long(), got[at + t:at + t + k]
            at += t + k
            if not k:
                continue
            if not t:
                idx = tree.sample(u)
                out.append(torch.stack([idx.double(), tree.leaves(idx)], 1))
                continue
            with signals_held():  # the tree is whole again before any handler runs
                saved = tree.leaves(old)
                try:
                    tree.update(old, torch.zeros_like(saved))
                    idx = tree.sample(u)
                    out.append(torch.stack([idx.double(), tree.leaves(idx)], 1))
                finally:
                    tree.update(old, saved)
        if not out:
            return torch.empty((0, 2), dtype=torch.float64, device=self._comm)
        return torch.cat(out).to(self._comm)

    # ------------------------------------------------------------------ priorities

    def _check_update(self, indices, td_errors) -> tuple[torch.Tensor, torch.Tensor, float]:
        """``(global indices (K,) int64, td_errors (K,) float64, largest new priority or 0)`` on the
        communication device, validated."""
        idx, td = priority_updates(indices, td_errors)
        idx, td = idx.to(self._comm, torch.int64), td.to(self._comm, torch.float64)
        if not idx.numel():
            return idx, td, 0.0
        L = self.world_size * self.shard_size
        out = (idx < 0) | (idx >= L)
        if bool(out.any()):
            raise IndexError(f"indices: expected global start indices in [0, {L}) "
                             f"({self.world_size} shards of {self.shard_size}), got "
                             f"{idx[out][:5].tolist()}")
        top = float(td.to(torch.float32).abs().add_(self.local.eps).max())
        if not math.isfinite(top):
            raise ValueError("td_errors: |td| + eps must be finite (float32), got "
                             f"{td[~torch.isfinite(td.to(torch.float32))][:5].tolist()}")
        self.local.sampler.check_mass("td_errors, alpha", top)
        return idx, td, top

    @torch.compiler.disable
    @locked
    def update_priorities(self, indices, td_errors):
        """Set priorities ``|td| + eps`` of the starts at ``indices`` (K,) (global, as
        :meth:`sample` returns) from ``td_errors`` (K,) (collective; ``K`` may differ between ranks,
        and be 0); returns ``self``.

        Each update travels to its owner (an ``all_gather`` of the counts and of each rank's largest
        new priority, then one ``all_to_all`` of 16 bytes per update), which applies everything it
        receives in one local update (duplicates, from any rank, keep their largest value);
        ``max_priority`` becomes the same maximum on every rank. Invalid arguments on any rank raise
        on every rank before anything is written.
        """
        if not self.prioritized:
            raise TypeError(f"update_priorities: the shards are {type(self.local).__name__}s, "
                            "which have no priorities")
        error, top = None, 0.0
        try:
            idx, td, top = self._check_update(indices, td_errors)
        except _ARG_ERRORS as err:
            error = err
            idx = torch.empty(0, dtype=torch.int64, device=self._comm)
            td = torch.empty(0, dtype=torch.float64, device=self._comm)
        owner = idx.div(self.shard_size, rounding_mode="floor")
        order = torch.argsort(owner, stable=True)
        send = torch.bincount(owner, minlength=self.world_size)
        head = torch.tensor([error is not None, top], dtype=torch.float64, device=self._comm)
        # (W, W + 2): counts, failed, top
        plan = self._all_gather(torch.cat([send.double(), head])).cpu()
        self._fail("update_priorities", torch.nonzero(plan[:, -2]).view(-1).tolist(), error)
        payload = torch.stack([(idx % self.shard_size).double(), td], 1)[order]
        recv = plan[:, self.rank].long().tolist()
        got = self._all_to_all(payload, send.tolist(), recv).to(self.local.device)
        self.local.update_priorities(got[:, 0].long(), got[:, 1])
        # every rank's max_priority was the same before: the new one is the largest new priority
        # anywhere
        self.local.sampler.max_priority = max(self.local.sampler.max_priority,
                                              float(plan[:, -1].max()))
        return self

    def _sync_max_priority(self) -> None:
        top = torch.tensor([self.local.max_priority], dtype=torch.float64, device=self._comm)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self.group)
        self.local.sampler.max_priority = float(top.item())

    # ------------------------------------------------------------------ state

    @locked
    def state_dict(self) -> dict:
        """This rank's shard state (the local buffer's ``state_dict``)."""
        return self.local.state_dict()

    def _path(self, path) -> str:
        path = os.fspath(path)
        if _RANK not in path and self.world_size > 1:
            raise ValueError(f"path: expected a '{_RANK}' placeholder (replaced by the group rank) "
                             f"so that the shards write different files, got {path!r}")
        return path.replace(_RANK, str(self.rank))

    @locked
    def save(self, path) -> None:
        """Save this rank's shard to ``path`` with ``{rank}`` replaced by the group rank (local,
        atomic)."""
        self.local.save(self._path(path))

    @locked
    def load(self, path) -> None:
        """Load every rank's shard from ``path`` with ``{rank}`` replaced by its rank (collective:
        the maximum priority becomes global again). A rank whose load fails keeps its shard, the
        others keep what they loaded, ``max_priority`` is made global either way, and every rank
        then raises."""
        self._load(lambda: self.local.load(self._path(path)), "load")

    @locked
    def load_state_dict(self, state) -> None:
        """Load this rank's shard from ``state`` (collective, as :meth:`load`)."""
        self._load(lambda: self.local.load_state_dict(state), "load_state_dict")

    def _load(self, fn, call: str) -> None:
        error = None
        try:
            fn()
        except Exception as err:  # re-raised below, once every rank knows
            error = err
        failed = self._all_gather(torch.tensor([error is not None], dtype=torch.int64,
                                               device=self._comm)).cpu()
        if self.prioritized:  # also after a failure: new rows get the same priority on every rank
            self._sync_max_priority()
        self._fail(call, torch.nonzero(failed.view(-1)).view(-1).tolist(), error, what="the load")


__all__ = ["ShardedBuffer"]
