"""torchrl's ``PrioritizedSampler`` drawing from gpubuf's wide prefix-sum tree.

:class:`PrioritizedSampler` is torchrl's own class (its ``alpha``, ``beta``, ``eps``, ``max_priority_within_buffer``,
``update_priority``, ``mark_update``, ``state_dict``, ``dumps``/``loads`` and the ``"priority_weight"`` it returns,
unchanged) with its two segment trees replaced by :class:`SumTree` and :class:`MinTree`:

- :class:`SumTree` keeps each leaf ``(priority + eps) ** alpha`` (rounded to the sampler's ``dtype``, as
  torchrl's trees store it) in gpubuf's float64 :class:`~gpubuf.replay.sampling.tree.PrefixSumTree`: batched updates
  recompute only the touched parents, draws descend it on the device, and a leaf of zero mass is never drawn;
- :class:`MinTree` keeps the same leaves for the minimum priority that normalises the weights
  (``(p_i / min p) ** -beta``, as torchrl computes them), and on the host that minimum itself between writes.

Both answer a draw's query over the filled rows without reading the leaves, and a write of both trees is checked
once. A refused update (an index outside the capacity: ``IndexError``; a negative, NaN or infinite priority, or one
whose leaf overflows ``dtype``: ``ValueError``) changes nothing, torchrl's maximum priority included.

So it runs without torchrl's compiled extension, which torchrl's own trees need, and on the storage's device."""

import json
import math
from pathlib import Path

import numpy as np
import torch
from tensordict import MemoryMappedTensor
from torchrl.data.replay_buffers.samplers import PrioritizedSampler as _TorchRLPrioritizedSampler

from gpubuf import ops
from gpubuf.replay.sampling.tree import PrefixSumTree

_BELOW_ONE = 1.0 - 2.0 ** -53  # the largest float64 uniform below 1
_BLOCK = 1024  # leaves per block of the min tree's block minima
_DTYPES = {torch.float32: torch.float32, torch.FloatType: torch.float32,  # the names torchrl's sampler accepts
           torch.float64: torch.float64, torch.DoubleTensor: torch.float64}


def _index(index, device: torch.device, capacity: int) -> tuple[torch.Tensor, int]:
    """``(leaves (K,) int64, 1 + the highest)``; ``IndexError`` (before any write) for one outside ``[0, capacity)``."""
    idx = torch.as_tensor(index, dtype=torch.long, device=device).reshape(-1)
    if not idx.numel():
        return idx, 0
    lo, hi = (int(x) for x in torch.aminmax(idx))
    if not (lo >= 0 and hi < capacity):
        bad = idx[(idx < 0) | (idx >= capacity)][:5].tolist()
        raise IndexError(f"index: expected leaves in [0, {capacity}), got {bad}")
    return idx, hi + 1


def _check_priorities(priority, eps: float, alpha: float, dtype: torch.dtype) -> None:
    """``ValueError`` naming ``priority`` unless every priority is a finite number ``>= 0`` whose leaf
    ``(priority + eps) ** alpha`` is finite in ``dtype``. What torch cannot read is left to torchrl's own error."""
    try:
        p = torch.as_tensor(priority).detach()
    except (TypeError, ValueError, RuntimeError):
        return
    if p.dtype == torch.bool or p.is_complex() or not p.numel():
        return
    lo, hi = torch.stack(torch.aminmax(p.reshape(-1))).tolist()  # one read; a NaN makes both NaN
    try:  # the largest leaf (leaves grow with the priority)
        top = (hi + eps) ** alpha if lo >= 0 else math.nan
    except OverflowError:
        top = math.inf
    if top <= torch.finfo(dtype).max and hi < math.inf:
        return
    p = p.to(torch.float64)
    bad = ~(torch.isfinite(p) & (p >= 0) & torch.isfinite(torch.pow(p + eps, alpha).to(dtype)))
    raise ValueError(f"priority: expected finite priorities >= 0 whose (priority + eps) ** alpha is finite in {dtype}, "
                     f"got {p[bad][:5].tolist()}; nothing was written")


