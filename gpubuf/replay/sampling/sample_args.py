"""The one ``sample`` signature of every replay buffer that samples, and its documentation.

:class:`Samples` defines :meth:`Samples.sample` once: it resolves the arguments whose ``None``
means the buffer's own default (:attr:`Samples.default_with_replacement`,
:attr:`Samples.default_return_indices`) and hands every argument to the buffer's ``_sample``,
which refuses by name what it cannot do.
"""

import torch

from gpubuf._core.inputs import check_bool
from gpubuf._core.transition import Transition


class Samples:
    """Base of the buffers that sample: the shared :meth:`sample`; a subclass implements
    ``_sample(key, with_replacement, batch_size, with_next_obs, boundaries, out, return_indices,
    frame_stack, frame_stride, n_step_return, return_generations)`` with the defaults resolved."""

    default_with_replacement = True  # uniform buffers draw with replacement
    default_return_indices = False  # and return the batch alone

    # an opaque call under torch.compile: no guards on host state, no recompiles
    @torch.compiler.disable
    def sample(self, key=None, with_replacement: bool | None = None, batch_size: int | None = None,
               with_next_obs: bool = False, boundaries: str = "allow", *,
               out: Transition | None = None, return_indices: bool | None = None,
               frame_stack: int | None = None, frame_stride: int = 1,
               n_step_return: tuple[int, float] | None = None, return_generations: bool = False):
        """A batch of ``B`` windows of ``n_steps`` rows from drawn valid starts: uniformly, or, in a
        prioritized buffer, with probability ``P_i`` (the batch then carries ``PER_weights`` (B,)
        float32; a caller's ``out.PER_weights`` is replaced by a fresh tensor). With
        ``return_indices`` (``None``: the buffer's default, ``False`` uniform, ``True``
        prioritized), ``(batch, indices)``: the windows' flat starts ``(B,)`` int64 on the device,
        ``row * n_envs + env`` (:meth:`~gpubuf.TransitionBuffer.locate` maps them to env, ring row
        and the env's own row count). ``with_replacement``: ``None`` is the buffer's default
        (uniform: ``True``; prioritized: ``False``, as in the original PER buffer).

        Leaves come back ``(B, n_steps, ...)`` (``(B, ...)`` when ``n_steps == 1``). ``key``: a
        ``torch.Generator``, an int seed (the same int, the same batch) or ``None`` (the buffer's
        generator). ``with_next_obs`` fills ``next_observation`` with the observation one row later
        (unless stored), and then never samples a window whose first ``n_steps`` rows hold a
        truncation (a row both ``terminated`` and ``truncated`` is a termination: it needs no successor
        and is drawn, as a terminated row is). Raises ``ValueError`` when there is no valid start, or
        fewer than ``batch_size`` without replacement. Rows of an :class:`~gpubuf.EnvPoolSource` that hold no transition
        (``info["is_last"]``) never start a window (``P_i`` is taken over the other starts).

        Memory: a batch whose outputs and working memory (estimated up front) exceed what the
        device has in all raises ``MemoryError`` naming ``batch_size`` and the bytes before anything
        is drawn; an allocation that fails raises the same. A sample that raises leaves the
        generator (the buffer's or ``key``'s), the priorities and the counts as they were.

        ``return_generations=True`` returns ``(batch, indices, generations)``: each start's
        generation ``(B,)`` int64 on the device (no read-back), which identifies what its row held
        when sampled. Pass it back with a later write-back (``update_priorities(...,
        generations=)``, ``update_rows(..., generations=)``) and the values for rows overwritten
        since (the ring wrapped, or a load replaced the rows) are dropped, not written onto the
        newer data.

        ``boundaries``: ``"allow"``, ``"mask"`` or ``"forbid"``, what a window may do at an episode
        end (:mod:`gpubuf.replay.buffer` says how). ``out`` may be a :class:`Transition` of
        preallocated tensors of exactly the returned shapes and dtypes on the buffer's device: the
        windows are written there and ``out`` is returned.

        With a ``rate_limiter`` (:class:`~gpubuf.RateLimiter`) the call, once its arguments are
        checked, waits for its turn having let go of the buffer's lock (``TimeoutError`` after the
        limiter's ``timeout``), and counts ``B`` samples; a sample that then raises gives them back.

        Pixel replay (each frame stored once, in ``observation``; no stored ``next_observation``):

        - ``frame_stack=k``: every observation leaf comes back as the stack of its row's last ``k``
          frames, ``frame_stride`` rows apart (a ``frame_stride`` other than 1 without
          ``frame_stack`` is a ``ValueError``), oldest first, ``(B, [n_steps,] k, ...)``
          (``next_observation`` too, with ``with_next_obs``). At an episode start the stack is
          padded with the episode's first frame, and never reaches a frame of the previous
          episode: an episode ends after a ``terminated`` or ``truncated`` row, or, when the
          buffer stores ``info["is_last"]`` (an env source's rows), after that row only. A stack
          never reaches a row the ring no longer holds: once the oldest rows of an episode are
          overwritten, its oldest frame held pads instead. Validity and probabilities of the
          starts are those of ``frame_stack=None``.
        - ``n_step_return=(n, gamma)`` (a buffer of ``n_steps=1``): each transition becomes the
          n-step one: ``reward`` the discounted sum of the rewards of up to ``n`` rows from the
          start (float32; float64 for a float64 reward), ``discount`` the bootstrap value's factor
          ``gamma**m`` after ``m`` rewards, 0 when they end in a termination (``terminated``
          True), ``next_observation`` the observation (stacked with ``frame_stack``) to bootstrap
          from, ``truncated`` True where fewer than ``n`` rewards were taken without a
          termination: at a truncation (or an ``info["is_last"]`` row) the return stops before
          that row and bootstraps from its observation (a row both terminated and truncated is a
          termination); likewise it stops before the newest row held, whose reward is not taken
          while its next observation is not stored, and bootstraps from that row's observation.
          Other leaves (``action``, ``info``) are the start row's. Starts are drawn as with
          ``with_next_obs=True`` (never a row truncated but not terminated). Needs a ``terminated``
          leaf. ``out`` is not offered with either argument.

        The flags (``with_replacement``, ``with_next_obs``, ``return_indices``, ``return_generations``) must be
        bools (``None`` where it means the default): ``TypeError`` naming the flag otherwise.
        """
        if type(with_next_obs) is not bool:
            with_next_obs = check_bool("with_next_obs", with_next_obs)
        if with_replacement is not None and type(with_replacement) is not bool:
            with_replacement = check_bool("with_replacement", with_replacement)
        return self._sample(key, self.default_with_replacement if with_replacement is None
                            else with_replacement, batch_size, with_next_obs, boundaries, out,
                            self.default_return_indices if return_indices is None
                            else return_indices, frame_stack, frame_stride, n_step_return,
                            return_generations)
