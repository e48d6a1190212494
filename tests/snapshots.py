"""Deep snapshots of a buffer's state, to assert that a rejected call changed nothing."""

import torch


def snapshot(buf) -> dict:
    """A deep CPU copy of ``buf.state_dict()`` (whose tensors are the live storage)."""
    def copy(v):
        if isinstance(v, torch.Tensor):
            return v.detach().cpu().clone()
        if isinstance(v, dict):
            return {k: copy(x) for k, x in v.items()}
        return v

    return copy(buf.state_dict())


def assert_same_state(a: dict, b: dict, where: str = "state") -> None:
    """Every entry of two snapshots equal (tensors bitwise, NaNs included)."""
    assert a.keys() == b.keys(), where
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape, f"{where}[{k!r}]"
            assert torch.equal(x.view(torch.uint8) if x.dim() else x, y.view(torch.uint8) if y.dim() else y), \
                f"{where}[{k!r}]"
        elif isinstance(x, dict):
            assert_same_state(x, y, f"{where}[{k!r}]")
        else:
            assert x == y, f"{where}[{k!r}]"


def assert_unchanged(buf, before: dict) -> None:
    assert_same_state(snapshot(buf), before)
