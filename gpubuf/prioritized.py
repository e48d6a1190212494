"""PrioritizedTransitionBuffer: a TransitionBuffer composed with a :class:`~gpubuf.samplers.PrioritizedSampler`.

The sampler keeps priorities on the device (``(M*E,)`` float32) next to its prefix-sum trees; new starts get
the running maximum priority, updates rewrite only the touched leaves and their parents. The running
maximum is mirrored on the host (every update already checks its values there), so inserts never read it back.
This module adds the prioritized API: argument checks, importance-sampling weights, priority updates and
their checkpoint state.
"""

import math

import numpy as np
import torch

from gpubuf.inputs import as_tensor, finite_float
from gpubuf.interrupts import signals_held
from gpubuf.replay import TransitionBuffer
from gpubuf.samplers import PrioritizedSampler
from gpubuf.state import check_tensor, chunks, copy_into, unaliased
from gpubuf.transition import Transition

_F32 = torch.finfo(torch.float32)
_LOG_MAX = math.log(torch.finfo(torch.float64).max)
_LOG_TINY = math.log(torch.finfo(torch.float64).tiny)


def _f32(x: float) -> float:
    """``x`` rounded to float32, as the priorities are stored."""
    return float(np.float32(x))


class PrioritizedTransitionBuffer(TransitionBuffer):
    """A :class:`TransitionBuffer` with prioritized experience replay over sequence starts.

    Extra args: ``alpha`` (priority exponent; 0 is uniform), ``beta`` (importance-sampling exponent, see
    :meth:`update_beta`), ``eps`` (> 0, added to ``|td|`` so no start gets zero probability). Storage tiers
    (``storage_device``, ``storage_dir``) as in :class:`TransitionBuffer`; priorities stay on ``device``.

    Each start has a raw priority (float32); newly inserted starts get the running ``max_priority``
    (initially 1, never decreasing). ``P_i = p_i**alpha / sum over valid starts``. :meth:`sample` returns
    ``(Transition, flat_indices)`` with ``PER_weights = (N*P_i)**-beta / max over the batch``, which equals
    ``(P_i / min_batch P)**-beta``. Without replacement (**the default here**, as in the original PER
    buffer; the uniform :class:`TransitionBuffer` defaults to with replacement) the draw is exact sequential
    sampling without replacement (Plackett-Luce): see :class:`TransitionBuffer` for how and what it costs.

    Every valid start has a positive, finite mass: ``eps`` must survive float32 and ``eps**alpha`` float64
    (checked here), and an update whose ``max_priority**alpha`` summed over all starts would overflow
    float64 is rejected (``ValueError`` naming ``td_errors`` and ``alpha``). :meth:`update_priorities`
    validates its inputs where they live: host inputs on the host (no device read), device inputs with one
    read-back.
    """

    def __init__(self, max_size: int, sample_batch_size: int, data_sample: Transition, vectorized_env: bool = True,
                 n_steps: int = 1, alpha: float = 0.6, beta: float = 0.4, eps: float = 1e-6, *, device=None,
                 seed: int | None = None, storage_device=None, storage_dir=None):
        self.alpha = finite_float("alpha", alpha, 0.0)
        self.beta = finite_float("beta", beta, 0.0)
        self.eps = finite_float("eps", eps, 0.0, low_open=True)
        if _f32(self.eps) < _F32.tiny:
            raise ValueError(f"eps: expected at least {_F32.tiny:g} (priorities are float32), got {eps!r}")
        if self.alpha * math.log(_f32(self.eps)) < _LOG_TINY:
            raise ValueError(f"eps, alpha: eps**alpha = {_f32(self.eps):g}**{self.alpha:g} underflows float64, so a "
                             "start with a zero TD error could never be drawn; raise eps or lower alpha")
        super().__init__(max_size, sample_batch_size, data_sample, vectorized_env, n_steps, device=device, seed=seed,
                         storage_device=storage_device, storage_dir=storage_dir)
        self._check_mass("alpha", 1.0)

    def _make_sampler(self) -> PrioritizedSampler:
        return PrioritizedSampler(self._ring, self.device, self.backend, self.alpha)

    @property
    def max_priority(self) -> float:
        """The running maximum priority."""
        return self._sampler.max_priority

    def _check_mass(self, name: str, top: float) -> None:
        """Raise unless ``top**alpha`` summed over every start stays finite in float64."""
        if top > 0 and self.alpha * math.log(top) + math.log(self.max_size) >= _LOG_MAX:
            raise ValueError(f"{name}: priority {top:g} ** alpha {self.alpha:g} over {self.max_size} starts "
                             "overflows float64 sampling mass; lower alpha or scale the TD errors")

    @torch.compiler.disable  # an opaque call under torch.compile: no guards on host state, no recompiles
    def sample(self, key=None, with_replacement: bool = False, batch_size: int | None = None,
               with_next_obs: bool = False, boundaries: str = "allow", *,
               out: Transition | None = None) -> tuple[Transition, torch.Tensor]:
        """``(batch, flat_indices)``: windows from starts drawn with probability ``P_i``; the batch carries
        ``PER_weights`` (B,) float32. Shapes, ``key``, ``with_next_obs``, ``boundaries`` and ``out`` as in
        :meth:`TransitionBuffer.sample` (``out.PER_weights`` is replaced by a fresh tensor). Note the default
        ``with_replacement=False``. ``flat_indices`` (B,) int64 are flat starts ``row * n_envs + env``
        (:meth:`~TransitionBuffer.locate` maps them to env, ring row and the env's own row count). Rows of an
        :class:`~gpubuf.EnvPoolSource` that hold no transition (``info["is_last"]``) never start a window;
        ``P_i`` is then taken over the other starts."""
        B, kind = self._check_sample_args(batch_size, with_replacement, with_next_obs, boundaries)
        dst = self._check_out(out, B, with_next_obs)
        idx, mass = self._sampler.draw(kind, B, self._generator(key), with_replacement)
        batch = self._with_flags(self._gather(idx, dst, out), boundaries)
        batch.PER_weights = (mass / mass.min()).pow_(-self.beta).to(torch.float32)
        return batch, idx

    @torch.compiler.disable  # an opaque call under torch.compile: no guards on host state, no recompiles
    def update_priorities(self, indices, td_errors):
        """Set priorities ``|td| + eps`` (float32) of flat starts ``indices``; returns ``self``.

        Duplicate indices keep their largest value. ``max_priority`` becomes ``max(max_priority, new)``.
        Empty inputs do nothing. Raises (writing nothing) on non-integer or out-of-range indices, a length
        mismatch, NaN/inf results, or a priority whose ``**alpha`` mass would overflow.
        """
        if self._dir is not None:  # a closed storage_dir buffer could not flush the change
            self._check_open()
        idx = as_tensor(np.asarray(indices) if isinstance(indices, (list, tuple)) else indices, "indices")
        td = as_tensor(np.asarray(td_errors) if isinstance(td_errors, (list, tuple)) else td_errors, "td_errors")
        if idx.numel() == 0 and td.numel() == 0 and idx.dim() <= 1 and td.dim() <= 1:
            return self
        if idx.dim() != 1 or (idx.numel() and (idx.dtype.is_floating_point or idx.dtype.is_complex
                                                or idx.dtype == torch.bool)):
            raise TypeError(f"indices: expected a 1-D integer array, got {idx.dtype} of shape {tuple(idx.shape)}")
        if td.dim() != 1 or td.shape[0] != idx.shape[0] or td.dtype.is_complex or td.dtype == torch.bool:
            raise ValueError(f"td_errors: expected a real 1-D array of {idx.shape[0]} values (one per index), "
                             f"got {td.dtype} of shape {tuple(td.shape)}")
        if idx.numel() == 0:
            idx = idx.to(torch.int64)  # an empty list reads as float64
        on_host = idx.device.type == "cpu" and td.device.type == "cpu"
        if on_host and idx.dtype != torch.int64:  # unsigned and narrow ints: checked and widened on the host
            idx = torch.from_numpy(self._host_indices(idx.numpy()))
        new = td.to(torch.float32).abs().add_(self.eps)  # where td lives
        if on_host:  # host inputs are checked where they are: nothing is read back from the device
            top = self._check_update(idx, td, new)
        idx = self._staging.stage(idx, "__upd_idx__", torch.int64)  # contiguous: the kernels assume unit stride
        new = self._staging.stage(new, "__upd_td__", torch.float32)
        if not on_host:  # device inputs: one read-back of (min index, max index, max value)
            top = self._check_update(idx, td, new)
        # ---- all checks passed: write
        with signals_held():
            self._sampler.update(idx, new, top)
        return self

    def _host_indices(self, arr: np.ndarray) -> np.ndarray:
        L = self.max_size
        bad = (arr >= L) if arr.dtype.kind == "u" else (arr < 0) | (arr >= L)
        if bad.any():
            raise IndexError(f"indices: expected flat start indices in [0, {L}), got {arr[bad][:5].tolist()}")
        return arr.astype(np.int64)

    def _check_update(self, idx: torch.Tensor, td: torch.Tensor, new: torch.Tensor) -> float:
        """Raise on indices outside ``[0, max_size)``, non-finite ``|td| + eps`` (``new``), or an overflowing
        mass; returns the largest new priority."""
        lo, hi = torch.aminmax(idx)
        top = new.max()  # NaN or inf here iff anywhere
        if idx.device.type == "cpu":
            lo, hi, top_value = lo.item(), hi.item(), top.item()
        else:
            lo, hi, top_value = torch.stack([lo.double(), hi.double(), top.double()]).tolist()
        L = self.max_size
        if lo < 0 or hi >= L:
            raise IndexError(f"indices: expected flat start indices in [0, {L}), got "
                             f"{idx[(idx < 0) | (idx >= L)][:5].tolist()}")
        if not math.isfinite(top_value):
            raise ValueError(f"td_errors: |td| + eps must be finite (float32), got "
                             f"{td[~torch.isfinite(new.to(td.device))][:5].tolist()}")
        self._check_mass("td_errors, alpha", top_value)
        return top_value

    def update_beta(self, beta: float):
        """Set the importance-sampling exponent; returns ``self``. Every :class:`~gpubuf.GraphSampler` of this
        buffer follows it, in captured graphs too (through :attr:`beta_tensor`). A closed ``storage_dir`` buffer
        refuses (its next flush could not keep it)."""
        if self._dir is not None:
            self._check_open()
        self.beta = beta
        return self

    _beta_tensor: torch.Tensor | None = None  # created by the first read of beta_tensor

    @property
    def beta(self) -> float:
        """The importance-sampling exponent (``>= 0``) of ``PER_weights``; set by :meth:`update_beta`,
        :meth:`load_state_dict` and a re-opened ``storage_dir``. A bad value raises naming ``beta``."""
        return self._beta

    @beta.setter
    def beta(self, value: float) -> None:
        self._beta = finite_float("beta", value, 0.0)
        if self._beta_tensor is not None:
            self._beta_tensor.fill_(self._beta)  # in place, no host sync: captured graphs read it at replay

    @property
    def beta_tensor(self) -> torch.Tensor:
        """``()`` float64 on ``device`` holding :attr:`beta`, refreshed in place on every change of it (the same
        tensor for the buffer's life), for device code that reads beta when it runs, such as a CUDA graph of a
        :class:`~gpubuf.GraphSampler`. Read it; change beta through :meth:`update_beta`."""
        if self._beta_tensor is None:
            self._beta_tensor = torch.full((), self._beta, dtype=torch.float64, device=self.device)
        return self._beta_tensor

    # ------------------------------------------------------------------ state

    _CONFIG = TransitionBuffer._CONFIG + ("alpha", "eps")

    def state_dict(self) -> dict:
        state = super().state_dict()
        state.update(beta=self.beta, priority=self._sampler.priority, max_priority=self._sampler.max_priority)
        return state

    def _check_extra_state(self, state) -> tuple[float, float]:
        beta = finite_float("state_dict['beta']", state["beta"], 0.0)
        top = finite_float("state_dict['max_priority']", state["max_priority"], 1.0)
        self._check_mass("state_dict['max_priority']", top)
        self._check_priorities("state_dict['priority']", state["priority"], top, state["pos"], state["count"])
        return beta, top

    def _check_priorities(self, where: str, prio, top: float, pos: int, count: int) -> None:
        """Raise unless ``prio`` is ``(max_size,)`` float32 with every value in ``[0, top]`` and those of the starts
        in the ``count`` rows before row ``pos`` (the rows held) at least ``eps``."""
        check_tensor(where, prio, (self.max_size,), torch.float32)
        M, E = self.max_rows, self.n_envs
        oldest, at = (pos - count) % M, 0
        for piece in chunks(prio):
            rows = torch.arange(at, at + piece.numel()) // E
            held = piece[(rows - oldest) % M < count]
            if not bool(torch.isfinite(piece).all()) or not (float(piece.min()) >= 0 and float(piece.max()) <= top) \
                    or (held.numel() and float(held.min()) < _f32(self.eps)):
                raise ValueError(f"{where}: expected priorities of held starts in [{_f32(self.eps):g}, max_priority "
                                 f"{top:g}] and of the others in [0, max_priority], all finite")
            at += piece.numel()

    def _flush_extra(self) -> dict:
        return {"priority": self._sampler.priority.cpu(), "max_priority": self._sampler.max_priority,
                "beta": self.beta}

    def _reopen_extra(self, state: dict | None, since: int) -> None:
        sampler = self._sampler
        if state is not None:  # checked as a load_state_dict would, before anything is restored
            beta = finite_float("beta", state["beta"], 0.0)
            top = finite_float("max_priority", state["max_priority"], 1.0)
            self._check_mass("max_priority", top)
            ring = self._ring  # the rows held at the flush: those held now, less the `since` newest
            self._check_priorities("priority", state["priority"], top, (ring.pos - since) % self.max_rows,
                                   ring.count - since)
            sampler.priority.copy_(state["priority"])
            sampler.max_priority, self.beta = top, beta
        if since:  # rows written after the flush: new starts take the running max priority
            M = self.max_rows
            first_row = (self._ring.pos - since) % M
            first = min(since, M - first_row)
            sampler.rows_written(first_row, first, since)

    def _load_extra_state(self, state, extra: tuple[float, float]) -> None:
        priority = self._sampler.priority
        copy_into(priority, unaliased({"priority": state["priority"]}, {"priority": priority}, self._owned)["priority"])
        self.beta, self._sampler.max_priority = extra


__all__ = ["PrioritizedTransitionBuffer"]
