"""Rows as int words: copy kernels move storage rows as the widest int word dividing them.

No Triton here: the torch twins and the buffers use :func:`as_words` too
(``import gpubuf`` stays free of Triton).
"""

import torch

WORDS = ("i64", "i32", "i16", "u8")  # the Triton pointer types of what as_words makes of any row


def as_words(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Views of contiguous 2-D tensors with equal row bytes as rows of one common int word type.

    The widest of int64/int32/int16/uint8 that divides the row's bytes and every tensor's byte
    offset; for pure copies, moving int64 words instead of bytes is what makes a gather run at
    memcpy speed.
    """
    if all(t.dtype == torch.int64 and t.stride(-1) == 1 for t in tensors):
        return tensors  # already rows of the widest word (the buffers' own word views)
    row_bytes = tensors[0].shape[1] * tensors[0].element_size()
    if row_bytes == 0:  # zero-width rows: nothing to move, any view will do
        return tuple(_canonical(t).view(torch.uint8) for t in tensors)
    for word, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2), (torch.uint8, 1)):
        if row_bytes % size == 0 and all(t.storage_offset() * t.element_size() % size == 0
                                         for t in tensors):
            return tuple(t if t.dtype == word and t.stride(-1) == 1 else
                         (t if t.stride(-1) == 1 else _canonical(t)).view(torch.uint8).view(word)
                         for t in tensors)
    raise AssertionError("unreachable: every row divides into bytes")


def _canonical(t: torch.Tensor) -> torch.Tensor:
    """Contiguous 2-D ``t`` with row-major strides
    (a size-1 dim may carry any stride, which ``view`` rejects)."""
    return t.as_strided(t.shape, (t.shape[1], 1), t.storage_offset())
