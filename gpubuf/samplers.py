"""Sampling policies of the replay buffers: which flat starts a batch begins at, and with what mass.

A policy is composed into a :class:`~gpubuf.TransitionBuffer`. It owns the device side of sampling: one
:class:`~gpubuf.prefix_tree.PrefixSumTree` and one validity mask per validity kind (see
:class:`~gpubuf.ring.StartRing`), and, when prioritized, the priorities. The ring's host bookkeeping says
which starts are valid; the policy turns that into mass: 1 per valid start (:class:`UniformSampler`) or
``priority**alpha`` (:class:`PrioritizedSampler`), 0 per invalid one. A valid start's mass is never zero.
"""

import numpy as np
import torch

from gpubuf import ops
from gpubuf.interrupts import signals_held
from gpubuf.prefix_tree import PrefixSumTree
from gpubuf.ring import StartRing
from gpubuf.staging import Staging


class UniformSampler:
    """Uniform sampling over the valid starts of a :class:`StartRing` (each kind's tree built on first use)."""

    prioritized = False

    def __init__(self, ring: StartRing, device: torch.device, backend: str):
        self.ring, self.device, self.backend = ring, device, backend
        self.trees: dict[int, PrefixSumTree] = {}  # per kind, allocated on first use
        self.valid: dict[int, torch.Tensor] = {}  # (M*E,) bool device validity mask per kind, likewise
        self.active: set[int] = set()  # kinds whose tree and mask are kept up to date
        self.allocations = 0  # bumped whenever tensors() grows
        self._staging = Staging(device)

    def tensors(self) -> list[torch.Tensor]:
        """Every device tensor the policy holds (trees and masks exist once their kind was first used)."""
        return [*(t.tree for t in self.trees.values()), *self.valid.values()]

    def activate(self, kind: int) -> None:
        """Build the tree and mask of ``kind`` (allocated on first use, then one pass over every row) unless
        they are kept already; signals are held meanwhile, and the kind counts as kept only once built."""
        if kind not in self.active:
            if kind not in self.trees:
                L = self.ring.max_rows * self.ring.n_envs
                tree = PrefixSumTree(L, self.device, self.backend)
                self.valid[kind] = ops.allocate({"valid": (L,)}, {"valid": torch.bool}, self.device)["valid"]
                self.trees[kind] = tree
                self.allocations += 1
            with signals_held():
                self.refresh_rows(kind, 0, self.ring.max_rows)
                self.active.add(kind)

    def forget(self) -> None:
        """The rows changed wholesale (a load): drop every kind's validity and rebuild the kinds in use now, so
        tensors handed out earlier (a GraphSampler's tree) stay current."""
        self.ring.forget_validity()
        for kind in sorted(self.active):
            self.refresh_rows(kind, 0, self.ring.max_rows)

    def rows_written(self, pos: int, first: int, T: int) -> None:
        """New rows ``pos .. pos+first-1`` and ``0 .. T-first-1`` were written (before validity is refreshed)."""

    def refresh_after_write(self, old_pos: int, T: int) -> None:
        """Refresh the starts whose windows changed after ``T`` rows were written at ``old_pos``."""
        if not self.active:
            return
        segments = self.ring.changed_rows(old_pos, T, self.active)
        for kind in sorted(self.active):
            for r0, r1 in segments:
                self.refresh_rows(kind, r0, r1)

    def refresh_rows(self, kind: int, r0: int, r1: int) -> None:
        """Validity (host and device mask) and tree leaves of the starts in rows ``[r0, r1)``, then their parents."""
        ok, n_ok = self.ring.refresh(kind, r0, r1)
        lo, hi = r0 * self.ring.n_envs, r1 * self.ring.n_envs
        mask = self.valid[kind][lo:hi]
        if n_ok == hi - lo:
            mask.fill_(True)
        else:
            mask.copy_(self._staging.to_device(torch.from_numpy(ok), f"__valid{kind}_{r0 == 0}__"))
        self.trees[kind].update_range(lo, self.mass(slice(lo, hi), mask, n_ok == hi - lo))

    def mass(self, starts, valid: torch.Tensor, all_valid: bool) -> torch.Tensor:
        """Sampling mass (float64, on the device) of flat ``starts`` (a slice or index tensor) given their device
        validity ``valid`` (``all_valid``: all of them valid)."""
        return valid.to(torch.float64)

    def sampling_mass(self, kind: int) -> torch.Tensor:
        """``(M*E,)`` float64 copy of every start's mass for ``kind``."""
        self.activate(kind)
        return self.trees[kind].tree[:self.trees[kind].capacity].clone()

    def uniforms(self, g: torch.Generator, n: int) -> torch.Tensor:
        """(n,) float64 uniforms in [0, 1) on the device, drawn by ``g`` on its own device."""
        u = torch.rand(n, dtype=torch.float64, generator=g, device=g.device)
        return self._staging.to_device(u, "__uniform__")

    def draw(self, kind: int, B: int, g: torch.Generator, with_replacement: bool):
        """``(flat starts (B,) int64, their masses (B,) float64 or None)`` drawn with generator ``g``. With
        replacement, while the valid starts are one ring range of rows, they are drawn from the range
        directly (no tree descent, no masses); otherwise the tree is descended."""
        if with_replacement and not self.prioritized and self.ring.one_range(kind):
            return self._range_draw(kind, B, g), None
        self.activate(kind)
        tree = self.trees[kind]
        if with_replacement:
            idx = tree.sample(self.uniforms(g, B))
            return idx, tree.leaves(idx)
        return self._draw_without_replacement(tree, B, g)

    def _range_draw(self, kind: int, B: int, g: torch.Generator) -> torch.Tensor:
        """(B,) flat starts drawn uniformly among the ring range of valid starts: computed where ``g`` draws
        (for a host generator, on the host, so one copy of the starts reaches the device)."""
        M, E = self.ring.max_rows, self.ring.n_envs
        base, n = self.ring.range_starts(kind)
        u = torch.rand(B, dtype=torch.float64, generator=g, device=g.device)
        if g.device.type == "cpu":
            k = np.minimum((u.numpy() * n).astype(np.int64), n - 1)  # uniform over the n valid (row, env) pairs
            idx = (k // E + base) % M * E + k % E
            return self._staging.to_device(torch.from_numpy(idx), "__starts__")
        k = u.mul(n).long().clamp_max_(n - 1)
        return k.div(E, rounding_mode="floor").add_(base).remainder_(M).mul_(E).add_(k.remainder(E)).to(self.device)

    def _draw_without_replacement(self, tree: PrefixSumTree, B: int, g: torch.Generator):
        """Exact sequential sampling without replacement: rounds of draws with replacement, keeping first
        appearances, with the drawn starts' mass zeroed between rounds and restored at the end (one device
        read per round). The tree is restored whatever happens: an exception restores it, and asynchronous
        signals (Ctrl-C, alarms) are held until it is whole again, so their handlers never run half-way."""
        chosen, masses = [], []
        need = B
        with signals_held():
            try:
                while need > 0:
                    draws = tree.sample(self.uniforms(g, max(2 * need, 16)))
                    uniq, inv = torch.unique(draws, return_inverse=True)
                    first = torch.full_like(uniq, draws.numel()).scatter_reduce_(
                        0, inv, torch.arange(draws.numel(), device=draws.device), "amin")
                    new = uniq[torch.argsort(first)][:need]  # distinct draws in order of first appearance
                    masses.append(tree.leaves(new))
                    chosen.append(new)
                    tree.update(new, torch.zeros(new.shape, dtype=torch.float64, device=self.device))
                    need -= new.numel()
            finally:
                if chosen:
                    idx, mass = torch.cat(chosen), torch.cat(masses)
                    tree.update(idx, mass)  # restore: leaves as before, parents recomputed from them
        return idx, mass


class PrioritizedSampler(UniformSampler):
    """Sampling in proportion to ``priority**alpha`` over valid starts.

    Priorities are ``(M*E,)`` float32 on the device; new starts get the running maximum priority (initially
    1, never decreasing), mirrored on the host so that inserts never read the device.
    """

    prioritized = True

    def __init__(self, ring: StartRing, device: torch.device, backend: str, alpha: float):
        super().__init__(ring, device, backend)
        self.alpha = alpha
        self.priority = ops.allocate({"priority": (ring.max_rows * ring.n_envs,)}, {"priority": torch.float32},
                                     device)["priority"]
        self.max_priority = 1.0
        self._rows = self.priority.view(ring.max_rows, ring.n_envs)

    def tensors(self) -> list[torch.Tensor]:
        return super().tensors() + [self.priority]

    def rows_written(self, pos: int, first: int, T: int) -> None:
        self._rows[pos:pos + first] = self.max_priority
        if first < T:  # wrapped
            self._rows[:T - first] = self.max_priority

    def mass(self, starts, valid: torch.Tensor, all_valid: bool) -> torch.Tensor:
        mass = self.priority[starts].to(torch.float64).pow_(self.alpha)
        return mass if all_valid else mass.mul_(valid)  # invalid starts: zero mass

    def update(self, idx: torch.Tensor, new: torch.Tensor, top: float) -> None:
        """Priorities of flat starts ``idx`` (K,) int64 = ``new`` (K,) float32 (duplicates keep their largest),
        whose largest value is ``top``; then the masses of every kept tree."""
        self.priority.scatter_reduce_(0, idx, new, "amax", include_self=False)
        self.max_priority = max(self.max_priority, top)
        for kind in self.active:
            self.trees[kind].update(idx, self.mass(idx, self.valid[kind][idx], False))