class _Writes:
    """One write to both trees, prepared once: torchrl writes the same ``(index, value)`` to its sum tree and then
    to its min tree, so the second tree reuses the first one's checked leaves and values (keyed by the two
    objects and their in-place versions)."""

    def __init__(self, capacity: int, device: torch.device, dtype: torch.dtype):
        self.capacity, self.device, self.dtype = capacity, device, dtype
        self._last_of = torch.empty(capacity, dtype=torch.long, device=device)  # scratch: last write per leaf
        self._key, self._prepared = None, None

    def __deepcopy__(self, memo):  # a copy (torchrl's state_dict deep-copies the trees) starts with no write
        return _Writes(self.capacity, self.device, self.dtype)

    def prepare(self, index, value) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``(leaves (K,), values (K,) float64, 1 + the highest leaf)``: every write of a repeated leaf carries its
        last value (torchrl's trees write in order); ``IndexError`` or ``ValueError`` before anything is written."""
        key = None
        if (isinstance(index, torch.Tensor) and isinstance(value, torch.Tensor)  # tensors tell in-place changes,
                and not index.is_inference() and not value.is_inference()):  # but inference tensors do not
            key = (index, index._version, value, value._version)  # noqa: SLF001
            last = self._key
            if last is not None and last[0] is index and last[2] is value and last[1::2] == key[1::2]:
                return self._prepared
        idx, end = _index(index, self.device, self.capacity)
        v = torch.as_tensor(value, device=self.device).to(self.dtype).to(torch.float64).reshape(-1)
        v = v.expand(idx.shape) if v.numel() == 1 else v
        if v.shape != idx.shape:
            raise ValueError(f"value: expected one value or {idx.numel()} (one per index), got {v.numel()}")
        if idx.numel() > 1 and v.stride(0):  # repeats of one broadcast value need nothing
            order = torch.arange(idx.numel(), device=self.device)
            self._last_of.scatter_reduce_(0, idx, order, "amax", include_self=False)
            v = v.index_select(0, self._last_of.index_select(0, idx))
        self._key, self._prepared = key, (idx, v.contiguous(), end)
        return self._prepared


class _Leaves:
    """What both trees share: ``capacity`` float64 leaves on ``device`` holding values rounded to ``dtype``, read by
    ``[index]`` (a float for an int, else ``dtype`` values shaped like ``index``)."""

    leaves: torch.Tensor  # (capacity,) float64
    UNWRITTEN: float  # a leaf's value until written

    def __init__(self, writes: _Writes):
        self.writes = writes
        self.capacity, self.device, self.dtype = writes.capacity, writes.device, writes.dtype
        self.end = 0  # 1 + the highest leaf written: a query over [0, end) or more reads every written leaf

    def recount_end(self) -> None:
        """:attr:`end` from the leaves (after a load wrote every leaf)."""
        written = (self.leaves != self.UNWRITTEN).nonzero()
        self.end = int(written[-1]) + 1 if written.numel() else 0

    def __getitem__(self, index):
        if isinstance(index, int):
            return float(self.leaves[index])
        idx = torch.as_tensor(index, dtype=torch.long, device=self.device)
        values = self.leaves[idx.reshape(-1)].to(self.dtype).reshape(idx.shape)
        return values.cpu().numpy() if isinstance(index, np.ndarray) else values  # numpy in, numpy out (torchrl's)

    def _masked(self, left, right, fill: float) -> torch.Tensor:
        """The leaves with those outside ``[left, right)`` (0-d tensors: no host sync) set to ``fill``."""
        at = torch.arange(self.capacity, device=self.device)
        return torch.where((at >= left) & (at < right), self.leaves, fill)


class SumTree(_Leaves):
    """torchrl's sum segment tree interface (``[index]``, ``query``, ``scan_lower_bound``) over gpubuf's
    ``PrefixSumTree``: the mass of a range holding every written leaf is the tree's total."""

    UNWRITTEN = 0.0

    def __init__(self, writes: _Writes):
        super().__init__(writes)
        self.tree = PrefixSumTree(self.capacity, ops.backend_table(self.device))

    @property
    def leaves(self) -> torch.Tensor:
        """(capacity,) float64 view of the leaves."""
        return self.tree.tree[:self.capacity]

    def __setitem__(self, index, value) -> None:
        idx, v, end = self.writes.prepare(index, value)
        if idx.numel():
            self.tree.update(idx, v)
            self.end = max(self.end, end)

    def query(self, left, right):
        """The mass of leaves ``[left, right)``: a float for int bounds, a 0-d tensor (no host sync) for tensor
        bounds."""
        if isinstance(left, torch.Tensor) or isinstance(right, torch.Tensor):
            return self._masked(left, right, 0.0).sum()
        if left <= 0 and right >= self.end:
            return float(self.tree.total())
        return float(self.leaves[max(left, 0):right].sum())

    def scan_lower_bound(self, mass) -> torch.Tensor:
        """The leaf whose prefix-sum interval holds each of ``mass`` (in ``[0, total)``), never a zero leaf."""
        m = torch.as_tensor(mass, dtype=torch.float64, device=self.device)
        u = (m / self.tree.total()).clamp_(0.0, _BELOW_ONE)
        return self.tree.sample(u.reshape(-1).contiguous()).reshape(m.shape)


class MinTree(_Leaves):
    """torchrl's min segment tree interface (``[index]``, ``query``) over leaves that are ``inf`` until written.

    On the host the minimum of every leaf is kept between writes (a write only lowers it, unless it raises the leaf that
    held it), so the query a draw makes, over every written leaf, reads none; when a write raised it, the next query
    takes the minima of the blocks of 1024 leaves written since the last one, and the minimum of those."""

    UNWRITTEN = torch.inf

    def __init__(self, writes: _Writes):
        super().__init__(writes)
        n = -(-self.capacity // _BLOCK)
        self._padded = torch.full((n * _BLOCK,), torch.inf, dtype=torch.float64, device=self.device)
        self.leaves = self._padded[:self.capacity]
        self._blocks = torch.full((n,), torch.inf, dtype=torch.float64, device=self.device)  # each block's minimum
        self._stale = torch.zeros(n, dtype=torch.bool, device=self.device)  # blocks written since then
        self._min = torch.inf  # of every leaf; None when a write raised it

    def __setitem__(self, index, value) -> None:
        idx, v, end = self.writes.prepare(index, value)
        if not idx.numel():
            return
        self.end = max(self.end, end)
        if self.device.type != "cpu":
            self.leaves[idx] = v
            return
        old_min, new_min = self._min, float(v.min())
        # the minimum is lost when unknown, NaN (held or written: recounted until no leaf is NaN), or its leaf raised
        lost = old_min is None or old_min != old_min or new_min != new_min or (
            new_min > old_min and bool((self.leaves.index_select(0, idx) == old_min).any()))
        self.leaves[idx] = v
        self._stale[idx // _BLOCK] = True
        self._min = None if lost else min(old_min, new_min)

    def _every_leaf_min(self) -> float:
        stale = self._stale.nonzero().squeeze(1)
        if stale.numel():
            self._blocks[stale] = self._padded.view(-1, _BLOCK).index_select(0, stale).amin(1)
            self._stale.zero_()
        return float(self._blocks.min())

    def query(self, left, right):
        """The smallest leaf of ``[left, right)`` (float for int bounds, 0-d tensor for tensor bounds)."""
        if isinstance(left, torch.Tensor) or isinstance(right, torch.Tensor):
            return self._masked(left, right, torch.inf).min()
        if self.device.type == "cpu" and left <= 0 and right >= self.end:
            if self._min is None:
                self._min = self._every_leaf_min()
            return self._min
        return float(self.leaves[max(left, 0):right].min())


class GpubufTrees:
    """What a torchrl prioritized sampler class gets by putting this first among its bases: :class:`SumTree` and
    :class:`MinTree` for its trees, updates that change nothing when refused, and whole-file ``dumps``/``loads``."""

    def _init(self) -> None:
        dtype = _DTYPES.get(self.dtype)
        if dtype is None:  # the type torchrl raises
            raise NotImplementedError(f"dtype: expected torch.float32 or torch.float64, got {self.dtype}")
        device = self._device if self._device is not None else torch.device("cpu")
        writes = _Writes(self._max_capacity, torch.device(device), dtype)
        self._sum_tree, self._min_tree = SumTree(writes), MinTree(writes)
        self._max_priority = None

    def update_priority(self, index, priority, *, storage=None) -> None:
        """torchrl's update; a refused index or priority (``IndexError``, ``ValueError``) changes nothing: torchrl
        records a new maximum priority before its trees are written, and that record is undone here. A priority that
        is negative, NaN or infinite, or whose leaf ``(priority + eps) ** alpha`` the trees' ``dtype`` cannot hold
        finite, is refused (torchrl stores it, and its next draw raises)."""
        _check_priorities(priority, self._eps, self._alpha, self._sum_tree.dtype)
        before = self._max_priority
        try:
            super().update_priority(index, priority, storage=storage)
        except (IndexError, ValueError):
            self._max_priority = before
            raise

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        if isinstance(self._sum_tree, SumTree) and isinstance(self._min_tree, MinTree):
            self._min_tree.writes = self._sum_tree.writes  # copied apart: one prepared write serves both again

    # torchrl's own dumps/loads write and read the same files one leaf at a time in Python; these do it whole

    def dumps(self, path) -> None:
        """Write ``sumtree.memmap``, ``mintree.memmap`` (float64 leaves) and ``sampler_metadata.json`` under
        ``path``, the files torchrl's sampler writes."""
        path = Path(path).absolute()
        path.mkdir(parents=True, exist_ok=True)
        for name, tree in (("sumtree", self._sum_tree), ("mintree", self._min_tree)):
            file = MemoryMappedTensor.empty((self._max_capacity,), dtype=torch.float64,
                                            filename=path / f"{name}.memmap")
            file.copy_(tree.leaves.cpu())
        meta = {"_alpha": float(self._alpha), "_beta": float(self._beta), "_eps": float(self._eps),
                "_max_priority": [None if x is None else float(x) for x in self._max_priority],
                "_max_capacity": float(self._max_capacity), "_schema_version": self._STATE_SCHEMA_VERSION}
        (path / "sampler_metadata.json").write_text(json.dumps(meta))

    def loads(self, path) -> None:
        """Read what :meth:`dumps` (or torchrl's sampler) wrote under ``path``; ``RuntimeError`` for another
        ``max_capacity``."""
        path = Path(path).absolute()
        meta = json.loads((path / "sampler_metadata.json").read_text())
        if int(meta["_max_capacity"]) != self._max_capacity:
            raise RuntimeError(f"max capacity of loaded metadata ({meta['_max_capacity']}) differs from "
                               f"self._max_capacity ({self._max_capacity}).")
        self._alpha, self._beta, self._eps = meta["_alpha"], meta["_beta"], meta["_eps"]
        value, index = meta["_max_priority"]
        self._max_priority = (value, None if index is None else int(index))
        every = torch.arange(self._max_capacity)
        for name, tree in (("sumtree", self._sum_tree), ("mintree", self._min_tree)):
            leaves = MemoryMappedTensor.from_filename(shape=(self._max_capacity,), dtype=torch.float64,
                                                      filename=path / f"{name}.memmap")
            tree[every] = leaves.clone()
            tree.recount_end()
        if meta.get("_schema_version", 0) < 1 and self._max_priority_within_buffer and value is not None:
            self._recompute_max_priority_from_tree()  # older files kept the transformed maximum, as torchrl reads them


class PrioritizedSampler(GpubufTrees, _TorchRLPrioritizedSampler):
    """torchrl's ``PrioritizedSampler`` (same arguments: ``max_capacity``, ``alpha``, ``beta``, ``eps``, ``dtype``
    float32/float64, ``reduction``, ``max_priority_within_buffer``, ``device``) drawing from gpubuf's prefix-sum tree.
    The trees live on ``device`` (default: a CUDA storage's device once it is seen, else the CPU)."""
