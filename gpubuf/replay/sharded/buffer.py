"""ShardedBuffer: one replay buffer sharded over the ranks of a ``torch.distributed`` process group.

Every rank holds one shard (:class:`ShardedBuffer` for the API). Inserts stay local; a sample draws from the union of
the shards with the exact global probabilities (uniform over every valid start of every shard, or ``p**alpha / global
sum``). Start ``j`` of the shard on group rank ``r`` has the global index ``r * S + j``, ``S`` = ``max_size``.

A sample with replacement, ``W`` ranks, ``B`` windows on this rank (three collectives):

1. ``all_gather`` of every shard's mass (its tree's root total; its valid-start count when uniform), valid count
   and the call's arguments: a bad argument on any rank raises on every rank, so none is left waiting.
2. The requester draws two float64 uniforms per window: the first picks the owner shard by inverse CDF over the
   shard masses; the second goes to the owner, in one ``all_to_all`` of padded blocks (to each rank: the count,
   then the uniforms, padded to the largest batch of the group).
3. Each owner descends its own tree with the uniforms it received, gathers the windows and sends back one byte
   row per window (``all_to_all`` with variable splits): every returned leaf as raw bytes, plus the local start
   (int64) and its mass (float64) when prioritized. The requester puts the rows back in its own order.

Bytes per window received: ``window_bytes`` (+ 16 when prioritized), where ``window_bytes`` sums
``n_steps * prod(shape) * itemsize`` over the returned leaves (inferred next observations included). Sent per
call: ``8 * W * (B_max + 1)`` bytes of padded uniforms and 48 bytes to every rank in the first step. Without
replacement the starts are drawn first, in rounds (see :class:`ShardedBuffer`), then fetched: 8 bytes sent
per window (its local start), ``window_bytes`` received.

Collectives run on the shard's device with NCCL and on CPU tensors with gloo
(:mod:`~gpubuf.replay.sharded.transport`); both implement ``all_to_all_single`` with variable splits."""

import hashlib
import os
import warnings

import torch
import torch.distributed as dist

from gpubuf._core.concurrency import locked
from gpubuf._core.copies import refuse_copies
from gpubuf._core.transition import Transition
from gpubuf.replay.buffer import TransitionBuffer
from gpubuf.replay.prioritized import PrioritizedTransitionBuffer
from gpubuf.replay.sampling.batch import Batch
from gpubuf.replay.sampling.sample_args import Samples
from gpubuf.replay.sharded.priorities import PriorityRouter
from gpubuf.replay.sharded.sampling import ShardSampler
from gpubuf.replay.sharded.transport import ShardTransport
from gpubuf.replay.sharded.windows import WindowPacker

_RANK = "{rank}"


def _config(config) -> dict:
    """What must agree between shards: a local buffer's ``config`` (but the default batch size) and leaves."""
    leaves = {leaf.name: (leaf.shape, str(leaf.dtype)) for leaf in config.leaves}
    return {**config.as_dict(batch=False), "leaves": leaves}


def _check_shards(everyone: list[dict]) -> None:
    """Raise unless every rank's entry (``{"error": ...}`` or ``{"config": ..., "rng": ...}``) holds a shard
    configured as the others; warn when every shard's generator is in the same state."""
    bad = {r: e["error"] for r, e in enumerate(everyone) if "error" in e}
    if bad:
        raise TypeError("local: " + "; ".join(f"rank {r}: {msg}" for r, msg in bad.items()))
    configs = [e["config"] for e in everyone]
    for field in configs[0]:
        values = [c[field] for c in configs]
        if any(v != values[0] for v in values):
            raise ValueError(f"local: the shards' configurations differ in {field}: "
                             + ", ".join(f"rank {r} has {v!r}" for r, v in enumerate(values)))
    if len(everyone) > 1 and len({e["rng"] for e in everyone}) == 1:
        warnings.warn("ShardedBuffer: every shard's generator is in the same state, so sample(key=None) draws "
                      "the same uniforms on every rank; seed each rank's buffer differently (seed=base + rank)",
                      stacklevel=3)


