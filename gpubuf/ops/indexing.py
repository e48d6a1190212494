"""The index arithmetic of the ops, written once: which storage rows an output reads, how warm-up
pads, which blocks are zero. The pure-torch twins (the reference) compute their row indices here, and
so do the buffers' host-side fast paths and the tables the Triton launchers receive; the kernels
themselves repeat these rules in Triton, checked against the twins by the kernel tests.

Plain integer arithmetic works on Python ints, numpy arrays and tensors alike; the functions that
build index tensors take a device and cache small results.
"""

import torch

from gpubuf.kernels import MARK_BOUNDARY, MARK_STOP, MARK_TERM
from gpubuf.ops.device import LRU

# Index tensors cached per (n, device) and (n, ab, device): 16 of each at most, and only those of at
# most _CACHED elements (512 KiB of int64), so the caches hold at most 16 MiB whatever ``n`` callers
# ask for; larger ones are built per call.
_CACHED = 1 << 16
_COUNTDOWNS = LRU(16)
_BLOCK_BACKS = LRU(16)


def countdown(n: int, device: torch.device) -> torch.Tensor:
    """(n,) int64: n-1, n-2, ..., 0."""
    if n > _CACHED:
        return _make_countdown(n, device)
    return _COUNTDOWNS.get((n, device), _make_countdown, n, device)


def _make_countdown(n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n - 1, -1, -1, device=device)


# --- history
# Storage of one key is slot-major ``(max_len * n_envs, D)``: env ``e``'s ring slot ``s`` is row
# ``s * n_envs + e``. An env's newest entry is at slot ``head - 1``; ``k`` is the number of strided
# frames (every ``ab``-th entry back from the newest) that a read of ``n`` frames uses.


def newest_slot(heads, max_len: int):
    """The ring slot of the newest entry, from the write heads (ints, arrays or tensors)."""
    return (heads - 1) % max_len


def strided(counts, ab: int):
    """Strided entries held by envs holding ``counts >= 1`` entries: ``(counts - 1) // ab + 1``."""
    return (counts - 1) // ab + 1


def frame_back(n: int, k, ab: int, device: torch.device) -> torch.Tensor:
    """Env steps before the newest entry of each of ``n`` output frames, oldest first: ``(n,)`` for an
    int ``k``, ``(rows, n)`` for ``k`` ``(rows, 1)``. Warm-up (``k < n``) clamps the first ``n - k``
    frames to the oldest strided entry."""
    back = countdown(n, device)
    return (torch.minimum(back, k - 1) if isinstance(k, torch.Tensor) else back.clamp(max=k - 1)) * ab


def block_back(n: int, ab: int, device: torch.device) -> torch.Tensor:
    """(1, (n-1)*ab) int64: env steps before the newest entry of each entry of the ``n - 1`` action
    blocks (block ``i`` holds the ``ab`` entries after frame ``i`` up to frame ``i + 1``)."""
    if (n - 1) * ab > _CACHED:
        return _make_block_back(n, ab, device)
    return _BLOCK_BACKS.get((n, ab, device), _make_block_back, n, ab, device)


def _make_block_back(n: int, ab: int, device: torch.device) -> torch.Tensor:
    return (countdown(n - 1, device).view(-1, 1) * ab + countdown(ab, device)).view(1, -1)


def source_rows(env, newest, back: torch.Tensor, n_envs: int, max_len: int) -> torch.Tensor:
    """Flat storage rows of the entries ``back`` env steps before slot ``newest`` of env ``env``
    (``env``, ``newest``: ints or ``(rows, 1)`` tensors; ``back`` ``(..., m)``), row-major."""
    return ((newest - back) % max_len * n_envs + env).reshape(-1)


def zero_blocks(n: int, k):
    """Leading zero blocks of a read of ``n`` frames: ``n - k`` (warm-up, before the first strided frame)."""
    return n - k


