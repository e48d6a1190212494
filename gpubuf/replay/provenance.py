"""Provenance of flat starts: the env, ring row and step of each (:meth:`~gpubuf.TransitionBuffer.locate`). A flat
buffer (``vectorized_env=False``) holds one stream, which names no env by a row's place: only a stored integer
``info["env_id"]`` does (``transition_sample(vectorized=False)``)."""

import numpy as np
import torch

from gpubuf._core.concurrency import locked
from gpubuf._core.inputs import host_indices

ENV_ID = ("info", "env_id")  # a flat buffer's leaf naming the env of each row
INTEGERS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def stored_env(config) -> bool:
    """Whether ``config`` is a flat buffer's that stores each row's env: an integer ``info["env_id"]`` per row."""
    leaf = config.by_path.get(ENV_ID)
    return not config.vectorized_env and leaf is not None and leaf.shape == () and leaf.dtype in INTEGERS


def locate(config, storage, ring, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(env, row, step)`` int64 of flat starts ``flat`` (any shape): the ring's, the env read from the stored
    ``info["env_id"]`` of a flat buffer that stores one (:func:`stored_env`). ``IndexError`` as the ring raises."""
    env, row, step = ring.locate(flat)
    if stored_env(config):
        rows = torch.from_numpy(row.reshape(-1))
        ids = storage.data[ENV_ID].index_select(0, rows.to(storage.data[ENV_ID].device))
        env = ids.to(torch.int64).cpu().numpy().reshape(row.shape)
    return env, row, step


class Provenance:
    """Mixed into :class:`~gpubuf.TransitionBuffer` (``lock``, ``config``, ``storage``, ``ring``): :meth:`locate`."""

    @locked
    def locate(self, indices) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(env, row, step)`` of flat starts ``indices`` (any shape), int64 shaped like ``indices`` on their device:
        ``row * n_envs + env`` splits into ring ``row`` and ``env``; ``step`` counts the env's rows from the first this
        buffer wrote (a :meth:`load_state_dict` numbers its rows from 0; with an :class:`~gpubuf.EnvPoolSource` in sync
        mode, row ``step`` shows the env after ``step`` calls of ``step()``). ``IndexError`` for an index outside ``[0,
        max_size)`` or a row not held. A buffer of ``vectorized_env=False`` holds one stream, which a source with
        several envs interleaves: ``env`` is each row's stored ``info["env_id"]`` (a source's
        ``transition_sample(vectorized=False)`` has it), else 0, and ``step`` counts the stream's rows (this module)."""
        flat, device = host_indices(indices)
        return tuple(torch.from_numpy(a).to(device) for a in locate(self.config, self.storage, self.ring, flat))
