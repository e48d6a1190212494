"""Fresh output tensors of history reads. Large host outputs reuse the memory of a key's last two
once the caller has let go of it, or take fresh memory advised into huge pages: a read of many MiB
then does not fault once per 4 KiB page on its first write."""

import torch

from gpubuf._core.host_memory import advise_huge

BIG = 2 << 20  # fresh host outputs of at least this many bytes: reused when free, else huge pages
SPARES = 2  # large outputs' memory kept per key for reuse
# references to a storage (tensors, views, numpy arrays and DLPack capsules over it all hold one);
# without it (another torch), large outputs are never reused
_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)  # noqa: SLF001


class Outputs:
    """Output tensors on ``device``; on the host, the memory of each key's last :data:`SPARES` large outputs."""

    def __init__(self, device: torch.device):
        self.device = device
        self.host = device.type == "cpu"
        self._spare: dict[str, list[torch.UntypedStorage]] = {}

    def fresh(self, key: str, shape, dtype: torch.dtype, nbytes: int) -> torch.Tensor:
        """A new output tensor. A large host one reuses the memory of one of this key's last two large outputs once
        nothing else holds it (no tensor, view, numpy array or DLPack capsule: its storage's only reference is this
        one's, and it is not shared with another process); else it is fresh memory advised into huge pages."""
        if nbytes < BIG or not self.host:
            return torch.empty(shape, dtype=dtype, device=self.device)
        spares = self._spare.setdefault(key, [])
        for spare in spares:
            if (_USE_COUNT is not None and spare.nbytes() == nbytes and not spare.is_shared()
                    and _USE_COUNT(spare._cdata) == 1):  # noqa: SLF001
                return torch.empty(0, dtype=dtype).set_(spare, 0, shape)
        t = torch.empty(shape, dtype=dtype)
        advise_huge(t)
        spares.insert(0, t.untyped_storage())
        del spares[SPARES:]  # a caller holding its last output still finds one free
        return t

    def may_keep(self, nbytes: int) -> bool:
        """Whether outputs of ``nbytes`` may add to the memory kept for reuse."""
        return nbytes >= BIG and self.host

    def kept(self) -> dict:
        """A copy of the memory kept for reuse, taken before a call that may add to it:
        :meth:`restore` it when the call fails, so a failed read keeps none of its memory."""
        return {key: list(spares) for key, spares in self._spare.items()} if self._spare else {}

    def restore(self, kept: dict) -> None:
        self._spare = kept

    def forget(self) -> None:
        """Keep no memory (the keys changed)."""
        self._spare = {}

    def held(self) -> list[int]:
        """Bytes of each kept storage."""
        return [s.nbytes() for spares in self._spare.values() for s in spares]
