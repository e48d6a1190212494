"""Device names read once: :func:`parse_device` turns what a user passed as ``device`` into a ``torch.device`` or raises
``ValueError`` naming it (``gpubuf.ops.resolve_device`` then checks that the device is usable here)."""

import torch


def parse_device(device) -> torch.device:
    """``torch.device(device)``; ``ValueError`` naming ``device`` when it names no device."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError) as err:
        raise ValueError(f"device: expected a torch device or its name, got {device!r}") from err
