"""Pure-torch twins of every Triton kernel: the CPU path and the tests' oracle.

Each function has the signature of its kernel launcher in ``kernels/`` and writes into the same
preallocated outputs. Vectorised torch only: no Python loop over envs or samples.
"""

from functools import lru_cache

import torch


def as_words(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Views of contiguous 2-D tensors with equal row bytes as rows of one common int word type.

    The widest of int64/int32/int16/uint8 that divides the row's bytes and every tensor's byte offset;
    for pure copies, moving int64 words instead of bytes is what makes a gather run at memcpy speed.
    """
    if all(t.dtype == torch.int64 and t.stride(-1) == 1 for t in tensors):
        return tensors  # already rows of the widest word (the buffers' own word views)
    row_bytes = tensors[0].shape[1] * tensors[0].element_size()
    if row_bytes == 0:  # zero-width rows: nothing to move, any view will do
        return tuple(_canonical(t).view(torch.uint8) for t in tensors)
    for word, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2), (torch.uint8, 1)):
        if row_bytes % size == 0 and all(t.storage_offset() * t.element_size() % size == 0 for t in tensors):
            return tuple(t if t.dtype == word and t.stride(-1) == 1 else
                         (t if t.stride(-1) == 1 else _canonical(t)).view(torch.uint8).view(word) for t in tensors)
    raise AssertionError("unreachable: every row divides into bytes")


def _canonical(t: torch.Tensor) -> torch.Tensor:
    """Contiguous 2-D ``t`` with row-major strides (a size-1 dim may carry any stride, which ``view`` rejects)."""
    return t.as_strided(t.shape, (t.shape[1], 1), t.storage_offset())


@lru_cache(maxsize=64)
def _ascending(n: int, device: torch.device) -> torch.Tensor:
    """(n,) int64: 0, 1, ..., n-1."""
    return torch.arange(n, device=device)


@lru_cache(maxsize=64)
def _countdown(n: int, device: torch.device) -> torch.Tensor:
    """(n,) int64: n-1, n-2, ..., 0."""
    return torch.arange(n - 1, -1, -1, device=device)


# ---------------------------------------------------------------- HistoryBuffer (kernels/history.py)


def history_append(pairs: list, dst_rows: torch.Tensor) -> None:
    """For each ``(storage (max_len*n_envs, E), rows (R, E))`` in ``pairs``: storage[dst_rows (R,)] = rows;
    dst_rows distinct."""
    if dst_rows.shape[0] == 0:
        return
    for storage, rows in pairs:
        if storage.shape[1]:
            dst, src = as_words(storage, rows)
            dst.index_copy_(0, dst_rows, src)


def _frame_back(meta: torch.Tensor, n: int, ab: int) -> torch.Tensor:
    """(rows, n) how many env steps before the newest entry each output frame lies."""
    return torch.minimum(_countdown(n, meta.device), meta[2].unsqueeze(1) - 1) * ab


def history_gather_frames(pairs: list, meta, n, ab, max_len) -> None:
    """For each ``(storage, out (rows, n, E))`` in ``pairs``: strided frames, left-padded with the oldest
    strided entry. The source rows are computed once for all pairs."""
    rows = meta.shape[1]
    if rows == 0 or not pairs:
        return
    env, newest = meta[0].unsqueeze(1), meta[1].unsqueeze(1)
    slot = (newest - _frame_back(meta, n, ab)) % max_len  # (rows, n)
    src_rows = (slot * (pairs[0][0].shape[0] // max_len) + env).reshape(-1)
    for storage, out in pairs:
        if storage.shape[1]:
            src, dst = as_words(storage, out.view(rows * n, storage.shape[1]))
            torch.index_select(src, 0, src_rows, out=dst)


def history_pack_blocks(storage, meta, n, ab, max_len, out) -> None:
    """out (rows, n-1, ab*D): block i = entries after frame i up to frame i+1, NaN->0, zero-padded."""
    rows, D = meta.shape[1], storage.shape[1]
    if rows == 0 or n < 2:
        return
    env, newest, k = meta[0].view(-1, 1), meta[1].view(-1, 1), meta[2].view(-1, 1)
    slot = (newest - _block_back(n, ab, meta.device)) % max_len  # (rows, (n-1)*ab): block i ends at frame i+1
    src_rows = (slot * (storage.shape[0] // max_len) + env).reshape(-1)
    flat = out.view(rows * (n - 1) * ab, D)
    torch.index_select(storage, 0, src_rows, out=flat)
    if out.dtype.is_floating_point:
        torch.nan_to_num(out, nan=0.0, out=out)
    zero = _countdown(n - 1, meta.device).view(1, -1, 1) >= k.view(-1, 1, 1) - 1  # the first n-k blocks
    out.masked_fill_(zero, 0)


@lru_cache(maxsize=64)
def _block_back(n: int, ab: int, device: torch.device) -> torch.Tensor:
    """(1, (n-1)*ab) int64: env steps before the newest entry of each entry of the n-1 action blocks."""
    return (_countdown(n - 1, device).view(-1, 1) * ab + _countdown(ab, device)).view(1, -1)


# ---- replay (kernels/sequence.py, kernels/prefix_tree.py)


_BELOW_ONE = 1.0 - 2.0**-52  # x * _BELOW_ONE < x for every positive normal float64 x
_SHARED = 4096  # tree levels up to this size are searched whole by tree_sample
_DENSE = 1024  # parent levels up to this size are recomputed whole by tree_update


def tree_sample(tree: torch.Tensor, offsets: list[int], fanout: int, u: torch.Tensor, out: torch.Tensor) -> None:
    """out (B,) int64 = leaf of each uniform u (B,) float64 in [0, 1), by descent of the wide prefix-sum tree.

    ``tree`` is the flat float64 concatenation of the levels (leaves first; level ``k+1`` holds the sums of
    consecutive groups of ``fanout`` entries of level ``k``; the top level is one node of ``fanout`` entries);
    ``offsets`` (K+1 ints) bounds the K levels: level ``k`` is ``tree[offsets[k]:offsets[k+1]]``. At each
    level the sample takes the inclusive prefix sum of its node's children and moves to the first child
    whose prefix sum exceeds its remaining mass. Only a child of positive mass is ever chosen: when rounding
    (subnormal or huge masses) puts the remaining mass at or past the node's total, the last child of
    positive mass is taken. So, whenever the tree holds any mass, every returned leaf has positive mass
    (a valid start) and lies below the capacity (padding leaves are zero).
    """
    B = u.shape[0]
    if B == 0:
        return
    F = fanout
    # The lowest level holding at most _SHARED entries is searched whole: one cumsum shared by all samples
    # (bounded work, whatever the capacity), then the descent goes node by node below it.
    shared = 0
    while offsets[shared + 1] - offsets[shared] > max(_SHARED, F):
        shared += 1
    level = tree[offsets[shared]:offsets[shared + 1]]
    cs = level.cumsum(0)
    total = cs[-1]
    target = torch.minimum(u * total, total * _BELOW_ONE)
    node = _positive_child(torch.searchsorted(cs, target, right=True), level)
    target = target.sub_(cs.sub_(level).index_select(0, node)).clamp_min_(0).unsqueeze_(1)  # (B, 1)
    base = tree.storage_offset()
    for k in range(shared - 1, -1, -1):
        children = tree.as_strided(((offsets[k + 1] - offsets[k]) // F, F), (F, 1), base + offsets[k])
        c = children.index_select(0, node)  # (B, F) children
        cs = c.cumsum(1)
        target = torch.minimum(target, cs[:, -1:] * _BELOW_ONE)  # stay below the node's mass
        j = _positive_child(torch.searchsorted(cs, target, right=True), c)  # (B, 1)
        target = target.sub_(cs.sub_(c).gather(1, j)).clamp_min_(0)
        node = torch.add(j.view(-1), node, alpha=F)
    out.copy_(node)


def _positive_child(j: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``j`` (first child whose prefix sum exceeds the mass), replaced by the last child of positive mass in
    ``c`` (``(F,)`` or ``(B, F)``) wherever it is out of range or of zero mass."""
    F = c.shape[-1]
    j = j.clamp_max(F - 1)
    picked = c.gather(-1, j) if c.dim() == 2 else c.index_select(0, j)
    if c.device.type == "cpu" and not bool((picked <= 0).any()):
        return j  # the common case, checked for free on the host
    last = torch.where(c > 0, _ascending(F, c.device), -1).amax(-1, keepdim=True).clamp_min_(0)
    if c.dim() == 1:
        last = last.expand_as(j)
    return torch.where(picked > 0, j, last)


def tree_update(tree: torch.Tensor, offsets: list[int], fanout: int, idx: torch.Tensor, values: torch.Tensor) -> None:
    """Leaves ``tree[idx] = values`` (duplicate indices must carry equal values), then every touched parent,
    level by level, recomputed as the sum of its ``fanout`` children (idempotent: no atomics needed).

    Parent levels of at most ``max(_DENSE, len(idx))`` entries are recomputed whole (one reduction instead
    of a gather, a sum and a scatter of the touched parents): same values, untouched parents included."""
    K = idx.shape[0]
    if K == 0:
        return
    F = fanout
    tree.index_copy_(0, idx, values)
    node, base = idx, tree.storage_offset()
    for k in range(1, len(offsets) - 1):
        c0, p0 = offsets[k - 1], offsets[k]
        n = (p0 - c0) // F  # parents with children (the level's padding past them stays zero)
        children = tree.as_strided((n, F), (F, 1), base + c0)
        if n <= max(_DENSE, K):  # this level and every (smaller) one above it: whole
            torch.sum(children, 1, out=tree[p0:p0 + n])
            continue
        node = torch.div(node, F, rounding_mode="floor")
        tree[p0:p0 + n].index_copy_(0, node, children.index_select(0, node).sum(1))


def sequence_gather(jobs: list, starts: torch.Tensor, n: int, E: int, M: int) -> None:
    """For each ``(storage (M*E, D), out (B, n, D), shift)`` in ``jobs``: out = storage rows
    ``((start//E + j + shift) % M) * E + start % E``, j < n, for flat starts (B,). Rows are computed once
    per distinct shift."""
    B = starts.shape[0]
    if B == 0:
        return
    rows = {}
    for storage, out, shift in jobs:
        if shift not in rows:
            if n == 1 and shift == 0:
                rows[shift] = starts  # row of start s = step * E + env is s itself
            else:  # (step + j) * E + env = s + j * E, wrapped modulo the M * E rows
                j = torch.arange(shift * E, (n + shift) * E, E, device=starts.device)
                rows[shift] = (starts.unsqueeze(1) + j).remainder_(M * E).view(-1)  # (B * n,)
        src, dst = as_words(storage, out.view(B * n, storage.shape[1]))
        torch.index_select(src, 0, rows[shift], out=dst)


def tree_update_range(tree: torch.Tensor, offsets: list[int], fanout: int, lo: int, values: torch.Tensor) -> None:
    """Leaves ``tree[lo:lo+len(values)] = values``, then their parents (contiguous ranges) from their children."""
    a, b = lo, lo + values.shape[0]
    if a == b:
        return
    F = fanout
    tree[a:b].copy_(values)
    base = tree.storage_offset()
    for k in range(1, len(offsets) - 1):
        c0, p0 = offsets[k - 1], offsets[k]
        a, b = a // F, (b - 1) // F + 1
        torch.sum(tree.as_strided((b - a, F), (F, 1), base + c0 + a * F), 1, out=tree[p0 + a:p0 + b])
