"""The one Triton reader of a launch table's row (the tables :mod:`gpubuf.kernels` describes)."""

import triton
import triton.language as tl


@triton.jit
def table_entry(table_ptr, g, WIDTH: tl.constexpr, like_ptr):
    """``(source, destination, words per row)`` of pair ``g`` in a table of ``WIDTH`` int64 per
    pair, the two addresses typed as ``like_ptr`` (the group's word pointer)."""
    src = tl.load(table_ptr + WIDTH * g).to(like_ptr.dtype)
    dst = tl.load(table_ptr + WIDTH * g + 1).to(like_ptr.dtype)
    return src, dst, tl.load(table_ptr + WIDTH * g + 2)
