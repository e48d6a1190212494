"""Advice to the kernel about host memory through libc's ``madvise``: read-ahead hints for mapped
files (:mod:`gpubuf.replay.storage.tiers`), huge pages under large fresh outputs (:mod:`gpubuf.history`).
Hints only: where ``madvise`` is missing or refuses, nothing changes."""

import ctypes
import mmap

import torch

_HUGE_PAGE = 2 << 20


def _libc_madvise():
    """libc's ``madvise(addr, length, advice)``, or None where it cannot be had."""
    if not hasattr(mmap, "MADV_WILLNEED"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


MADVISE = _libc_madvise()


def advise_huge(t: torch.Tensor) -> None:
    """Ask for transparent huge pages under a fresh (untouched) host tensor: its first write then
    faults once per 2 MiB instead of once per 4 KiB (Linux; elsewhere nothing happens)."""
    if MADVISE is None or not hasattr(mmap, "MADV_HUGEPAGE"):
        return
    ptr = t.data_ptr()
    lo = -(-ptr // _HUGE_PAGE) * _HUGE_PAGE
    hi = (ptr + t.numel() * t.element_size()) // _HUGE_PAGE * _HUGE_PAGE
    if hi > lo:
        MADVISE(lo, hi - lo, mmap.MADV_HUGEPAGE)
