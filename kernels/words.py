"""Rows as int words: copy kernels move storage rows as the widest int word dividing them
(:func:`as_words`), and the torch gathers do for rows of :data:`WIDE_ROW_BYTES` or more
(:func:`gather_word`: the one rule).

No Triton here: the torch twins and the buffers use :func:`as_words` too
(``import gpubuf`` stays free of Triton).
"""

import torch

WORDS = ("i64", "i32", "i16", "u8")  # the Triton pointer types of what as_words makes of any row
# the int words, widest first, with their bytes
WORD_TYPES = ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2), (torch.uint8, 1))
# rows this wide or wider move at memcpy speed as int words; a narrower row of a dtype
# index_select runs on is gathered in that dtype (no view on either side)
WIDE_ROW_BYTES = 64
_NATIVE = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8,
                     torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
                     torch.complex64, torch.complex128))


def gather_word(dtype: torch.dtype, row_bytes: int) -> torch.dtype | None:
    """The int word a torch gather (``index_select``) moves contiguous rows of ``row_bytes``
    bytes of ``dtype`` through, the widest dividing the row, or ``None``: the dtype itself (a row
    under :data:`WIDE_ROW_BYTES` of a dtype ``index_select`` runs on)."""
    if dtype in _NATIVE and row_bytes < WIDE_ROW_BYTES:
        return None
    return next(w for w, size in WORD_TYPES if row_bytes % size == 0)


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
    for word, size in WORD_TYPES:
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
