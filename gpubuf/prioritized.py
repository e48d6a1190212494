"""PrioritizedTransitionBuffer: a TransitionBuffer whose prefix-sum tree holds ``priority**alpha`` per start.

Priorities live on the device (``(M*E,)`` float32) next to the tree (:mod:`gpubuf.prefix_tree`); new starts
get the running maximum priority, updates rewrite only the touched leaves and their parents.
"""

import math

import numpy as np
import torch

from gpubuf.replay import Transition, TransitionBuffer
from gpubuf.staging import as_tensor


def _nonneg_float(name: str, value, positive: bool = False) -> float:
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    if not ok or not np.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{name}: expected a finite {'positive' if positive else 'non-negative'} number, "
                         f"got {value!r}")
    return float(value)


class PrioritizedTransitionBuffer(TransitionBuffer):
    """A :class:`TransitionBuffer` with prioritized experience replay over sequence starts.

    Extra args: ``alpha`` (priority exponent; 0 is uniform), ``beta`` (importance-sampling exponent, see
    :meth:`update_beta`), ``eps`` (> 0, added to ``|td|`` so no start gets zero probability).

    Each start has a raw priority; newly inserted starts get the running ``max_priority`` (initially 1,
    never decreasing). ``P_i = p_i**alpha / sum over valid starts``. :meth:`sample` returns
    ``(Transition, flat_indices)`` with ``PER_weights = (N*P_i)**-beta / max over the batch``, which equals
    ``(P_i / min_batch P)**-beta``. Without replacement (the default) the draw is exact sequential
    sampling without replacement (Plackett-Luce): see :class:`TransitionBuffer` for how and what it costs.
    :meth:`update_priorities` validates its inputs where they live: host inputs on the host (no device read),
    device inputs with one read-back.
    """

    _prioritized = True

    def __init__(self, max_size: int, sample_batch_size: int, data_sample: Transition, vectorized_env: bool = True,
                 n_steps: int = 1, alpha: float = 0.6, beta: float = 0.4, eps: float = 1e-6, *, device=None,
                 seed: int | None = None):
        self.alpha = _nonneg_float("alpha", alpha)
        self.beta = _nonneg_float("beta", beta)
        self.eps = _nonneg_float("eps", eps, positive=True)
        super().__init__(max_size, sample_batch_size, data_sample, vectorized_env, n_steps, device=device, seed=seed)
        self._max_priority = torch.ones((), dtype=torch.float32, device=self.device)
        self._priority_rows = self._priority.view(self.max_rows, self.n_envs)

    @property
    def max_priority(self) -> float:
        """The running maximum priority (reads the device)."""
        return float(self._max_priority)

    def _on_rows_written(self, pos: int, first: int, T: int) -> None:
        prio = self._priority_rows
        prio[pos:pos + first] = self._max_priority
        if first < T:  # wrapped
            prio[:T - first] = self._max_priority

    def _range_mass(self, lo: int, hi: int, ok: np.ndarray, all_ok: bool, key: str) -> torch.Tensor:
        mass = self._priority[lo:hi].to(torch.float64).pow_(self.alpha)
        return mass if all_ok else mass.mul_(self._upload(ok, key))  # invalid starts: zero mass

    def sample(self, key=None, with_replacement: bool = False, batch_size: int | None = None,
               with_next_obs: bool = False, *, out: Transition | None = None) -> tuple[Transition, torch.Tensor]:
        """``(batch, flat_indices)``: windows from starts drawn with probability ``P_i``; the batch carries
        ``PER_weights`` (B,) float32. Shapes, ``with_next_obs`` and ``out`` as in :meth:`TransitionBuffer.sample`
        (``out.PER_weights`` is replaced by a fresh tensor)."""
        B, kind = self._check_sample_args(batch_size, with_replacement, with_next_obs)
        dst = self._check_out(out, B, with_next_obs)
        idx, mass = self._draw(self._trees[kind], B, self._generator(key), with_replacement)
        batch = self._gather(idx, dst, out)
        batch.PER_weights = (mass / mass.min()).pow_(-self.beta).to(torch.float32)
        return batch, idx

    def update_priorities(self, indices, td_errors):
        """Set priorities ``|td| + eps`` of flat starts ``indices``; returns ``self``.

        Duplicate indices keep their largest value. ``max_priority`` becomes ``max(max_priority, new)``.
        Raises (writing nothing) on non-integer or out-of-range indices, a length mismatch, or NaN/inf results.
        """
        idx = as_tensor(np.asarray(indices) if isinstance(indices, (list, tuple)) else indices, "indices")
        td = as_tensor(np.asarray(td_errors) if isinstance(td_errors, (list, tuple)) else td_errors, "td_errors")
        if idx.dim() != 1 or idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
            raise TypeError(f"indices: expected a 1-D integer array, got {idx.dtype} of shape {tuple(idx.shape)}")
        if td.dim() != 1 or td.shape[0] != idx.shape[0] or td.dtype.is_complex or td.dtype == torch.bool:
            raise ValueError(f"td_errors: expected a real 1-D array of {idx.shape[0]} values (one per index), "
                             f"got {td.dtype} of shape {tuple(td.shape)}")
        if idx.numel() == 0:
            return self
        on_host = idx.device.type == "cpu" and td.device.type == "cpu"
        new = td.to(torch.float32).abs().add_(self.eps)  # where td lives
        if on_host:  # host inputs are checked where they are: nothing is read back from the device
            self._check_update(idx, td, new)
        idx = self._staging.to_device(idx, "__upd_idx__").to(torch.int64).contiguous()  # kernels assume unit stride
        new = self._staging.to_device(new, "__upd_td__")
        if not on_host:  # device inputs: one read-back of (min index, max index, max value)
            self._check_update(idx, td, new)
        top = new.max()
        self._priority.scatter_reduce_(0, idx, new, "amax", include_self=False)
        torch.maximum(self._max_priority, top, out=self._max_priority)
        p = self._priority.index_select(0, idx).to(torch.float64).pow_(self.alpha)
        for kind in self._active:
            tree = self._trees[kind]
            tree.update(idx, p * (tree.leaves(idx) > 0))  # invalid starts keep zero mass
        return self

    def _check_update(self, idx: torch.Tensor, td: torch.Tensor, new: torch.Tensor) -> None:
        """Raise on indices outside ``[0, max_size)`` or non-finite ``|td| + eps`` (``new``), both (K,)."""
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
            raise ValueError(f"td_errors: |td| + eps must be finite and non-negative, got "
                             f"{td[~torch.isfinite(new.to(td.device))][:5].tolist()}")

    def update_beta(self, beta: float):
        """Set the importance-sampling exponent; returns ``self``."""
        self.beta = _nonneg_float("beta", beta)
        return self

    _CONFIG = TransitionBuffer._CONFIG + ("alpha", "eps")

    def state_dict(self) -> dict:
        state = super().state_dict()
        state.update(beta=self.beta, priority=self._priority.clone(), max_priority=self._max_priority.clone())
        return state

    def load_state_dict(self, state) -> None:
        super().load_state_dict(state)
        self._priority.copy_(torch.as_tensor(state["priority"]))
        self._max_priority.copy_(torch.as_tensor(state["max_priority"]))
        self.beta = float(state["beta"])


__all__ = ["PrioritizedTransitionBuffer"]
