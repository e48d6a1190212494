"""Triton kernels of HistoryBuffer: append scatter, strided history gather, action-block packing.

Storage is slot-major (:mod:`gpubuf.ops.history`), a row holding one entry of ``E`` elements: envs
stepping in lockstep write and read whole contiguous blocks. Per-row metadata comes from the host as
an int64 tensor (the host mirrors counts and write heads, so nothing is read back). Runtime sizes
are plain arguments; only block sizes are ``tl.constexpr``. Offsets are int64.
"""

import torch
import triton
import triton.language as tl

import gpubuf.kernels as _pkg
from gpubuf.kernels import INDEX, Variant, upload, variant, word_groups
from gpubuf.kernels.tables import table_entry
from gpubuf.kernels.words import WORDS

BLOCK = 1024
FLOATS = ("fp16", "bf16", "fp32", "fp64")  # action blocks keep their dtype (NaN/inf handling)
INTS = ("u8", "i8", "i16", "i32", "i64")  # bool blocks travel as u8


@triton.jit
def _append_kernel(
    table_ptr,  # (G, 3) int64 per key: source address (R, E) rows, storage address, E words per row
    dst_row_ptr,  # (R,) int64 storage row of each input row: slot * n_envs + env
    like_ptr,  # any tensor of the group's word type (its pointer type types the table's addresses)
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    g = tl.program_id(1)  # key
    src, dst, E = table_entry(table_ptr, g, 3, like_ptr)
    offs = tl.program_id(2).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    # last chunk of the entry is partial; keys narrower than the widest skip whole chunks
    mask = offs < E
    dst_row = tl.load(dst_row_ptr + row)
    x = tl.load(src + row.to(tl.int64) * E + offs, mask=mask)
    tl.store(dst + dst_row * E + offs, x, mask=mask)


@triton.jit
def _gather_frames_kernel(
    # (G, 3) int64 per key: storage address (max_len * n_envs, E), output address (rows, n, E), E
    table_ptr,
    meta_ptr,  # (3, rows) int64: env id, newest slot, k = strided frames used
    like_ptr,  # any tensor of the group's word type
    rows,
    n,  # frames per row
    ab,  # action_block (stride between frames)
    max_len,
    n_envs,
    BLOCK: tl.constexpr,
):
    rf = tl.program_id(0)  # row * n + frame
    g = tl.program_id(1)  # key
    row = rf // n
    j = rf % n
    src, dst, E = table_entry(table_ptr, g, 3, like_ptr)
    offs = tl.program_id(2).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < E
    env = tl.load(meta_ptr + row)
    newest = tl.load(meta_ptr + rows + row)
    k = tl.load(meta_ptr + 2 * rows + row)
    back = tl.minimum(n - 1 - j, k - 1) * ab  # warm-up clamps to the oldest strided entry
    slot = (newest - back + max_len) % max_len
    x = tl.load(src + (slot * n_envs + env) * E + offs, mask=mask)
    tl.store(dst + rf.to(tl.int64) * E + offs, x, mask=mask)


@triton.jit
def _pack_blocks_kernel(
    src_ptr,  # (max_len * n_envs, D) storage
    dst_ptr,  # (rows, n - 1, ab * D) output
    meta_ptr,  # (3, rows) int64: env id, newest slot, k
    rows,
    n,
    ab,
    max_len,
    n_envs,
    D,  # elements per entry
    # (1,) fp32 (fp64 for fp64 storage): the dtype's largest finite value; unused for ints
    fmax_ptr,
    IS_FLOAT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rb = tl.program_id(0)  # row * (n - 1) + block
    row = rb // (n - 1)
    i = rb % (n - 1)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < ab * D
    env = tl.load(meta_ptr + row)
    newest = tl.load(meta_ptr + rows + row)
    k = tl.load(meta_ptr + 2 * rows + row)
    live = tl.where(i >= n - k, ab * D, 0)  # the first (n-1)-(k-1) blocks are zero blocks
    t = offs // D  # entry within the block
    d = offs % D
    last = newest - (n - 2 - i) * ab  # slot of frame i+1, the block's last entry
    slot = (last - (ab - 1 - t) + 2 * max_len) % max_len
    x = tl.load(src_ptr + (slot * n_envs + env) * D + d, mask=offs < live, other=0)
    if IS_FLOAT:
        fmax = tl.load(fmax_ptr)
        x = x.to(fmax.dtype)  # 16-bit floats are compared in fp32 (exact)
        x = tl.where(x != x, 0.0, x)  # NaN -> 0
        x = tl.where(x > fmax, fmax, x)  # +inf -> max
        x = tl.where(x < -fmax, -fmax, x)  # -inf -> min
    tl.store(dst_ptr + rb.to(tl.int64) * (ab * D) + offs, x.to(dst_ptr.dtype.element_ty), mask=mask)


_LIMITS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _finite_max(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A cached 1-element fp32 tensor (fp64 for fp64) holding the dtype's largest finite value
    (what +inf becomes)."""
    key = (dtype, device)
    if key not in _LIMITS:
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        _LIMITS[key] = torch.tensor([torch.finfo(dtype).max], dtype=wide, device=device)
    return _LIMITS[key]


def append(storages: list, rows: list, dst_rows: torch.Tensor) -> None:
    """For each storage (max_len*n_envs, E) of ``storages`` and its ``rows`` (R, E):
    storage[dst_rows] = rows; dst_rows int64 (R,), distinct. One launch per word type."""
    R = dst_rows.shape[0]
    if R == 0:
        return
    with _pkg.on_device(dst_rows):
        for like, table, most in word_groups(list(zip(rows, storages, strict=True))):
            grid = (R, table.shape[0], triton.cdiv(most, BLOCK))
            _append_kernel[grid](upload(table, dst_rows.device), dst_rows, like, BLOCK=BLOCK)


def gather_frames(storages: list, outs: list, meta: torch.Tensor, n: int, ab: int,
                  max_len: int) -> None:
    """For each storage (max_len*n_envs, E) of ``storages`` and its out (rows, n, E) of ``outs``:
    the strided frames of each row; meta (3, rows) int64 (env, newest slot, k). One launch per word
    type."""
    rows = meta.shape[1]
    if rows == 0:
        return
    groups = word_groups([(storage, out.view(rows * n, -1))
                          for storage, out in zip(storages, outs, strict=True)])
    with _pkg.on_device(meta):
        for like, table, most in groups:
            n_envs = storages[0].shape[0] // max_len
            grid = (rows * n, table.shape[0], triton.cdiv(most, BLOCK))
            _gather_frames_kernel[grid](upload(table, meta.device), meta, like, rows, n, ab,
                                        max_len, n_envs, BLOCK=BLOCK)


def pack_blocks(storage: torch.Tensor, out: torch.Tensor, meta: torch.Tensor, n: int, ab: int,
                max_len: int) -> None:
    """out (rows, n-1, ab*D) = the action blocks between strided frames, NaN-free, zero-padded."""
    rows = meta.shape[1]
    D = storage.shape[1]
    if rows == 0 or D == 0 or n < 2:
        return
    is_float = storage.dtype.is_floating_point
    src = storage.view(torch.uint8) if storage.dtype == torch.bool else storage
    dst = out.view(torch.uint8) if out.dtype == torch.bool else out
    grid = (rows * (n - 1), triton.cdiv(ab * D, BLOCK))
    n_envs = src.shape[0] // max_len
    with _pkg.on_device(meta):
        fmax = _finite_max(storage.dtype, storage.device) if is_float else meta
        _pack_blocks_kernel[grid](src, dst, meta, rows, n, ab, max_len, n_envs, D, fmax,
                                  IS_FLOAT=is_float, BLOCK=BLOCK)


def variants() -> list[Variant]:
    """Every (kernel, signature, constexprs) the launchers above compile: per index width, the copy
    kernels per word type and the block packer per dtype."""
    out = []
    for idx in INDEX:
        for w in WORDS:
            table = {"table_ptr": "*i64", "like_ptr": f"*{w}"}
            out.append(variant("history.append", _append_kernel, "table_ptr dst_row_ptr like_ptr",
                               {**table, "dst_row_ptr": "*i64"}, idx, {"BLOCK": BLOCK}))
            out.append(variant("history.gather_frames", _gather_frames_kernel,
                               "table_ptr meta_ptr like_ptr rows n ab max_len n_envs",
                               {**table, "meta_ptr": "*i64"}, idx, {"BLOCK": BLOCK}))
        for dtype in FLOATS + INTS:
            is_float = dtype in FLOATS
            p = f"*{dtype}"
            fmax = ("*fp64" if dtype == "fp64" else "*fp32") if is_float else "*i64"
            out.append(variant("history.pack_blocks", _pack_blocks_kernel,
                               "src_ptr dst_ptr meta_ptr rows n ab max_len n_envs D fmax_ptr",
                               {"src_ptr": p, "dst_ptr": p, "meta_ptr": "*i64", "fmax_ptr": fmax},
                               idx, {"IS_FLOAT": is_float, "BLOCK": BLOCK}))
    return out
