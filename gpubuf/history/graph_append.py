"""HistoryGraphWriter: appends to a :class:`~gpubuf.HistoryBuffer` with its heads and counts on the device, for a step
traced whole by ``torch.compile(fullgraph=True)`` or captured in a CUDA graph with its simulator.

An append here writes one entry per env (every env, as a simulator steps them all) at each env's head, read from the
device copy of the heads and counts (:class:`DeviceHeads`); a ``reset`` mask forgets the entries of the envs it marks
first (a simulator resetting them inside the step), as ``history.reset(ids)`` then ``history.append(...)`` do. No
value is read back. Casts that depend on the values are checked on the device: an append that fails one writes
nothing (no entry, no reset), is counted, and is raised by the buffer's next eager call (or :meth:`check`).

The host keeps its mirror of the heads and counts for the buffer's eager calls: every eager change of it is copied to
the device, and every eager call first brings it up to the device's after graph appends (one read of ``2 * n_envs``
integers: the documented price of ``get``, ``num_strided``, ``state_dict`` after graph appends).
"""

import numpy as np
import torch

from gpubuf._core.concurrency import locked_on_device
from gpubuf._core.copies import refuse_copies
from gpubuf._core.inputs import cast_keeps_values, cast_refusal, check_device_flags, lossless


class DeviceHeads:
    """The device copy of a history ring's ``heads`` and ``counts``: ``state`` (2, n_envs) int64 and ``dropped`` ()
    int64 (graph appends that wrote nothing since the last catch-up)."""

    def __init__(self, ring, device: torch.device):
        self.ring = ring
        self.state = torch.zeros(2, ring.n_envs, dtype=torch.int64, device=device)
        self.dropped = torch.zeros((), dtype=torch.int64, device=device)
        self._catching_up = False
        self.push()

    def push(self) -> None:
        """The host mirror changed: copy it to the device (not while it is being caught up from there)."""
        if not self._catching_up:
            self.state.copy_(torch.from_numpy(np.stack([self.ring.heads, self.ring.counts])))

    def catch_up(self) -> int:
        """Bring the host mirror up to the device (one read); returns the dropped appends since the last catch-up."""
        E = self.ring.n_envs
        flat = torch.cat([self.state.reshape(-1), self.dropped.view(1)]).cpu().numpy()
        self._catching_up = True
        try:
            self.ring.restore(flat[:E].copy(), flat[E:2 * E].copy())
        finally:
            self._catching_up = False
        if flat[-1]:
            self.dropped.zero_()
        return int(flat[-1])


def attach(history, ring, guard) -> DeviceHeads:
    """The :class:`DeviceHeads` of ``history`` (its ``ring`` mirror, made on first use and told of every eager change
    from then on); its eager calls (``guard``) catch up from the device first."""
    if ring.mirror is None:
        ring.mirror = heads = DeviceHeads(ring, history.device)

        def catch_up():
            if history.table.capturing():
                return
            dropped = heads.catch_up()
            if dropped:
                raise dropped_error(dropped)

        guard.behind = catch_up
    return ring.mirror


def dropped_error(dropped: int) -> ValueError:
    return ValueError(f"HistoryGraphWriter.append: {dropped} append(s) since the last check wrote nothing: a value "
                      "failed its check on the device (one its stored dtype cannot hold, or a check of the caller's "
                      "such as a TensorSource's non-finite actions)")


@refuse_copies("its tensors may be captured in a CUDA graph of its buffer; build a new one with "
               "copy.graph_writer() on the buffer's copy")
class HistoryGraphWriter:
    """Device-side appends of one entry per env into ``history`` (built by :meth:`HistoryBuffer.graph_writer`, once
    a first eager append fixed the keys, shapes and dtypes)."""

    def __init__(self, history, schema, ring, guard):
        self.history, self.schema, self._guard = history, schema, guard
        self.heads = attach(history, ring, guard)
        self._envs = torch.arange(history.n_envs, device=history.device)

    @locked_on_device
    def append(self, info_dict: dict, reset: torch.Tensor | None = None, valid: torch.Tensor | None = None) -> None:
        """Append ``info_dict`` ``{key: (n_envs, *entry)}`` (device tensors of every stored key) as one entry per env,
        after forgetting the entries of the envs ``reset`` (an ``(n_envs,)`` bool tensor) marks; ``valid``: a ()
        bool tensor, the caller's own checks (false: nothing is written). All or nothing, no host read."""
        staged = self._stage(self.check_inputs(info_dict, reset, valid), reset, valid)
        heads = self.heads
        for key, (rows, new) in staged[0].items():
            self.schema.data[key].index_copy_(0, rows, new)
        if staged[1] is not None:
            heads.dropped.add_((~staged[1]).to(torch.int64))
        heads.state.copy_(staged[2])

    def check_inputs(self, info_dict: dict, reset=None, valid=None) -> dict:
        """Raise what :meth:`append` raises on the host (``ValueError``/``TypeError`` naming the key, ``reset`` or
        ``valid``), writing nothing; returns the values, detached."""
        h, schema, E = self.history, self.schema, self.history.n_envs
        if not isinstance(info_dict, dict) or info_dict.keys() != schema.shapes.keys():
            got = sorted(info_dict) if isinstance(info_dict, dict) else type(info_dict).__name__
            raise ValueError(f"info_dict: expected the stored keys {sorted(schema.shapes)}, got {got}")
        for name, flags, shape in (("reset", reset, (E,)), ("valid", valid, ())):
            if flags is not None:
                check_device_flags(name, flags, shape, h.device)
        for key, value in info_dict.items():
            store = schema.data[key]
            if not isinstance(value, torch.Tensor) or value.device.type != h.device.type \
                    or tuple(value.shape) != (E, *schema.shapes[key]) or value.layout != torch.strided:
                got = f"{tuple(value.shape)} on {value.device}" if isinstance(value, torch.Tensor) else \
                    type(value).__name__
                raise ValueError(f"{key}: expected a tensor shaped {(E, *schema.shapes[key])} on {h.device}, got {got}")
            why = cast_refusal(value.dtype, store.dtype)
            if why:
                raise TypeError(f"{key}: cannot store {value.dtype} in the stored dtype {store.dtype} ({why})")
        return {key: value.detach() for key, value in info_dict.items()}

    def _stage(self, values: dict, reset, valid) -> tuple:
        """``({key: (rows, new rows)}, ok, new heads and counts)``: every conversion and device check, nothing
        written."""
        h, schema, E = self.history, self.schema, self.history.n_envs
        ok = valid
        for key, value in values.items():
            if not lossless(value.dtype, schema.data[key].dtype):
                fits = cast_keeps_values(value, schema.data[key].dtype)
                ok = fits if ok is None else ok & fits
        heads, counts = self.heads.state.clone().unbind()
        rows = heads * E + self._envs
        staged = {}
        for key, value in values.items():
            store = schema.data[key]
            new = value.reshape(E, -1).to(store.dtype)
            staged[key] = (rows, new if ok is None else torch.where(ok, new, store.index_select(0, rows)))
        if reset is not None:
            counts = torch.where(reset, 0, counts)
        state = torch.stack([(heads + 1) % h.max_len, torch.clamp(counts + 1, max=h.max_len)])
        if ok is not None:
            state = torch.where(ok, state, self.heads.state)
        return staged, ok, state

    def check(self) -> None:
        """Raise ``ValueError`` once for appends that wrote nothing since the last check (the buffer's next eager call
        raises it too)."""
        self._guard.behind()
