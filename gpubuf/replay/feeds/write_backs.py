"""Write-backs that never land on a recycled row: the generation of each sampled start, and the check and
write of values a learner sends back later (priorities, stored latents).

A row's **generation** identifies what it holds: ``base + serial``, where ``serial`` counts the rows the buffer
ever wrote before it (the ``step`` of :meth:`~gpubuf.TransitionBuffer.locate`) and ``base``, random per buffer (a
re-opened ``storage_dir`` does not share it), grows past every generation handed out whenever the rows are replaced
wholesale (a ``load_state_dict``). So a flat start sampled with generation ``g`` still holds what was sampled
exactly while its generation is ``g``: once the ring overwrote the row (or a load replaced it), it differs.
Computed from the ring's counters on the indices' device: nothing is stored per row, nothing is read back."""

import numpy as np
import torch

from gpubuf._core.concurrency import locked
from gpubuf._core.inputs import as_tensor, check_cast, index_array
from gpubuf._core.signals import signals_held
from gpubuf.replay.config import IS_LAST


def generations(ring, idx: torch.Tensor) -> torch.Tensor:
    """``(B,)`` int64 generations of held flat starts ``idx`` (B,) int64, on their device (no read-back)."""
    return generations_at(origin(ring), idx)


def origin(ring) -> tuple[int, int, int, int, int]:
    """What held rows' generations depend on now: ``(n_envs, max_rows, pos, count, base + total)`` (host ints)."""
    return ring.n_envs, ring.max_rows, ring.pos, ring.count, ring.base + ring.total


def generations_at(at: tuple, idx: torch.Tensor) -> torch.Tensor:
    """``(B,)`` int64 generations of flat starts ``idx`` (B,) int64 held when the ring was at :func:`origin`
    ``at``, on their device: the oldest row held is generation ``base + total - count``, each later row one more."""
    n_envs, max_rows, pos, count, end = at
    row = torch.div(idx, n_envs, rounding_mode="floor")
    return (row - (pos - count) % max_rows).remainder(max_rows) + (end - count)


def current(ring, idx: torch.Tensor, given) -> torch.Tensor:
    """``(K,)`` bool on ``idx``'s device: which flat starts ``idx`` (K,) integer still hold the generation
    ``given`` (K,) they were sampled with (a row since overwritten, or no longer held, does not). ``ValueError``
    naming ``generations`` for a misshapen or non-integer ``given``."""
    g = as_tensor(np.asarray(given) if isinstance(given, (list, tuple)) else given, "generations")
    if g.dim() != 1 or g.shape[0] != idx.shape[0] or g.dtype.is_floating_point or g.dtype.is_complex \
            or g.dtype == torch.bool:
        raise ValueError(f"generations: expected a 1-D integer array of {idx.shape[0]} values (one per index, as "
                         f"a sampled Batch's generations hold them), got {g.dtype} of shape {tuple(g.shape)}")
    now = generations(ring, idx.to(torch.int64))
    held = now < ring.base + ring.total  # its age below the rows held
    return held & (now == g.to(device=idx.device, dtype=torch.int64))


def check_range(ring, idx: torch.Tensor) -> None:
    """``IndexError`` naming ``indices`` for a flat start outside ``[0, M * E)`` (one read-back)."""
    size = ring.max_rows * ring.n_envs
    if idx.numel() and bool(((idx < 0) | (idx >= size)).any()):
        bad = idx[(idx < 0) | (idx >= size)][:5].tolist()
        raise IndexError(f"indices: expected flat starts in [0, {size}), got {bad}")


def row_values(config, values, B: int, n_steps: int) -> dict:
    """``{path: (tensor, windows)}`` of ``values`` ``{name: (B, ...)}`` checked against the buffer's ``info`` leaves
    (not ``is_last``): a leaf's ``(B, *shape)`` values go to the start rows, ``(B, n_steps, *shape)`` ones (``n_steps >
    1``) to every row of the windows (``windows`` True). ``ValueError``/``TypeError`` naming ``values``."""
    allowed = sorted(leaf.path[1] for leaf in config.leaves
                     if leaf.path[0] == "info" and len(leaf.path) == 2 and leaf.path != IS_LAST)
    if not isinstance(values, dict) or not values:
        raise TypeError(f"values: expected a non-empty dict {{info leaf name: (B, ...) values}} of the leaves "
                        f"{allowed}, got {values!r:.80}")
    out = {}
    for name, value in values.items():
        if name not in allowed:
            raise ValueError(f"values: expected names of the buffer's info leaves {allowed} (observations, actions, "
                             f"rewards and flags are not written back), got {name!r}")
        leaf = config.by_path[("info", name)]
        t = as_tensor(np.asarray(value) if isinstance(value, (list, tuple)) else value, f"values[{name!r}]")
        shapes = [(B, *leaf.shape)] + ([(B, n_steps, *leaf.shape)] if n_steps > 1 else [])
        if tuple(t.shape) not in shapes:
            raise ValueError(f"values[{name!r}]: expected shape {' or '.join(map(str, shapes))}, got {tuple(t.shape)}")
        check_cast(t, leaf.dtype, f"values[{name!r}]")
        out[leaf.path] = (t, t.dim() > len(shapes[0]))
    return out


