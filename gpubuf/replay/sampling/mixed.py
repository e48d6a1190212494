"""OfflineToOnline: batches with an exact offline fraction, for offline-to-online training (RLPD, Cal-QL, IQL
fine-tuning).

Every batch of ``B`` windows holds exactly ``round(B * offline_fraction)`` drawn from the ``offline`` buffer (a dataset
loaded with :func:`gpubuf.datasets.load_episodes`, say) followed by the rest drawn from the ``online`` one; each part
is one ordinary ``sample`` of its buffer (uniform or prioritized, with the same ``unit``, ``boundaries`` and
replacement), so a row of the offline part is drawn with its buffer's probability and likewise online. The fraction is
fixed by design (RLPD's symmetric sampling), not drawn: the importance weights (``PER_weights``) are each part's own,
as its buffer computes them for its draw (1 for a uniform part), and correct the prioritized draw within that part.
``update_priorities(batch, td_errors)`` sends each part's errors back to its buffer (a uniform part takes none)."""

import numbers

import numpy as np
import torch

from gpubuf._core.inputs import check_bool, finite_float, int_seed, positive_int
from gpubuf._core.transition import Transition
from gpubuf.replay.sampling.batch import Batch


class MixedBatch(Transition):
    """One offline-to-online batch: the two parts' leaves concatenated along the batch axis, offline rows first, and

    - ``offline`` / ``online``: the parts' own :class:`~gpubuf.Batch` (``indices``, ``generations``, ...) or ``None``
      for an empty part;
    - ``from_offline``: ``(B,)`` bool on the leaves' device, True on the offline rows."""

    offline: Batch | None = None
    online: Batch | None = None
    from_offline: torch.Tensor | None = None


class OfflineToOnline:
    """Draws ``round(B * offline_fraction)`` of every batch from ``offline`` and the rest from ``online`` (module
    docstring). The buffers must hold the same leaves (names, shapes, dtypes), ``n_steps`` and device
    (``ValueError`` naming what differs); ``offline_fraction`` is in ``[0, 1]``."""

    def __init__(self, offline, online, offline_fraction: float):
        for name, buf in (("offline", offline), ("online", online)):
            if not hasattr(buf, "config") or not callable(getattr(buf, "sample", None)):
                raise TypeError(f"{name}: expected a TransitionBuffer, got {type(buf).__name__}")
        a, b = offline.config, online.config
        mine = {leaf.name: (leaf.shape, leaf.dtype) for leaf in a.leaves}
        theirs = {leaf.name: (leaf.shape, leaf.dtype) for leaf in b.leaves}
        if mine != theirs:
            diff = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
            raise ValueError(f"online: its leaves differ from offline's at {diff} "
                             f"(offline {[mine.get(k) for k in diff]}, online {[theirs.get(k) for k in diff]})")
        if a.sample_dtypes != b.sample_dtypes:
            raise ValueError(f"online: its sample_dtypes {dict(b.sample_dtypes)} differ from offline's "
                             f"{dict(a.sample_dtypes)} (a batch holds one dtype per leaf)")
        if a.n_steps != b.n_steps or offline.device != online.device:
            raise ValueError(f"online: n_steps {b.n_steps} on {online.device} differs from offline's "
                             f"{a.n_steps} on {offline.device}")
        self.offline, self.online = offline, online
        self.offline_fraction = finite_float("offline_fraction", offline_fraction, 0.0)
        if self.offline_fraction > 1:
            raise ValueError(f"offline_fraction: expected a fraction in [0, 1], got {offline_fraction!r}")

    def split(self, batch_size: int) -> tuple[int, int]:
        """``(offline windows, online windows)`` of a batch of ``batch_size``."""
        n = round(batch_size * self.offline_fraction)
        return n, batch_size - n

    def sample(self, batch_size: int | None = None, unit=None, *, key=None, with_replacement: bool = True,
               boundaries: str = "allow") -> MixedBatch:
        """A :class:`MixedBatch` of ``batch_size`` (default: the online buffer's ``sample_batch_size``) windows read
        as ``unit`` (default ``Unit.window()``); ``key``: a ``torch.Generator`` both draws take in turn (an int seeds
        one), ``None``: each buffer's own; ``with_replacement``, ``boundaries``: as each buffer's ``sample``."""
        from gpubuf.replay.sampling.units import Unit

        batch_size = self.online.config.sample_batch_size if batch_size is None else \
            positive_int("batch_size", batch_size)
        if isinstance(key, numbers.Integral) and not isinstance(key, (bool, np.bool_)):  # one generator, both draws
            key = torch.Generator().manual_seed(int_seed("key", key))
        with_replacement = check_bool("with_replacement", with_replacement)
        args = {"unit": Unit.window() if unit is None else unit, "key": key, "with_replacement": with_replacement,
                "boundaries": boundaries}
        n_off, n_on = self.split(batch_size)
        parts = [buf.sample(batch_size=n, **args) if n else None
                 for buf, n in ((self.offline, n_off), (self.online, n_on))]
        return _joined(*parts, n_off, n_on)

    def update_priorities(self, batch: MixedBatch, td_errors) -> None:
        """Each prioritized part's ``td_errors`` (``(B,)``, offline rows first) to its buffer, checked against the
        generations it was drawn at (values for rows overwritten since are dropped)."""
        if not isinstance(batch, MixedBatch):
            raise TypeError(f"batch: expected the MixedBatch of this sampler's sample(), got {type(batch).__name__}")
        td = torch.as_tensor(td_errors)
        n_off = 0 if batch.offline is None else batch.offline.indices.shape[0]
        n_on = 0 if batch.online is None else batch.online.indices.shape[0]
        if td.shape != (n_off + n_on,):
            raise ValueError(f"td_errors: expected shape ({n_off + n_on},), got {tuple(td.shape)}")
        parts = [(buf, part, errors) for buf, part, errors in ((self.offline, batch.offline, td[:n_off]),
                                                               (self.online, batch.online, td[n_off:]))
                 if part is not None and buf.prioritized]
        for buf, part, errors in parts:  # both parts checked by their buffers' rule before either is written
            buf.sampler.check_write(part.indices, errors)
        for buf, part, errors in parts:
            buf.update_priorities(part.indices, errors, generations=part.generations)


def _joined(offline: Batch | None, online: Batch | None, n_off: int, n_on: int) -> MixedBatch:
    """The two parts as one :class:`MixedBatch` (``PER_weights`` 1 for a uniform part when the other is
    prioritized)."""
    parts = [p for p in (offline, online) if p is not None]
    fields = [dict(p) for p in parts]
    weights = [p.PER_weights for p in parts]
    if any(w is not None for w in weights):
        device = next(w for w in weights if w is not None).device
        weights = [torch.ones(p.indices.shape[0], device=device) if w is None else w for p, w in zip(parts, weights,
                                                                                                    strict=True)]
    joined = {k: _cat([f[k] for f in fields]) for k in fields[0] if k != "PER_weights"}
    if weights[0] is not None:
        joined["PER_weights"] = torch.cat(weights)
    batch = MixedBatch(**joined)
    batch.offline, batch.online = offline, online
    device = parts[0].indices.device
    batch.from_offline = torch.arange(n_off + n_on, device=device) < n_off
    return batch


def _cat(values: list):
    if isinstance(values[0], dict):
        return {k: _cat([v[k] for v in values]) for k in values[0]}
    return values[0] if len(values) == 1 else torch.cat(values)
