"""PrioritizedTransitionBuffer: a TransitionBuffer composed with a
:class:`~gpubuf.replay.sampling.samplers.PrioritizedSampler`.

The sampler owns everything about priorities (their checks, state, flush and re-open, the importance
weights' ``beta``); this module adds the prioritized API on top: the arguments, ``PER_weights`` on
sampled batches, and priority and beta updates."""

import math

import numpy as np
import torch

from gpubuf._core.concurrency import locked
from gpubuf._core.inputs import check_bool, finite_float, priority_updates
from gpubuf._core.transition import Transition
from gpubuf.replay.buffer import TransitionBuffer
from gpubuf.replay.feeds import write_backs
from gpubuf.replay.sampling.samplers import PrioritizedSampler

_F32_TINY = torch.finfo(torch.float32).tiny
_LOG_TINY = math.log(torch.finfo(torch.float64).tiny)


class PrioritizedTransitionBuffer(TransitionBuffer):
    """A :class:`TransitionBuffer` with prioritized experience replay over sequence starts.

    Extra args: ``alpha`` (priority exponent; 0 is uniform), ``beta`` (importance-sampling exponent, see
    :meth:`update_beta`), ``eps`` (> 0, added to ``|td|`` so no start gets zero probability). Storage tiers
    (``storage_device``, ``storage_dir``) as in :class:`TransitionBuffer`; priorities stay on ``device``.

    Each start has a raw priority (float32); newly inserted starts get the running ``max_priority`` (initially 1, never
    decreasing). ``P_i = p_i**alpha / sum over valid starts``. :meth:`sample` returns a :class:`~gpubuf.Batch` whose
    ``weights`` (``PER_weights``) are ``(N*P_i)**-beta / max over the batch``, which equals ``(P_i / min_batch
    P)**-beta``, and whose ``indices`` go back to :meth:`update_priorities` (through 0.2.x a call that names no ``unit``
    returns ``(batch, indices)``, with a ``DeprecationWarning``). Without replacement (**the default here**, as in the
    original PER buffer; the uniform :class:`TransitionBuffer` defaults to with replacement) the draw is exact
    sequential sampling without replacement (Plackett-Luce): see :class:`TransitionBuffer` for how and what it costs.

    Every valid start has a positive, finite mass: ``eps`` must survive float32 and ``eps**alpha`` float64 (checked
    here), and an update whose ``max_priority**alpha`` summed over all starts would overflow float64 is rejected
    (``ValueError`` naming ``td_errors`` and ``alpha``). :meth:`update_priorities` validates its inputs where they live:
    host inputs on the host (no device read), device inputs with one read-back."""

    prioritized = True
    default_with_replacement = False  # sample: as the original PER buffer
    default_return_indices = True  # sample() without a unit: 0.2.0's (batch, flat_indices), until 0.3.0
    sampler: PrioritizedSampler

    def __init__(self, max_size: int, sample_batch_size: int, data_sample: Transition, vectorized_env: bool = True,
                 n_steps: int = 1, alpha: float = 0.6, beta: float = 0.4, eps: float = 1e-6, *, device=None,
                 seed: int | None = None, storage_device=None, storage_dir=None, rate_limiter=None, selector=None,
                 storage_dtypes=None, sample_dtypes=None):
        self.alpha = finite_float("alpha", alpha, 0.0)
        self._initial_beta = finite_float("beta", beta, 0.0)
        self.eps = finite_float("eps", eps, 0.0, low_open=True)
        eps32 = float(np.float32(self.eps))
        if eps32 < _F32_TINY:
            raise ValueError(f"eps: expected at least {_F32_TINY:g} (priorities are float32), got {eps!r}")
        if self.alpha * math.log(eps32) < _LOG_TINY:
            raise ValueError(f"eps, alpha: eps**alpha = {eps32:g}**{self.alpha:g} underflows float64, so a start "
                             "with a zero TD error could never be drawn; raise eps or lower alpha")
        super().__init__(max_size, sample_batch_size, data_sample, vectorized_env, n_steps,
                         device=device, seed=seed, storage_device=storage_device,
                         storage_dir=storage_dir, rate_limiter=rate_limiter, selector=selector,
                         storage_dtypes=storage_dtypes, sample_dtypes=sample_dtypes)

    def _config_extra(self) -> tuple:
        return (("alpha", self.alpha), ("eps", self.eps))

    def _make_sampler(self) -> PrioritizedSampler:
        return PrioritizedSampler(self.ring, self.table, self.alpha, self._initial_beta, self.eps)

    @property
    def max_priority(self) -> float:
        """The running maximum priority."""
        return self.sampler.max_priority

    @torch.compiler.disable
    @locked
    def update_priorities(self, indices, td_errors, *, generations=None, deferred: bool = False):
        """Set priorities ``|td| + eps`` (float32) of flat starts ``indices``; returns ``self``.

        Duplicate indices keep their largest value. ``max_priority`` becomes ``max(max_priority, new)``. Empty inputs do
        nothing. With ``generations`` (a sampled batch's ``generations``) the starts whose rows were overwritten since
        that sample keep their priority (the TD error was computed on other data), and :attr:`stale_updates` counts
        them. Raises (writing nothing) on non-integer or out-of-range indices, a length mismatch, misshapen
        ``generations``, NaN/inf results, a priority whose ``**alpha`` mass would overflow, or a closed ``storage_dir``
        buffer (its next flush could not keep the change); ``RuntimeError`` in a process that did not open its
        ``storage_dir`` (a fork).

        ``deferred=True``: checked on the device instead, with no host synchronisation (device tensors of the buffer's
        device, as :meth:`GraphSampler.update_priorities <gpubuf.GraphSampler.update_priorities>`): an update failing a
        check writes nothing, and the failure is raised at :meth:`check_updates`, or at the next ``max_priority``,
        ``state_dict`` or flush (``close()`` raises it after releasing a ``storage_dir``). Not with ``generations``
        (their check reads the host's counters). ``deferred`` must be a bool (``TypeError``)."""
        deferred = check_bool("deferred", deferred)
        self.storage.check_open()
        if deferred:
            if generations is not None:
                raise ValueError("generations: not offered with deferred=True (a sync-free update cannot check "
                                 "them); pass deferred=False")
            self.stale_updates = 0
            idx, td = priority_updates(indices, td_errors)
            dev = self.device
            if idx.device.type != dev.type or td.device.type != dev.type:
                raise ValueError(f"indices, td_errors: deferred=True takes tensors on {dev}, got {idx.device} and "
                                 f"{td.device}")
            if idx.numel():
                self.sampler.device_updates().apply(idx.to(torch.int64), td.reshape(-1))
            return self
        if generations is None:
            self.stale_updates = 0
        else:
            idx, td = priority_updates(indices, td_errors)
            write_backs.check_range(self.ring, idx)
            keep = self._current(idx, generations)
            indices, td_errors = idx[keep], td[keep.to(td.device)]
        self.sampler.update_priorities(indices, td_errors)
        return self

    @locked
    def check_updates(self) -> None:
        """Raise what deferred priority updates (``update_priorities(..., deferred=True)`` and every
        :class:`~gpubuf.GraphSampler`'s) dropped since the last check, once (``IndexError`` for indices outside the
        buffer, else ``ValueError``); one read of the device. Nothing when none ran or none failed."""
        self.sampler.check_updates()

    @locked
    def update_beta(self, beta: float):
        """Set the importance-sampling exponent; returns ``self``. Every :class:`~gpubuf.GraphSampler` of this buffer
        follows it, in captured graphs too (through :attr:`beta_tensor`). A closed ``storage_dir`` buffer refuses (its
        next flush could not keep it)."""
        self.storage.check_open()
        self.beta = beta
        return self

    @property
    def beta(self) -> float:
        """The importance-sampling exponent (``>= 0``) of ``PER_weights``; set by :meth:`update_beta`,
        :meth:`load_state_dict` and a re-opened ``storage_dir``. A bad value raises naming ``beta``."""
        return self.sampler.beta

    @beta.setter
    @locked
    def beta(self, value: float) -> None:
        self.sampler.beta = value

    @property
    def beta_tensor(self) -> torch.Tensor:
        """``()`` float64 on ``device`` holding :attr:`beta`, refreshed in place on every change of it (the same tensor
        for the buffer's life), for device code that reads beta when it runs, such as a CUDA graph of a
        :class:`~gpubuf.GraphSampler`. Read it; change beta through :meth:`update_beta`."""
        return self.sampler.beta_tensor


__all__ = ["PrioritizedTransitionBuffer"]
