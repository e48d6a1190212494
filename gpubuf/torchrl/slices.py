"""torchrl's ``SliceSampler`` with its episode boundaries and its draw vectorised.

:class:`SliceSampler` is torchrl's own class (every argument, error, ``info`` entry and state method unchanged); on
the common path (a one-dimensional tensor storage of a ``TensorDict`` on the host, episodes named by
``traj_key`` ids or ``end_key`` flags) it replaces two things:

- **boundaries**: the episode ends come from one comparison over the stored ids (or a copy of the stored
  flags) and one scan for the set flags, in numpy (torchrl makes about ten passes over the storage in torch ops);
  the rules are torchrl's: the last filled row ends an episode until the storage is full, then the last written
  row (the cursor) does, and an episode that wraps past the end of the storage is one episode;
- **the draw**: ``num_slices`` episodes uniformly (not by length), then a start uniformly among those where the
  slice fits, with the same two random calls on the same generator as torchrl (so a seeded draw picks the same
  rows); the rows of the ``done`` / ``terminated`` / ``is_init`` entries are read from those keys alone
  (torchrl gathers every key of every sampled row for them).

Everything else (``span``, ``pad_output``, ``strict_length=False`` with an episode shorter than the slice,
``fragmented``, storages of more than one dimension, ``ListStorage``, GPU boundary search) runs torchrl's own code."""

import weakref

import numpy as np
import torch
from tensordict import TensorDictBase
from torchrl._utils import _replace_last
from torchrl.data.replay_buffers.samplers import SliceSampler as _TorchRLSliceSampler
from torchrl.data.replay_buffers.storages import TensorStorage


def boundaries(signal: np.ndarray, ids: bool, at_capacity: bool, cursor) -> tuple[np.ndarray, ...]:
    """``(start, stop, length)`` (each (K,) int64) of the episodes in the first ``T = len(signal)`` rows of a
    storage, ordered by their last row (an episode wrapping past row ``T - 1`` comes first).

    ``signal`` (T,): episode ids (``ids``: a row ends its episode where the next row's id differs) or end flags. Until
    ``at_capacity`` row ``T - 1`` ends an episode; once full, the ``cursor`` row (the last written) does, the ids of
    rows ``T - 1`` and ``0`` decide whether an episode wraps, and a storage without any end gets one at ``T - 1``."""
    T = signal.shape[0]
    if ids:
        end = np.empty(T, dtype=bool)
        np.not_equal(signal[:-1], signal[1:], out=end[:-1])
        end[-1] = (signal[-1] != signal[0]) if at_capacity else True
    else:
        end = signal.astype(bool)  # a copy: the storage is never written
        if not at_capacity:
            end[-1] = True
    if at_capacity:
        if cursor is not None:
            end[cursor] = True
        if not end.any():
            end[-1] = True
    stop = np.flatnonzero(end)
    start = np.empty_like(stop)
    start[1:] = stop[:-1] + 1
    start[0] = (stop[-1] + 1) % T
    length = stop - start + 1
    length[length <= 0] += T
    return start, stop, length


def _cursor(cursor):
    """The last written row out of torchrl's ``_last_cursor_index`` (an int, a range or a tensor of rows)."""
    if isinstance(cursor, torch.Tensor):
        cursor = cursor.reshape(-1)
        if not cursor.numel():
            raise RuntimeError("cursor must not be an empty tensor.")
        return int(cursor[-1])
    if isinstance(cursor, range):
        if not len(cursor):
            raise RuntimeError("cursor must not be an empty range.")
        return cursor[-1]
    return cursor


class NumpyBoundaries:
    """What a torchrl slice sampler class gets by putting this first among its bases: the episode boundaries of a
    one-dimensional signal on the host from :func:`boundaries` (torchrl's own code for the rest), kept with
    ``cache_values=True`` until the storage is next written."""

    def _find_start_stop_traj(self, *, trajectory=None, end=None, at_capacity: bool, cursor=None, storage=None,
                              source=None):
        signal = trajectory if trajectory is not None else end
        if (signal is None or signal.ndim != 1 or not len(signal) or signal.device.type != "cpu"
                or self._gpu_device is not None):
            return super()._find_start_stop_traj(trajectory=trajectory, end=end, at_capacity=at_capacity,
                                                 cursor=cursor, storage=storage, source=source)
        key = None
        if self.cache_values and storage is not None and hasattr(storage, "_mutation_revision"):
            key = ("gpubuf-boundaries", id(storage), storage._mutation_revision, len(signal),  # noqa: SLF001
                   bool(at_capacity), _cursor(cursor), str(source))
            hit = self._cache.get(key)
            if hit is not None and hit[0]() is storage:  # not another storage at a reused id
                return hit[1]
        found = boundaries(signal.detach().numpy(), trajectory is not None, at_capacity, _cursor(cursor))
        start, stop, length = (torch.from_numpy(x) for x in found)
        out = start.unsqueeze(1), stop.unsqueeze(1), length
        if key is not None:
            for old in [k for k in self._cache if isinstance(k, tuple) and k[:1] == ("gpubuf-boundaries",)]:
                del self._cache[old]
            self._cache[key] = (weakref.ref(storage), out)
        return out


