"""HistoryBuffer's ops (Triton kernels in ``kernels/history.py``): append scatter, strided frames, action blocks.

Storage of one key is a contiguous ``(max_len * n_envs, D)`` tensor, slot-major: env ``e``'s ring slot ``s`` is
row ``s * n_envs + e``. ``meta`` is ``(3, rows)`` int64: env, newest slot, k = strided frames used.

The twins (the CPU implementations, in the schemas' argument order) are vectorised torch, no Python loop over envs or
rows; their index arithmetic is :mod:`gpubuf.ops.indexing`'s.
"""

import torch

from gpubuf.kernels.words import as_words
from gpubuf.ops import indexing
from gpubuf.ops.registry import Op, kernel


def append_twin(storages: list, rows: list, dst_rows: torch.Tensor) -> None:
    """``storage[dst_rows] = rows`` per storage (max_len*n_envs, D) and its ``rows`` (R, D); dst_rows (R,) distinct."""
    if dst_rows.shape[0] == 0:
        return
    for storage, src in zip(storages, rows, strict=True):
        if storage.shape[1]:
            dst, src = as_words(storage, src)
            dst.index_copy_(0, dst_rows, src)


APPEND = Op("history_append", "(Tensor(a!)[] storages, Tensor[] rows, Tensor dst_rows) -> ()",
             append_twin, kernel("history", "append"))


def gather_frames_twin(storages: list, outs: list, meta, n, ab, max_len) -> None:
    """For each storage of ``storages`` and its out (rows, n, D) of ``outs``: strided frames, left-padded
    with the oldest strided entry. The source rows are computed once for all keys."""
    rows = meta.shape[1]
    if rows == 0 or not storages:
        return
    env, newest, k = meta[0].unsqueeze(1), meta[1].unsqueeze(1), meta[2].unsqueeze(1)
    back = indexing.frame_back(n, k, ab, meta.device)  # (rows, n)
    src_rows = indexing.source_rows(env, newest, back, storages[0].shape[0] // max_len, max_len)
    for storage, out in zip(storages, outs, strict=True):
        if storage.shape[1]:
            src, dst = as_words(storage, out.view(rows * n, storage.shape[1]))
            torch.index_select(src, 0, src_rows, out=dst)


GATHER_FRAMES = Op("history_gather_frames",
                    "(Tensor[] storages, Tensor(a!)[] outs, Tensor meta, int n, int ab, int max_len) -> ()",
                    gather_frames_twin, kernel("history", "gather_frames"))


def pack_blocks_twin(storage, out, meta, n, ab, max_len) -> None:
    """out (rows, n-1, ab*D): block i = entries after frame i up to frame i+1, NaN->0, zero-padded."""
    rows, D = meta.shape[1], storage.shape[1]
    if rows == 0 or n < 2:
        return
    env, newest, k = meta[0].view(-1, 1), meta[1].view(-1, 1), meta[2].view(-1, 1)
    back = indexing.block_back(n, ab, meta.device)  # (1, (n-1)*ab): block i ends at frame i+1
    src_rows = indexing.source_rows(env, newest, back, storage.shape[0] // max_len, max_len)
    flat = out.view(rows * (n - 1) * ab, D)
    torch.index_select(storage, 0, src_rows, out=flat)
    if out.dtype.is_floating_point:
        torch.nan_to_num(out, nan=0.0, out=out)
    out.masked_fill_(indexing.zero_block_mask(n, k), 0)


PACK_BLOCKS = Op("history_pack_blocks",
                  "(Tensor storage, Tensor(a!) out, Tensor meta, int n, int ab, int max_len) -> ()",
                  pack_blocks_twin, kernel("history", "pack_blocks"))