def _refusal(prioritized: bool, out, return_indices, frame_stack, frame_stride, n_step_return,
             return_generations=False) -> ValueError | None:
    """The ``ValueError`` naming the first sample argument a sharded sample does not offer (windows of ``n_steps``
    rows into fresh tensors, global indices of prioritized shards), or ``None``."""
    if return_generations is not False:
        return ValueError("return_generations: ShardedBuffer.sample does not return generations (its write-backs "
                          f"are not generation-checked); expected False, got {return_generations!r}")
    if out is not None:
        got = "Transition" if isinstance(out, Transition) else type(out).__name__  # a Batch is one
        return ValueError("out: ShardedBuffer.sample assembles each batch from the exchanged windows into fresh "
                          f"tensors; expected None, got a {got}")
    if return_indices and not prioritized:
        return ValueError("return_indices: ShardedBuffer.sample returns global indices of prioritized shards only "
                          f"(its shards are uniform); expected None or False, got {return_indices!r}")
    for name, value, default in (("frame_stack", frame_stack, None), ("frame_stride", frame_stride, 1),
                                 ("n_step_return", n_step_return, None)):
        if value != default:
            return ValueError(f"{name}: ShardedBuffer.sample returns windows of n_steps stored rows only; "
                              f"expected {default}, got {value!r}")
    return None


@refuse_copies("it is bound to a torch.distributed process group; copy its local buffer (local) and build a "
               "ShardedBuffer from the copy in each rank")