class SliceSampler(NumpyBoundaries, _TorchRLSliceSampler):
    """torchrl's ``SliceSampler`` (same arguments: ``num_slices`` or ``slice_len``, ``traj_key`` / ``end_key`` /
    ``end_keys``, ``strict_length``, ``cache_values``, ``truncated_key``, ``span``, ``pad_output``, ...; same
    ``(index,)`` and ``info``) with vectorised boundaries and draws. Sampling is with replacement; the batch is
    slice-major and flat (``[num_slices * slice_len]``), as torchrl returns it. With ``cache_values=True`` the
    boundaries are reused until the storage is next written (torchrl's rule: it tells writes by the storage's
    revision, so an in-place edit of a stored tensor goes unseen)."""

    def _vectorised(self, storage) -> bool:
        return (not self.fragmented and not self.pad_output and not any(self.span)
                and isinstance(storage, TensorStorage) and storage.ndim == 1)

    def sample(self, storage, batch_size: int):
        if not self._vectorised(storage):
            return super().sample(storage, batch_size)
        if self._batch_size_multiplier is not None:
            batch_size = batch_size * self._batch_size_multiplier
        start, stop, lengths = self._get_stop_and_length(storage)
        if start.shape[1] != storage.ndim:
            raise RuntimeError(f"Expected the end-of-trajectory signal to be {storage.ndim}-dimensional. Got a "
                               f"tensor with shape[1]={start.shape[1]} instead.")
        seq, num = self._adjusted_batch_size(batch_size)
        rows = storage[:]
        short = lengths < seq
        ragged = bool(short.any())
        if (ragged and not self.strict_length) or not isinstance(rows, TensorDictBase):  # torchrl's own path
            return self._sample_slices(lengths, start, stop, seq, num, storage_length=storage.shape[0], storage=storage)
        if ragged:
            if bool(short.all()):
                raise RuntimeError(f"Did not find a single trajectory with sufficient length (length range: "
                                   f"{lengths.min()} - {lengths.max()} / required={seq})).")
            start, lengths = start[~short], lengths[~short]
        traj = torch.randint(lengths.shape[0], (num,), device=lengths.device, generator=self._rng)
        rel = (torch.rand(num, device=lengths.device, generator=self._rng) * (lengths[traj] - seq + 1)).floor()
        first = start[traj, 0] + rel.to(start.dtype)
        index = (first.unsqueeze(1) + torch.arange(seq, device=first.device)).reshape(-1) % storage.shape[0]
        return (index,), self._info(rows, index, num, seq)

    def _info(self, rows: TensorDictBase, index: torch.Tensor, num: int, seq: int) -> dict:
        """torchrl's ``info`` for equal slices: truncated at each slice's last row, ``done`` = stored done or
        truncated, stored ``terminated``, and ``is_init`` (stored, or each slice's first row) when stored."""
        info = {}
        if self.truncated_key is not None:
            done_key = _replace_last(self.truncated_key, "done")
            terminated_key = _replace_last(self.truncated_key, "terminated")
            truncated = torch.zeros((index.shape[0], 1), dtype=torch.bool, device=index.device)
            truncated.view(num, -1)[:, -1] = True
            done = rows.get(done_key, default=None)
            terminated = rows.get(terminated_key, default=None)
            info = {self.truncated_key: truncated,
                    done_key: truncated.clone() if done is None else done[index] | truncated,
                    terminated_key: torch.zeros_like(truncated) if terminated is None else terminated[index]}
        stored_init = None if self.init_key is None else rows.get(self.init_key, default=None)
        if stored_init is not None:
            init = stored_init[index]
            marker = torch.zeros_like(init)
            marker[torch.arange(num, device=marker.device) * seq] = True
            info[self.init_key] = marker | init
        return info
