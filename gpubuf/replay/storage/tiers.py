"""Storage tiers of the replay buffers: where the transitions live (:mod:`gpubuf.replay.storage.memory`), apart from
where sampling runs (:func:`storage_device_for`). The memory-mapped files of a ``storage_dir`` are env-major ``(E,
M, *shape)``: one env's consecutive steps are adjacent, so a sampled window is one contiguous read; they are gathered
with :func:`env_major_gather` (flat starts stay ``step * E + env`` as in every other tier).

Reading a mapped file: the kernel reads ahead around every page fault (up to ``read_ahead_kb``), which for random
windows reads many times the bytes asked for (README, Benchmarks: Memory-mapped replay). The leaf mappings are
therefore advised ``MADV_RANDOM`` (no readahead), and before gathering, every window of a leaf whose window spans at
least a page is advised ``MADV_WILLNEED``: the kernel then reads all of a batch's windows in parallel instead of one
page fault after another (Linux; elsewhere both are skipped).

The host RAM tier (``storage_device="cpu"``) stays time-major ``(M, E, *shape)`` like device storage: in RAM,
env-major gathered frame windows somewhat faster but float leaves slower (the env-major row index costs a division
and a modulo more; README, Benchmarks: Memory-mapped replay), and every insert of ``T`` rows scatters into ``E``
places instead of one."""

import mmap

import torch

from gpubuf._core.host_memory import MADVISE
from gpubuf.ops import as_words, resolve_device

_MADVISE = MADVISE  # read through this name, so that a test may count the calls


def advise(address: int, nbytes: int, advice: int) -> None:
    """``madvise`` the pages holding bytes ``[address, address + nbytes)`` of a mapping; a hint: where ``madvise`` is
    missing or refuses, nothing happens."""
    if _MADVISE is not None and nbytes > 0:
        lo = address - address % mmap.PAGESIZE
        _MADVISE(lo, address + nbytes - lo, advice)


def prefetch_windows(storage: torch.Tensor, first_rows: torch.Tensor, n: int, M: int) -> None:
    """Ask the kernel to read, in parallel, the windows of ``n`` rows of a mapped env-major ``storage`` (E*M, D)
    starting at rows ``first_rows`` (B,) (a window that runs past its env's last row ``M - 1`` continues at the env's
    first). Only for windows of at least a page; smaller leaves read few pages."""
    row_bytes = storage.shape[1] * storage.element_size()
    if _MADVISE is None or n * row_bytes < mmap.PAGESIZE:
        return
    base, willneed = storage.data_ptr(), mmap.MADV_WILLNEED
    for row in first_rows.tolist():
        env_first = row - row % M
        head = min(n, env_first + M - row)  # rows before the window wraps to the env's first row
        advise(base + row * row_bytes, head * row_bytes, willneed)
        if head < n:
            advise(base + env_first * row_bytes, (n - head) * row_bytes, willneed)


def _named_device(name: str, value) -> torch.device:
    """``value`` resolved as a device; a value that names none raises ``ValueError`` naming ``name``."""
    try:
        return resolve_device(value)
    except ValueError:
        raise ValueError(f"{name}: expected None, 'cpu' or a torch device, got {value!r}") from None


def storage_device_for(device: torch.device, storage_device, storage_dir) -> torch.device:
    """The device the storage lives on: ``device`` unless ``storage_device`` says ``"cpu"`` or a ``storage_dir`` is
    given (memory-mapped files are host memory)."""
    if storage_dir is not None:
        if storage_device is not None and str(storage_device) not in ("cpu", "cpu:0"):
            raise ValueError("storage_device: a storage_dir maps files into host memory; expected None or 'cpu', "
                             f"got {storage_device!r}")
        return torch.device("cpu")
    if storage_device is None:
        return device
    resolved = _named_device("storage_device", storage_device)
    if resolved != device and resolved.type != "cpu":
        raise ValueError(f"storage_device: expected None, 'cpu' or the buffer's device {device}, "
                         f"got {storage_device!r}")
    return resolved


def env_major_gather(jobs: list, starts: torch.Tensor, n: int, E: int, M: int, prefetch: bool = False) -> None:
    """For each ``(storage (E*M, D), out (B, n, D), shift)`` in ``jobs``: out = storage rows ``(start % E) * M +
    (start // E + j + shift) % M``, j < n, for flat starts ``step * E + env`` (B,): the windows of
    :func:`gpubuf.ops.sequence.gather_twin` from env-major storage. Host tensors; rows are computed once per distinct
    shift. ``prefetch``: the storages are file mappings (:func:`prefetch_windows` first)."""
    B = starts.shape[0]
    if B == 0:
        return
    env_row, step = (starts % E).mul_(M).unsqueeze_(1), (starts // E).unsqueeze_(1)  # (B, 1) each
    rows = {}
    for storage, out, shift in jobs:
        if shift not in rows:
            j = torch.arange(shift, n + shift, device=starts.device)
            rows[shift] = (step + j).remainder_(M).add_(env_row).view(-1)  # (B * n,)
        src, dst = as_words(storage, out.view(B * n, storage.shape[1]))
        if prefetch:
            prefetch_windows(src, rows[shift][::n], n, M)
        torch.index_select(src, 0, rows[shift], out=dst)
