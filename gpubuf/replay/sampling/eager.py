"""EagerSample: a buffer's sample call as a driver of its plans: check, (wait for a rate limiter,) draw, read, weigh.

The :class:`~gpubuf.replay.sampling.plan.SamplePlan` of each configuration comes from the reader, built once and then
cached. A sample that raises leaves the generator as it was.
"""

import torch

from gpubuf import ops
from gpubuf._core.concurrency import locked
from gpubuf._core.inputs import check_bool, generator_for
from gpubuf.replay.feeds import write_backs


class EagerSample:
    """Mixed into :class:`~gpubuf.TransitionBuffer`, which provides ``config``, ``ring``, ``sampler``, ``selector``,
    ``reader``, ``generator``, ``rate_limiter``, ``lock`` and its memory ranges (``_owned``): the entry ``_sample`` of
    :meth:`~gpubuf.replay.sampling.sample_args.Samples.sample` and the checks a :class:`~gpubuf.GraphSampler` shares."""

    def check_sample_args(self, batch_size, with_replacement: bool, with_next_obs: bool,
                          boundaries: str = "allow") -> tuple[int, int]:
        """``(B, validity kind)`` of a :meth:`sample` call, or its error (run under :attr:`lock`; takes none)."""
        B, kind = self.config.batch_size(batch_size), self.config.kind(with_next_obs, boundaries)
        self._check_draw(kind, B, with_replacement)
        return B, kind

    def _check_draw(self, kind: int, B: int, with_replacement: bool) -> None:
        distinct = not with_replacement if self.selector is None else self.selector.distinct(with_replacement)
        self.sampler.check_draw(kind, B, not distinct)
        if self.selector is not None:
            self.selector.check(kind, B, with_replacement)

    def _sample_held(self, key, with_replacement, batch_size, with_next_obs, boundaries, out,
                     return_indices, frame_stack, frame_stride, n_step_return, return_generations=False):
        """:meth:`sample` with the buffer's defaults resolved, under the caller's call lock: check, draw, read."""
        if type(with_next_obs) is not bool:
            with_next_obs = check_bool("with_next_obs", with_next_obs)
        if type(with_replacement) is not bool:
            with_replacement = check_bool("with_replacement", with_replacement)
        if type(return_indices) is not bool:
            return_indices = check_bool("return_indices", return_indices)
        if type(return_generations) is not bool:
            return_generations = check_bool("return_generations", return_generations)
        if self._hub is not None:
            self._hub.collect()
        reader = self.reader
        plain = frame_stack is None and n_step_return is None and type(frame_stride) is int and frame_stride == 1
        spec = None if plain else reader.spec(frame_stack, frame_stride, n_step_return, out)  # steady: no call
        returns = spec is not None and spec.n is not None
        if self.rate_limiter is None:
            B, kind = self.check_sample_args(batch_size, with_replacement, with_next_obs or returns, boundaries)
            return self._draw_and_read(key, B, kind, with_replacement, with_next_obs, boundaries, out,
                                       spec, return_indices, return_generations)
        B, kind = self.config.batch_size(batch_size), self.config.kind(with_next_obs or returns, boundaries)
        self.rate_limiter.take("sample", B)  # waits for its turn, letting go of the lock
        try:
            self._check_draw(kind, B, with_replacement)  # the rows as they are after the wait
            return self._draw_and_read(key, B, kind, with_replacement, with_next_obs, boundaries, out,
                                       spec, return_indices, return_generations)
        except BaseException:
            self.rate_limiter.give_back("sample", B)
            raise

    _sample = locked(_sample_held)  # the entry of the deprecated forms, which take the lock here

    def _draw_and_read(self, key, B, kind, with_replacement, with_next_obs, boundaries, out, spec,
                       return_indices, return_generations):
        """Draw ``B`` starts of ``kind`` and read their batch (under the lock): the stages of the call's plan."""
        g = generator_for(key, self.generator)
        plan, what = self.reader.plan(B, with_next_obs, boundaries, spec, with_replacement, out, self._owned)
        # a failed sample leaves the generator as it was (an int key's is new for this call)
        rng = g.get_state() if key is None or isinstance(key, torch.Generator) else None
        try:
            # the stacks' and returns' outputs before the draw: a failed allocation draws nothing
            outputs = None if plan.stacks is None else plan.outputs()
            idx, mass = (self.selector or self.sampler).draw(kind, B, g, with_replacement)
            batch = plan.read(idx, outputs)
            plan.weigh(batch, mass)
            if out is None and self.config.sample_dtypes:
                batch = self.config.widened(batch)
        except BaseException as err:
            if rng is not None:
                g.set_state(rng)
            if ops.allocation_failed(err):
                raise ops.memory_error("batch_size", what, err) from None
            raise
        if return_generations:
            return batch, idx, write_backs.generations(self.ring, idx)
        return (batch, idx) if return_indices else batch
