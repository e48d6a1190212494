"""Host tensors -> device tensors through reusable pinned buffers.

Host data bound for a CUDA buffer goes through :class:`Staging`: a small ring of preallocated pinned host buffers per
key, each followed by one non-blocking copy into a preallocated device buffer. A pinned slot is reused only after the
copy that read it has finished (a CUDA event), so callers may overwrite their arrays as soon as the call returns and
nothing waits on the device in steady state. Slots are capped (:data:`SLOT_BYTES`): larger inputs go through in
pieces."""

import bisect

import torch


def _span(t: torch.Tensor) -> tuple[int, int]:
    """``(first byte, end byte)`` of the memory a (possibly strided) tensor can reach."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    if t.is_contiguous():
        return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    lo = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True) if s < 0)
    hi = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True) if s > 0)
    size = t.element_size()
    return t.data_ptr() + lo * size, t.data_ptr() + (hi + 1) * size


def memory_ranges(tensors) -> tuple[tuple[int, int], ...]:
    """The memory of ``tensors`` as sorted, disjoint ``(first byte, end byte)`` ranges: what
    :func:`overlaps` tests against."""
    merged: list[list[int]] = []
    for a, b in sorted(_span(t) for t in tensors):
        if a == b:
            continue
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return tuple((a, b) for a, b in merged)


def overlaps(t: torch.Tensor, ranges: tuple[tuple[int, int], ...]) -> bool:
    """Whether the memory ``t`` can reach overlaps any of ``ranges`` (sorted and disjoint, from
    :func:`memory_ranges`), whatever object owns it (a torch view, ``torch.from_numpy`` of a numpy
    view, a DLPack import...). One binary search."""
    a, b = _span(t)
    i = bisect.bisect_left(ranges, (b,)) - 1  # the last range starting before b
    return a < b and i >= 0 and ranges[i][1] > a


def check_disjoint(outputs: dict, owned: tuple) -> None:
    """Raise ``ValueError`` naming the output if a contiguous output tensor overlaps a buffer's storage (byte ranges
    ``owned``) or another output: writing it would corrupt what is being read."""
    seen: list[tuple[str, tuple[int, int]]] = []
    for name, t in outputs.items():
        if overlaps(t, owned):
            raise ValueError(f"{name}: shares memory with the buffer's storage; pass separate output tensors")
        for other, r in seen:
            if overlaps(t, (r,)):
                raise ValueError(f"{name}: shares memory with {other}; pass separate output tensors")
        seen.append((name, _span(t)))


SLOT_BYTES = 4 << 20  # the most bytes one staging slot holds (pinned and device alike)


class Staging:
    """Moves host tensors onto ``device`` through reusable pinned and device buffers, one copy per key.

    Each key has a ring of ``slots`` buffers of at most ``slot_bytes`` each (pinned and device): the host waits on a
    slot's previous copy only when it runs that many calls ahead of the device, and a returned device tensor stays valid
    for ``slots - 1`` more calls with the same key. A larger input goes in ``slot_bytes`` pieces through the same pinned
    slots into a fresh device tensor of its own, so staging holds at most ``2 * slots * slot_bytes`` bytes per key
    whatever the input sizes. Copies and event records run under ``device`` (its current stream), whatever device is
    current."""

    def __init__(self, device: torch.device, slots: int = 4, slot_bytes: int = SLOT_BYTES):
        self.device = device
        self.slots = slots
        self.slot_bytes = max(int(slot_bytes), 1)
        # key -> [next slot, [[pinned, device_buf, event] per slot]]
        self._ring: dict[str, list] = {}

    def to_device(self, t: torch.Tensor, key: str) -> torch.Tensor:
        """``t`` on ``self.device``: the tensor itself if already there (callers copy it into storage)."""
        if t.device == self.device:
            return t
        if self.device.type != "cuda" or t.device.type != "cpu":
            return t.to(self.device)
        with self._guard():
            return self._through_pinned(t, key)

    def held_bytes(self) -> tuple[int, int]:
        """``(pinned, device)`` bytes the rings hold now, every key together."""
        slots = [s for _, ring in self._ring.values() for s in ring if s is not None]
        return (sum(s[0].numel() for s in slots if s[0] is not None),
                sum(s[1].numel() for s in slots if s[1] is not None))

    # allocation, events and the device guard: overridden to simulate a CUDA device in tests
    def _guard(self):
        return torch.cuda.device(self.device)

    def _pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def _device_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _event(self):
        return torch.cuda.Event()

    def _record(self, event) -> None:
        event.record(torch.cuda.current_stream(self.device))

    def _slot(self, key: str, pinned_bytes: int, device_bytes: int) -> list:
        """The key's next ring slot, its previous copy finished, with buffers of at least these sizes."""
        entry = self._ring.setdefault(key, [0, [None] * self.slots])
        i = entry[0]
        entry[0] = (i + 1) % self.slots
        slot = entry[1][i]
        if slot is None:
            slot = entry[1][i] = [None, None, self._event()]
        slot[2].synchronize()  # the copy that last read this pinned slot is done
        if pinned_bytes and (slot[0] is None or slot[0].numel() < pinned_bytes):
            slot[0] = self._pinned(pinned_bytes)
        if device_bytes and (slot[1] is None or slot[1].numel() < device_bytes):
            slot[1] = self._device_buffer(device_bytes)
        return slot

    def _through_pinned(self, t: torch.Tensor, key: str) -> torch.Tensor:
        nbytes = t.numel() * t.element_size()
        src = t.contiguous().view(-1).view(torch.uint8) if nbytes else t
        if nbytes > self.slot_bytes:
            return self._in_pieces(src, nbytes).view(t.dtype).view(t.shape)
        size = max(nbytes, 1)
        # a slot grows to the largest input seen, rounded up to a power of two (at most slot_bytes)
        size = min(1 << (size - 1).bit_length(), self.slot_bytes)
        pinned, dev, event = self._slot(key, size, size)
        host = pinned[:nbytes].view(t.dtype).view(t.shape)
        host.copy_(t)
        out = dev[:nbytes].view(t.dtype).view(t.shape)
        out.copy_(host, non_blocking=True)
        self._record(event)
        return out

    def _in_pieces(self, src: torch.Tensor, nbytes: int) -> torch.Tensor:
        """(nbytes,) uint8 fresh device tensor = ``src``, copied ``slot_bytes`` at a time through the pinned slots of
        one key shared by every large input (device halves are not allocated)."""
        out = self._device_buffer(nbytes)
        for a in range(0, nbytes, self.slot_bytes):
            b = min(a + self.slot_bytes, nbytes)
            pinned, _, event = self._slot("__pieces__", self.slot_bytes, 0)
            pinned[:b - a].copy_(src[a:b])
            out[a:b].copy_(pinned[:b - a], non_blocking=True)
            self._record(event)
        return out

    def stage(self, t: torch.Tensor, key: str, dtype: torch.dtype, owned: tuple = ()) -> torch.Tensor:
        """``t`` as a contiguous, 16-byte-aligned ``dtype`` tensor on the device, ready to be copied into storage.

        This is the first phase of every write: any conversion that can fail (device, dtype, layout, a lazy conjugate or
        negative view) fails here, before the first write, and the error names ``key``. The result never requires grad
        and never overlaps the byte ``owned`` ranges (:func:`memory_ranges` of a buffer's storage: an input that reads
        the buffer's own memory is copied first)."""
        try:
            out = self.to_device(t.detach() if t.requires_grad else t, key)
            if out.dtype != dtype:
                out = out.to(dtype)
            if out.is_conj() or out.is_neg():
                out = out.resolve_conj().resolve_neg()
            out = out.contiguous()
            # a converted input is fresh memory; one passed through as it is may be the buffer's own
            same = out.data_ptr() == t.data_ptr()
            if out.storage_offset() * out.element_size() % 16 or (owned and same and overlaps(out, owned)):
                out = out.clone()
            return out
        except (RuntimeError, NotImplementedError, TypeError) as err:
            raise TypeError(f"{key}: could not convert {t.dtype} {tuple(t.shape)} on {t.device} into a "
                            f"contiguous {dtype} tensor on {self.device} ({err})") from err
