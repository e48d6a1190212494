"""Triton kernels and their launchers (shipped as ``gpubuf.kernels``); the only place importing triton.

Copy kernels serve many keys (leaves) per launch: the launcher views each ``(source, destination)`` pair
as rows of int words (:func:`gpubuf.reference.as_words`), groups pairs by word type, and uploads one int64
table per group (``source address, destination address, words per row, extra ints...`` per pair); one
launch per group reads its pair's row from the table with ``tl.program_id(1)``.

Triton launches on the current CUDA device, not on its arguments' device: every launcher runs its
launches under :func:`on_device` of its tensors (a buffer on ``cuda:1`` launches on ``cuda:1`` whatever the
current device is).
"""

import contextlib

import numpy as np
import torch

from gpubuf.reference import as_words
from gpubuf.staging import Staging

_STAGING: dict[torch.device, Staging] = {}


def on_device(t: torch.Tensor):
    """Context making ``t``'s CUDA device current while kernels launch (``torch.cuda.device``); a no-op for host
    tensors (interpreted kernels)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def word_groups(pairs: list, extra: list | None = None) -> list[tuple[torch.Tensor, np.ndarray, int]]:
    """``(anchor, table, most words per row)`` per word type for contiguous 2-D ``(src, dst)`` ``pairs``.

    ``anchor`` is the first pair's source word view (its pointer type names the group's word); ``table`` is
    ``(G, 3 + len(extra[i]))`` host int64: source and destination addresses, words per row, then the pair's
    ``extra`` ints. Pairs with zero-width rows are left out.
    """
    groups: dict[torch.dtype, list] = {}
    for i, (src, dst) in enumerate(pairs):
        if src.shape[1] == 0:
            continue
        s, d = as_words(src, dst)
        groups.setdefault(s.dtype, []).append((s, d, () if extra is None else extra[i]))
    out = []
    for members in groups.values():
        table = np.array([[s.data_ptr(), d.data_ptr(), s.shape[1], *x] for s, d, x in members], dtype=np.int64)
        out.append((members[0][0], table, int(table[:, 2].max())))
    return out


def upload(table: np.ndarray, device: torch.device, key: str) -> torch.Tensor:
    """``table`` on ``device`` (through a reusable pinned ring on CUDA: one non-blocking copy)."""
    staging = _STAGING.get(device)
    if staging is None:
        staging = _STAGING[device] = Staging(device)
    return staging.to_device(torch.from_numpy(np.ascontiguousarray(table)), key)
