"""The one ``sample`` of every buffer that samples (``TransitionBuffer``, ``PrioritizedTransitionBuffer``,
``ShardedBuffer``): ``sample(batch_size=None, unit=None, *, key=None, with_replacement=None, boundaries="allow",
out=None)`` returns a :class:`~gpubuf.Batch`.

- ``batch_size``: windows ``B`` (``None``: the buffer's ``sample_batch_size``).
- ``unit``: what each drawn start comes back as, a :class:`~gpubuf.Unit` (``None``: ``Unit.window()``, the
  ``n_steps`` stored rows): :mod:`gpubuf.replay.sampling.units` says each kind.
- ``key``: a ``torch.Generator``, an int seed (the same int, the same batch) or ``None`` (the buffer's generator).
- ``with_replacement``: ``None`` is the buffer's default (uniform: ``True``; prioritized: ``False``, exact sequential
  sampling without replacement, as the original PER buffer). A flag that is not a bool raises ``TypeError`` naming it.
- ``boundaries``: ``"allow"``, ``"mask"`` or ``"forbid"``, what a window may do at an episode end
  (:mod:`gpubuf.replay.buffer` says how).
- ``out``: a :class:`~gpubuf.Batch` (an earlier sample's) of tensors of exactly the returned shapes and dtypes on
  the buffer's device: the windows are written there and that Batch is returned (not offered with frame stacks or
  n-step returns; a prioritized draw replaces ``out.PER_weights`` with a fresh tensor).

Starts are drawn uniformly over the valid starts or, in a prioritized buffer, with probability ``P_i`` (the batch
then carries ``weights``, ``(B,)`` float32). ``ValueError`` when there is no valid start, or fewer than ``B``
without replacement. Rows of an :class:`~gpubuf.EnvPoolSource` that hold no transition (``info["is_last"]``) never
start a window. A batch whose outputs and working memory (estimated up front) exceed what the device has raises
``MemoryError`` naming ``batch_size`` before anything is drawn. A sample that raises leaves the generator, the
priorities and the counts as they were. With a ``rate_limiter`` the call, once its arguments are checked, waits for
its turn having let go of the buffer's lock (``TimeoutError`` after the limiter's ``timeout``) and counts ``B``
samples; a sample that then raises gives them back.

**Deprecated forms (0.2.x; removed in 0.3.0).** The keywords of 0.2.0 (``with_next_obs``, ``frame_stack``,
``frame_stride``, ``n_step_return``, ``return_indices``, ``return_generations``) and its positional order (``key,
with_replacement, batch_size, with_next_obs, boundaries``) still work, warning with a ``DeprecationWarning`` that names
the new spelling, and return exactly what they returned in 0.2.0 (a ``Transition``, ``(batch, indices)`` or ``(batch,
indices, generations)``). Two calls without an old form keep a 0.2.0 result too, with the warning: a prioritized
buffer's call without ``unit`` returns ``(batch, batch.indices)``, and ``out=`` a plain ``Transition`` without ``unit``
returns that ``Transition``. Every other call returns a ``Batch``, which is a ``Transition``, so ``batch =
buf.sample()`` and ``dict(batch)`` read as before. :mod:`gpubuf.replay.sampling.sample_legacy` maps the old forms.
"""

import torch

from gpubuf._core.concurrency import locked
from gpubuf.replay.feeds import write_backs
from gpubuf.replay.sampling import sample_legacy
from gpubuf.replay.sampling.batch import Batch
from gpubuf.replay.sampling.units import WINDOW, Unit


class Samples:
    """Base of the buffers that sample: the shared :meth:`sample`. A subclass implements the entry
    ``_sample(key, with_replacement, batch_size, with_next_obs, boundaries, out, return_indices, frame_stack,
    frame_stride, n_step_return, return_generations)`` (defaults resolved; it returns the batch, ``(batch,
    indices)`` or ``(batch, indices, generations)``) and its body ``_sample_held`` (the call lock held by the caller),
    or its own :meth:`_sample_batch` where it has no ring."""

    default_with_replacement = True  # uniform buffers draw with replacement
    default_return_indices = False  # a call without unit returns the batch alone (0.2.0: prioritized, with indices)

    # an opaque call under torch.compile: no guards on host state, no recompiles
    @torch.compiler.disable
    def sample(self, *legacy, batch_size: int | None = None, unit: Unit | None = None, key=None,
               with_replacement: bool | None = None, boundaries: str = "allow", out: Batch | None = None,
               **legacy_keywords) -> Batch:
        """A :class:`~gpubuf.Batch` of ``batch_size`` starts drawn from the valid ones, each read as ``unit``
        (:mod:`gpubuf.replay.sampling.sample_args` says every argument). Positionally, give both:
        ``sample(256, Unit.window())``; ``legacy``, ``legacy_keywords``: the deprecated 0.2.0 forms, removed in
        0.3.0 (a lone positional argument is still 0.2.0's ``key``, with a ``FutureWarning``)."""
        if len(legacy) == 2 and type(legacy[1]) is Unit:  # sample(batch_size, unit): the new form, positionally
            if batch_size is not None or unit is not None:
                name = "batch_size" if batch_size is not None else "unit"
                raise TypeError(f"sample() got multiple values for argument {name!r}")
            (batch_size, unit), legacy = legacy, ()
        if legacy or legacy_keywords:
            return self._sample(*sample_legacy.arguments(self, legacy, legacy_keywords, batch_size, unit, key,
                                                         with_replacement, boundaries, out))
        if with_replacement is None:
            with_replacement = self.default_with_replacement
        if unit is None:
            batch = self._sample_batch(key, with_replacement, batch_size, boundaries, out, WINDOW)
            if self.default_return_indices or (out is not None and type(out) is not Batch):
                return sample_legacy.unnamed_unit(self, batch, out)
            return batch
        if type(unit) is not Unit:
            raise TypeError(f"unit: expected a gpubuf.Unit (Unit.window(), Unit.transition(), Unit.frames(k), "
                            f"Unit.n_step(n, gamma)) or None, got {unit!r}")
        return self._sample_batch(key, with_replacement, batch_size, boundaries, out, unit)

    @locked
    def _sample_batch(self, key, with_replacement: bool, batch_size, boundaries: str, out, unit: Unit) -> Batch:
        """One sample through ``_sample_held`` (:meth:`_sample`'s body, under the call lock taken here), as a
        :class:`Batch` whose generations are those of the ring at the draw."""
        with_next_obs, frame_stack, frame_stride, n_step_return = unit.args
        data, indices = self._sample_held(key, with_replacement, batch_size, with_next_obs, boundaries, out, True,
                                          frame_stack, frame_stride, n_step_return, False)
        return Batch.of(data, indices, write_backs.origin(self.ring), out)
