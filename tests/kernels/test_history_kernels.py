"""Each HistoryBuffer Triton kernel against its pure-torch twin on random, odd-sized, index-valued inputs.

Tensors live on ``DEVICE``: the GPU when one is present (Triton natively), else the host (the interpreter,
set on in conftest); both sides then run on the same device and compare exactly."""

import numpy as np
import pytest
import torch

from gpubuf.kernels import history as kernels
from gpubuf.kernels.words import as_words
from gpubuf.ops.history import append_twin, gather_frames_twin, pack_blocks_twin

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

DTYPES = [torch.uint8, torch.int32, torch.float16, torch.float32, torch.float64, torch.bool]


def index_storage(rows, E, dtype):
    """(rows, E) storage whose values encode their own index (wrapping for narrow dtypes)."""
    v = torch.arange(rows * E).reshape(rows, E)
    if dtype == torch.bool:
        return (v % 3 == 0)
    if dtype == torch.uint8:
        return (v % 251).to(dtype)
    if dtype == torch.float16:
        return (v % 2039).to(dtype)
    return v.to(dtype)


def random_meta(g, n_envs, max_len, rows, n, ab):
    env = torch.randint(0, n_envs, (rows,), generator=g)
    newest = torch.randint(0, max_len, (rows,), generator=g)
    L = torch.randint(1, max_len + 1, (rows,), generator=g)
    k = torch.minimum(torch.full_like(L, n), (L - 1) // ab + 1)
    return torch.stack([env, newest, k])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_append_matches_reference(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    n_envs, max_len, E = 5, 3, int(torch.randint(1, 40, (1,), generator=g))
    dst_rows = torch.randperm(n_envs * max_len, generator=g)[:7].to(DEVICE)
    # keys of one call: this dtype at two widths (one launch group), bytes of odd width, an empty key
    keys = [(dtype, E), (dtype, 2 * E + 1), (torch.uint8, 3), (torch.float32, 0)]
    rows = [index_storage(7, w, d).to(DEVICE) for d, w in keys]
    a = [torch.zeros(n_envs * max_len, w, dtype=d, device=DEVICE) for d, w in keys]
    b = [t.clone() for t in a]
    kernels.append(a, rows, dst_rows)
    append_twin(b, rows, dst_rows)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert all(torch.equal(x[dst_rows], r) for x, r in zip(b, rows, strict=True))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,ab", [(1, 1), (3, 2), (4, 3), (5, 1)])
def test_gather_frames_matches_reference(dtype, n, ab):
    g = torch.Generator().manual_seed(n * 10 + ab)
    n_envs, max_len, rows, E = 4, 7, 5, 13
    storage = index_storage(n_envs * max_len, E, dtype).to(DEVICE)
    meta = random_meta(g, n_envs, max_len, rows, n, ab).to(DEVICE)
    wide = index_storage(n_envs * max_len, 2 * E + 3, dtype).to(DEVICE)  # a second key of another width, same call
    a = [torch.empty(rows, n, E, dtype=dtype, device=DEVICE), torch.empty(rows, n, 2 * E + 3, dtype=dtype,
                                                                          device=DEVICE)]
    b = [torch.empty_like(t) for t in a]
    kernels.gather_frames([storage, wide], a, meta, n, ab, max_len)
    gather_frames_twin([storage, wide], b, meta, n, ab, max_len)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("dtype", DTYPES + [torch.bfloat16, torch.int8])
@pytest.mark.parametrize("n,ab", [(2, 1), (3, 2), (4, 3)])
def test_pack_blocks_matches_reference(dtype, n, ab):
    g = torch.Generator().manual_seed(n * 10 + ab)
    n_envs, max_len, rows, D = 3, 8, 6, 5
    storage = index_storage(n_envs * max_len, D, dtype)
    if dtype.is_floating_point:  # NaN and infinities must be cleaned the same way
        storage.view(-1)[::7] = float("nan")
        storage.view(-1)[3::11] = float("inf")
        storage.view(-1)[5::13] = -float("inf")
    storage = storage.to(DEVICE)
    meta = random_meta(g, n_envs, max_len, rows, n, ab).to(DEVICE)
    a = torch.full((rows, n - 1, ab * D), 77, dtype=dtype, device=DEVICE)
    b = torch.full((rows, n - 1, ab * D), 66, dtype=dtype, device=DEVICE)
    kernels.pack_blocks(storage, a, meta, n, ab, max_len)
    pack_blocks_twin(storage, b, meta, n, ab, max_len)
    assert torch.equal(a, b)
    assert not torch.isnan(a.float()).any()


def test_word_views_cover_odd_row_bytes():
    for E in [1, 3, 6, 12]:
        t = torch.zeros(4, E, dtype=torch.uint8)
        (w,) = as_words(t)
        assert w.shape[1] * w.element_size() == E and w.data_ptr() == t.data_ptr()
    assert np.all([as_words(torch.zeros(2, 3, dtype=d))[0].shape[0] == 2 for d in DTYPES])


def test_word_views_share_one_word_across_offsets_and_size_one_strides():
    storage = torch.zeros(4, 16, dtype=torch.uint8)
    rows = torch.zeros(100, dtype=torch.uint8)[3:3 + 32].view(2, 16)  # contiguous, byte offset 3
    a, b = as_words(storage, rows)
    assert a.dtype == b.dtype == torch.uint8 and a.shape[1] == b.shape[1] == 16
    a, b = as_words(storage, torch.zeros(100, dtype=torch.uint8)[8:40].view(2, 16))
    assert a.dtype == b.dtype == torch.int64
    (c,) = as_words(torch.zeros(3, dtype=torch.float32).as_strided((3, 1), (1, 0)))  # any stride on size 1
    assert c.shape == (3, 1) and c.dtype == torch.int32
