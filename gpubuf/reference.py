"""Pure-torch twins of every Triton kernel: the CPU path and the tests' oracle.

Each function has the signature of its kernel launcher in ``kernels/`` and writes into the same
preallocated outputs. Vectorised torch only: no Python loop over envs or samples.
"""

import torch

# ---------------------------------------------------------------- HistoryBuffer (kernels/history.py)


def history_append(storage: torch.Tensor, rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """storage (n_envs*max_len, E)[dst_rows (R,)] = rows (R, E); dst_rows distinct."""
    storage.index_copy_(0, dst_rows, rows)


def _frame_back(meta: torch.Tensor, n: int, ab: int) -> torch.Tensor:
    """(rows, n) how many env steps before the newest entry each output frame lies."""
    j = torch.arange(n, device=meta.device)
    k = meta[2].unsqueeze(1)
    return torch.minimum(n - 1 - j, k - 1) * ab


def history_gather_frames(storage, meta, n, ab, max_len, out) -> None:
    """out (rows, n, E) = strided frames, left-padded with the oldest strided entry."""
    rows = meta.shape[1]
    if rows == 0:
        return
    env, newest = meta[0].unsqueeze(1), meta[1].unsqueeze(1)
    slot = (newest - _frame_back(meta, n, ab)) % max_len  # (rows, n)
    src_rows = (env * max_len + slot).reshape(-1)
    torch.index_select(storage, 0, src_rows, out=out.view(rows * n, storage.shape[1]))


def history_pack_blocks(storage, meta, n, ab, max_len, out) -> None:
    """out (rows, n-1, ab*D): block i = entries after frame i up to frame i+1, NaN->0, zero-padded."""
    rows, D = meta.shape[1], storage.shape[1]
    if rows == 0 or n < 2:
        return
    env, newest, k = meta[0].view(-1, 1, 1), meta[1].view(-1, 1, 1), meta[2].view(-1, 1)
    i = torch.arange(n - 1, device=meta.device).view(1, -1, 1)
    t = torch.arange(ab, device=meta.device).view(1, 1, -1)
    slot = (newest - (n - 2 - i) * ab - (ab - 1 - t)) % max_len  # (rows, n-1, ab)
    src_rows = (env * max_len + slot).reshape(-1)
    flat = out.view(rows * (n - 1) * ab, D)
    torch.index_select(storage, 0, src_rows, out=flat)
    if out.dtype.is_floating_point:
        torch.nan_to_num(out, nan=0.0, out=out)
    zero = torch.arange(n - 1, device=meta.device).view(1, -1) < (n - k)  # (rows, n-1)
    out.masked_fill_(zero.unsqueeze(-1), 0)
