"""Storage: where a replay buffer's rows live. ``memory`` (device or host tensors, and the memory-mapped files of a
``storage_dir``: one surface), ``directory`` (a ``storage_dir``: allocation, lock, row journal, with ``files``,
``format``, ``journal`` and ``lock``) and ``tiers`` (host storage for a CUDA buffer, env-major gathers)."""

from gpubuf.replay.storage.memory import MappedStorage, MemoryStorage

__all__ = ["MappedStorage", "MemoryStorage"]