def zero_block_mask(n: int, k: torch.Tensor) -> torch.Tensor:
    """(rows, n-1, 1) bool: the zero blocks (:func:`zero_blocks`) of rows using ``k`` ``(rows, 1)`` strided frames."""
    # block i (countdown n-2-i) is zero when i < zero_blocks(n, k) = n - k, i.e. when n-2-i >= k-1
    return countdown(n - 1, k.device).view(1, -1, 1) >= k.view(-1, 1, 1) - 1


# --- sequences and stacks
# Replay storage of one leaf is ``(M * E, D)``: row ``step * E + env`` (time-major) or ``env * M + step``
# (``env_major``: a ``storage_dir``'s files). A flat start ``s = step * E + env`` begins a window of ``n`` rows
# ``step + j`` (modulo ``M``). ``marks`` (M*E,) uint8 holds each time-major row's ``MARK_*`` bits, ``held``
# (2,) int64 the oldest row held and the rows held (:mod:`gpubuf.ops.stacks` states the rules).


def flat_rows(step, env, E: int, M: int, env_major: bool = False):
    """Storage rows of ring rows ``step`` of envs ``env``: ``step * E + env``, or ``env * M + step`` ``env_major``."""
    return env * M + step if env_major else step * E + env


def window_rows(starts: torch.Tensor, n: int, shift: int, E: int, M: int) -> torch.Tensor:
    """(B * n,) time-major rows of the windows of flat starts (B,) (``starts`` itself for n=1, shift=0)."""
    if n == 1 and shift == 0:
        return starts  # row of start s = step * E + env is s itself
    # (step + j) * E + env = s + j * E, wrapped modulo the M * E rows
    j = torch.arange(shift * E, (n + shift) * E, E, device=starts.device)
    return (starts.unsqueeze(1) + j).remainder_(M * E).view(-1)


def stack_steps(step, env, marks, oldest, n: int, k: int, stride: int, shift: int, E: int, M: int, arange):
    """(B, n, k) ring rows of the ``k``-frame stacks ending at rows ``(step + j + shift) % M``, j < n, of starts at rows
    ``step`` of envs ``env`` (both ``(B, 1, 1)``), ``oldest`` the oldest row held: frame ``q`` is ``min((k - 1 - q) *
    stride, back)`` rows back, ``back`` the held rows before it in its episode (after no ``MARK_BOUNDARY``). Numpy
    arrays or tensors alike (``arange``: ``np.arange``, or ``torch.arange`` on their device): the twins run it on the
    host in numpy, whose small index arithmetic costs less than torch's."""
    t = (step + arange(shift, n + shift).reshape(1, n, 1)) % M  # (B, n, 1)
    back = t * 0
    if (k - 1) * stride:
        i = arange(1, (k - 1) * stride + 1)  # (W,) rows back
        ok = (i <= (t - oldest) % M) & (marks[(t - i) % M * E + env] & MARK_BOUNDARY == 0)  # (B, n, W)
        back = ok.cumprod(2).sum(2)[..., None]  # (B, n, 1) first stop
    reach = arange(k - 1, -1, -1) * stride  # (k,) rows back per frame
    return (t - reach + (reach - back).clip(min=0)) % M  # back by min(reach, back)


def return_rewards(r, env, marks, oldest, count, n: int, E: int, M: int, arange):
    """``(ring rows (B, n), taken (B, n) bool, ends (B, n) bool)`` of the n-step returns from rows ``r`` of envs ``env``
    (both ``(B, 1)``), ``count`` rows held from ``oldest``: reward ``i`` is taken unless a ``MARK_STOP`` row after the
    first (not also ``MARK_TERM``) or a row whose next row is not held comes at or before it, or a ``MARK_TERM`` row
    before it; ``ends``: the rows marked ``MARK_TERM``. Numpy arrays or tensors alike, as :func:`stack_steps`."""
    i = arange(n)
    step = (r + i) % M  # (B, n)
    mark = marks[step * E + env]
    ends = mark & MARK_TERM != 0
    avail = count - 1 - (r - oldest) % M  # (B, 1) held rows after the start
    blocked = ((i >= 1) & (mark & MARK_STOP != 0) & ~ends) | (i >= avail)
    blocked[:, 1:] |= ends[:, :-1]
    return step, (~blocked).cumprod(1) != 0, ends