def write_rows(storage, ring, idx: torch.Tensor, values: dict, n_steps: int) -> None:
    """Write checked ``values`` (:func:`row_values`) at flat starts ``idx`` (K,) int64 (the start rows, or the
    ``n_steps`` rows of each window) of ``storage``'s ``(M, E, ...)`` leaves."""
    E, M = ring.n_envs, ring.max_rows
    dev = storage.device
    idx = idx.to(dev)
    row, env = torch.div(idx, E, rounding_mode="floor"), idx.remainder(E)
    for path, (t, windows) in values.items():
        data = storage.data[path]
        rows, envs = row, env
        if windows:
            rows = (row[:, None] + torch.arange(n_steps, device=dev)).remainder(M)
            envs = env[:, None].expand_as(rows)
        key = (rows, envs) if storage.config.vectorized_env else (rows,)
        data.index_put_(key, t.to(device=dev, dtype=data.dtype))


class WriteBackDoors:
    """The doors that write into held rows (``update_rows``, ``cut_episodes``), mixed into
    :class:`~gpubuf.TransitionBuffer`, which provides ``lock``, ``config``, ``storage``, ``ring`` and ``parts``."""

    # write-backs the last update_rows / update_priorities call given generations dropped (their rows
    # were overwritten since the sample); 0 after a call without generations
    stale_updates = 0

    @torch.compiler.disable
    @locked
    def update_rows(self, indices, values: dict, *, generations=None):
        """Write ``values`` ``{name: (B, ...)}`` into the stored ``info`` leaves (say latents a world model computed
        from the sampled windows) at flat starts ``indices`` (B,); returns ``self``. A leaf's ``(B, *shape)`` values go
        to the start rows; with ``n_steps > 1``, ``(B, n_steps, *shape)`` values go to every row of the windows. With
        ``generations`` (from ``sample(..., return_generations=True)``) the starts whose rows were overwritten since the
        sample are skipped, and :attr:`stale_updates` counts them. Duplicate starts: one of their values is kept.
        Observations, actions, rewards and flags are not written back.

        Raises (writing nothing) on a name that is not an ``info`` leaf, a misshapen value or one its leaf's dtype
        cannot hold, non-integer indices or ones outside ``[0, max_size)`` (``IndexError``), a rows not held
        (``IndexError``, without ``generations``), or a closed ``storage_dir`` buffer; on a ``storage_dir`` the values
        reach the files as the other rows do (made durable by ``flush()``)."""
        self.storage.check_open()
        idx = index_array(indices).to(torch.int64)
        checked = row_values(self.config, values, idx.shape[0], self.config.n_steps)
        check_range(self.ring, idx)
        if generations is None:
            self.stale_updates = 0
            self.ring.locate(idx.cpu().numpy())  # IndexError for a row not held
        else:
            keep = self._current(idx, generations)
            idx = idx[keep]
            checked = {p: (t[keep.to(t.device)], w) for p, (t, w) in checked.items()}
        if idx.numel():
            with signals_held():
                write_rows(self.storage, self.ring, idx, checked, self.config.n_steps)
        return self

    def _current(self, idx: torch.Tensor, generations) -> torch.Tensor:
        """Mask of flat starts ``idx`` (K,) still holding ``generations`` (the others: :attr:`stale_updates`)."""
        keep = current(self.ring, idx, generations)
        self.stale_updates = int(keep.numel() - keep.sum())
        return keep

    @torch.compiler.disable
    @locked
    def cut_episodes(self, envs=None):
        """End every env's episode (``envs``: a ``(n_envs,)`` bool mask of the envs to end) at its newest row, in place:
        ``truncated`` is set there (unless that row ends an episode already, a termination say), so no window with
        ``boundaries="mask"``/``"forbid"``, next observation, n-step return or stack reaches past it (its successor
        counts as unknown, as after a truncation whose final observation was not kept). What a source without
        ``info["is_last"]`` rows does when its run is cut (a ``reset()``, the buffer detached). Returns ``self``; an
        empty buffer is left as it is; ``ValueError`` without a ``truncated`` leaf."""
        paths = self.config.paths("truncated")
        if not paths:
            raise ValueError("cut_episodes: the buffer stores no truncated leaf to mark the cut with")
        self.storage.check_open()
        ring = self.ring
        if ring.count == 0:
            return self
        row = (ring.pos - 1) % ring.max_rows
        cut = ~ring.ends[row]  # a row that already ends an episode (terminated: drawn with discount 0) stays
        if envs is not None:
            cut &= np.asarray(envs, bool)
        if not cut.any():
            return self
        mask = torch.from_numpy(cut)
        with signals_held():
            for path in paths:
                t = self.storage.data[path]
                if self.config.vectorized_env:
                    t[row][mask.to(t.device)] = True  # (E, ...) view of the row: written through
                else:
                    t[row] = True
            ring.truncate_row(row, cut)
            for part in self.parts:  # in the buffer's order of parts
                part.row_cut(row)
        return self