class ShardedBuffer(Samples):
    """A replay buffer whose shards are the ``local`` buffers of the ranks of ``group`` (``None``: the default group).
    Construction is collective: every rank checks that all shards share class, ``max_size``, ``n_envs``, ``n_steps``,
    leaf shapes and dtypes (and ``alpha``, ``eps``); a mismatch raises ``ValueError`` on every rank naming the field.

    Collective methods (every rank of the group must call them, in the same order): :meth:`sample`,
    :meth:`update_priorities`, :meth:`num_valid`, :meth:`load`, :meth:`load_state_dict`. Local ones: :meth:`insert`,
    :meth:`state_dict`, :meth:`save`.

    :meth:`sample` is the buffers' own (:mod:`gpubuf.replay.sampling.sample_args`), collective: each rank gets its own
    :class:`~gpubuf.Batch` drawn from the union of the shards; ``batch_size`` may differ between ranks,
    ``with_replacement``, ``boundaries`` and the unit's ``next_obs`` must agree. A prioritized batch carries ``weights =
    (N * P_i)**-beta / max over the batch`` (``N`` and ``P`` global) and global ``indices``, ``rank * max_size +
    start``; a uniform one no indices. An int ``key`` is mixed with the rank. Not offered (``ValueError`` naming the
    argument on the rank that gave it, ``RuntimeError`` on the others): ``out``, units with frame stacks or n-step
    returns, generations (write-backs to shards are not generation-checked).

    Without replacement, each rank's batch is exact sequential sampling without replacement from the union: rounds of
    draws with replacement from the shards' remaining masses (mass less what this rank already drew there), where each
    owner zeroes, for that requester only, the starts it already drew in its tree, descends and restores them; first
    appearances are kept (one ``all_gather`` of counts and two ``all_to_all`` per round, usually one or two rounds),
    then the windows are fetched. A shard's remaining mass is its total less what was drawn there, in float64: when one
    start's mass exceeds the rest of its shard by about ``2**52`` (priority ratios no TD error produces in practice),
    that subtraction loses the rest and the shard's share after the big start is drawn is no longer exact; a local
    buffer has no such limit (its trees sum what remains).

    Threads: every method holds the local buffer's lock (collectives too, while they wait for the other ranks), so an
    actor thread may insert into the local buffer while a learner thread runs the collective calls."""

    def __init__(self, local: TransitionBuffer, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ShardedBuffer: torch.distributed is not initialized (call "
                               "torch.distributed.init_process_group first)")
        if dist.get_rank(group) < 0:
            raise ValueError("group: this process is not a member of the group")
        backend = str(dist.get_backend(group))
        shard = isinstance(local, TransitionBuffer)
        on_cuda = shard and local.device.type == "cuda"
        transport = ShardTransport(group, local.device if on_cuda and "nccl" in backend else torch.device("cpu"))
        mine: dict = {}
        if not shard:
            mine["error"] = f"expected a gpubuf TransitionBuffer or PrioritizedTransitionBuffer, " \
                            f"got {type(local).__name__}"
        elif local.selector is not None:
            mine["error"] = f"a shard with a selector ({local.selector!r}) draws from its own rows only; shards " \
                            "sample the union with the buffers' own draws"
        elif backend == "nccl" and not on_cuda:
            mine["error"] = f"an NCCL group needs the shard on a CUDA device, got {local.device}"
        else:
            rng = hashlib.sha1(local.generator.get_state().numpy().tobytes()).hexdigest()
            mine.update(config=_config(local.config), rng=rng)
        _check_shards(transport.gather_objects(mine))
        self.group, self.rank, self.world_size = group, transport.rank, transport.world_size
        self.local = local
        self._guard = local.guard  # calls hold the local buffer's lock
        self.prioritized = isinstance(local, PrioritizedTransitionBuffer)
        self.default_with_replacement = not self.prioritized  # sample(): the local buffers' defaults
        self.default_return_indices = self.prioritized
        self.shard_size = local.max_size
        self._transport = transport
        self._sampling = ShardSampler(local, transport, WindowPacker(local, transport.device))
        self._priorities = PriorityRouter(local, transport) if self.prioritized else None
        if self.prioritized:
            self._priorities.sync_max_priority()

    # ------------------------------------------------------------------ local
    # insert and update_beta are alike by shape on purpose: each is the local buffer's own call under the lock

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

    # ------------------------------------------------------------------ collective

    @locked
    def num_valid(self, with_next_obs: bool = False, boundaries: str = "allow") -> int:
        """Valid sequence starts over every shard (collective), as the local ``num_valid`` counts them."""
        return self._transport.sum(self.local.num_valid(with_next_obs, boundaries))

    @locked
    def _sample(self, key, with_replacement, batch_size, with_next_obs, boundaries, out, return_indices,
                frame_stack, frame_stride, n_step_return, return_generations=False):
        """The sample entry of :class:`~gpubuf.replay.sampling.sample_args.Samples` (defaults resolved): the batch,
        or ``(batch, global indices)`` with ``return_indices``. What a sharded sample does not offer is refused
        on the rank that gave it, the others raising ``RuntimeError``."""
        refusal = _refusal(self.prioritized, out, return_indices, frame_stack, frame_stride, n_step_return,
                           return_generations)
        return self._sampling.sample(key, with_replacement, batch_size, with_next_obs, boundaries, return_indices,
                                     refusal)

    def _sample_batch(self, key, with_replacement: bool, batch_size, boundaries: str, out, unit) -> Batch:
        """One sample as a :class:`~gpubuf.Batch`: global indices when prioritized, no generations."""
        with_next_obs, frame_stack, frame_stride, n_step_return = unit.args
        drawn = self._sample(key, with_replacement, batch_size, with_next_obs, boundaries, out, self.prioritized,
                             frame_stack, frame_stride, n_step_return)
        data, indices = drawn if self.prioritized else (drawn, None)
        return Batch.of(data, indices, None, out)

    @torch.compiler.disable
    @locked
    def update_priorities(self, indices, td_errors):
        """Set priorities ``|td| + eps`` of the starts at ``indices`` (K,) (global, as :meth:`sample` returns)
        from ``td_errors`` (K,) (collective; ``K`` may differ between ranks, and be 0); returns ``self``.

        Each update travels to its owner (an ``all_gather`` of the counts and of each rank's largest new
        priority, then one ``all_to_all`` of 16 bytes per update), which applies everything it receives in one
        local update (duplicates, from any rank, keep their largest value); ``max_priority`` becomes the same
        maximum on every rank. Invalid arguments on any rank raise on every rank before anything is written."""
        if not self.prioritized:
            raise TypeError(f"update_priorities: the shards are {type(self.local).__name__}s, which have no "
                            "priorities")
        self._priorities.update(indices, td_errors)
        return self

    # ------------------------------------------------------------------ state

    @locked
    def state_dict(self) -> dict:
        """This rank's shard state (the local buffer's ``state_dict``)."""
        return self.local.state_dict()

    def _path(self, path) -> str:
        path = os.fspath(path)
        if _RANK not in path and self.world_size > 1:
            raise ValueError(f"path: expected a '{_RANK}' placeholder (replaced by the group rank) so that the "
                             f"shards write different files, got {path!r}")
        return path.replace(_RANK, str(self.rank))

    @locked
    def save(self, path) -> None:
        """Save this rank's shard to ``path`` with ``{rank}`` replaced by the group rank (local, atomic)."""
        self.local.save(self._path(path))

    @locked
    def load(self, path) -> None:
        """Load every rank's shard from ``path`` with ``{rank}`` replaced by its rank (collective: the maximum
        priority becomes global again). A rank whose load fails keeps its shard, the others keep what they
        loaded, ``max_priority`` is made global either way, and every rank then raises."""
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
        failed = self._transport.failed_ranks(error)
        if self.prioritized:  # also after a failure: new rows get the same priority on every rank
            self._priorities.sync_max_priority()
        self._transport.fail(call, failed, error, what="the load")


__all__ = ["ShardedBuffer"]
