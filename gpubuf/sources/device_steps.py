"""DeviceSteps: a :class:`~gpubuf.TensorSource` step with no host read, for a loop traced whole or captured in a CUDA
graph with its simulator.

A simulator that resets finished envs inside the step (Isaac Lab, MuJoCo Playground, Brax) hands over device tensors
every step. With ``TensorSource(..., capturable=True)`` its :meth:`~gpubuf.TensorSource.step` writes the row each env
completed into the vectorized ``transitions`` buffer (through its
:class:`~gpubuf.replay.capturable.writer.GraphWriter`), appends the step to the ``history`` (through its
:class:`~gpubuf.history.graph_append.HistoryGraphWriter`, the ended envs' histories restarting at their reset frames)
and keeps each env's pending observation, all with device ops. The value checks the eager step makes on the host
(non-finite actions, actions outside a ``Discrete`` space, flags other than 0/1, casts that change a value) run on
the device: a step that fails one writes nothing anywhere and keeps the pending observations; it is counted as dropped
and raised by the buffers' next eager call (or the writers' ``check()``). It stores what the eager step stores
(:mod:`gpubuf.sources.rows`, a vectorized buffer of an env that resets inside the step) and returns the same
:class:`~gpubuf.sources.staging.Step`, whose ``first`` is then a device bool tensor (the envs that ended, read by
nothing).
"""

import torch

from gpubuf._core.inputs import cast_keeps_values, cast_refusal, lossless
from gpubuf._core.transition import Transition
from gpubuf.replay.capturable.writer import check_writable
from gpubuf.sources.staging import Step


class DeviceSteps:
    """The device side of a capturable :class:`~gpubuf.TensorSource`: ``source`` (its buffers, stager and envs), its row
    writer ``rows`` and action codec ``codec``, one env's observation ``obs_shape`` and ``obs_dtype``, and the graph
    writer of the attached buffer (bound at each ``reset``)."""

    def __init__(self, source, rows, codec, obs_shape: tuple, obs_dtype: torch.dtype):
        self.source, self.rows, self.codec, self.obs_shape, self.obs_dtype = source, rows, codec, obs_shape, obs_dtype
        self.tb = self.writer = self.history = self.appender = None
        self.fill = torch.tensor(source.stager.action_fill, dtype=torch.float32, device=source.device)

    def check(self) -> None:
        """Before a reset: ``ValueError`` naming the argument unless the attached buffers can be written on the
        device (a vectorized buffer a graph writer can write)."""
        tb = self.source.transitions
        if tb is not None and not tb.vectorized_env:
            raise ValueError("transitions: a capturable TensorSource writes a vectorized buffer (one row per env per "
                             "step), got one with vectorized_env=False")
        if tb is not None and tb is not self.tb:
            check_writable(tb)

    def bind(self) -> None:
        """After a reset: the graph writer of the attached buffer, and the row writer's episode state as after a step
        (every env's episode holds rows from the next step on)."""
        tb, history = self.source.transitions, self.source.history
        if tb is not self.tb:
            self.tb, self.writer = tb, None if tb is None else tb.graph_writer()
        if history is not self.history:
            self.history, self.appender = history, None if history is None else history.graph_writer()
        self.rows.mark_stepped()

    def step(self, actions, obs, reward, terminated, truncated) -> Step:
        """One simulator step of every env, as :meth:`~gpubuf.TensorSource.step` takes it (device tensors)."""
        src, n = self.source, self.source.n_envs
        if self.tb is not src.transitions or self.history is not src.history:
            raise RuntimeError("step: a capturable TensorSource's buffers changed since its reset(); reset() again")
        acts, ok = self.codec.device_checked(actions, n)
        reward, fits = self._values(reward, "reward", (n,), torch.float32)
        flags = []
        for name, value in (("terminated", terminated), ("truncated", truncated)):
            t, good = self._values(value, name, (n,), torch.bool)
            flags.append(t)
            fits = fits & good
        _, good = self._values(obs, "obs", (n, *self.obs_shape), self.obs_dtype)  # kept as given, as the eager step
        if self.rows.obs_storage is not None:  # stored a step later, in the buffer's narrower dtype: fits it now
            good = good & cast_keeps_values(obs.detach(), self.rows.obs_storage)
        obs, ok = obs.detach(), ok & fits & good
        term, trunc = flags
        prev, ended = self.rows.pending_obs, term | trunc
        row = Transition(observation=prev[None], action=acts[None], reward=reward[None], terminated=term[None],
                         truncated=trunc[None])
        echo = torch.where(ended[:, None], self.fill, acts.reshape(n, -1).to(torch.float32))
        info = {src.stager.obs_key: obs[:, None], "action": echo[:, None],
                "reward": torch.where(ended, 0.0, reward)[:, None], "terminated": (term & ~ended)[:, None],
                "truncated": (trunc & ~ended)[:, None]}
        # what can fail on the host fails before anything is written
        if self.writer is not None:
            self.writer.check_inputs(row, ok)
        if self.appender is not None:
            self.appender.check_inputs(info, ended, ok)
        if self.writer is not None:
            self.writer.insert(row, valid=ok)
        if self.appender is not None:  # the ended envs' reset frames start new histories
            self.appender.append(info, reset=ended, valid=ok)
        prev.copy_(torch.where(ok, obs.to(prev.dtype), prev))
        return Step(info, src.stager.all_ids, ended)

    def _values(self, value, name: str, shape: tuple, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(value as dtype, () bool whether its values fit)``: a device tensor of ``shape`` (``ValueError``/
        ``TypeError`` naming ``name`` otherwise); flags must be 0 or 1."""
        dev = self.source.device
        if not isinstance(value, torch.Tensor) or value.device.type != dev.type or tuple(value.shape) != shape \
                or value.layout != torch.strided:
            got = f"{value.dtype} {tuple(value.shape)} on {value.device}" if isinstance(value, torch.Tensor) \
                else type(value).__name__
            raise ValueError(f"{name}: expected a dense tensor shaped {shape} on {dev}, got {got}")
        value, yes = value.detach(), torch.ones((), dtype=torch.bool, device=value.device)
        if dtype == torch.bool:
            if value.dtype == torch.bool:
                return value, yes
            if value.is_floating_point() or value.is_complex():
                raise TypeError(f"{name}: expected bools (or 0/1 integers), got {value.dtype}")
            return value != 0, ((value == 0) | (value == 1)).all()
        why = cast_refusal(value.dtype, dtype)
        if why:
            raise TypeError(f"{name}: cannot store {value.dtype} as {dtype} ({why})")
        fits = yes if lossless(value.dtype, dtype) else cast_keeps_values(value, dtype)
        return value.to(dtype), fits

