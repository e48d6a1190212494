"""Sampling policies of the replay buffers: which flat starts a batch begins at, and with what mass.

A policy is composed into a :class:`~gpubuf.TransitionBuffer`. It owns the device side of sampling: one
:class:`~gpubuf.replay.sampling.tree.PrefixSumTree` and one validity mask per validity kind (see
:class:`~gpubuf.replay.ring.StartRing`), and, when prioritized, the priorities. The ring's host bookkeeping says which
starts are valid; the policy turns that into mass: 1 per valid start (:class:`UniformSampler`) or ``priority**alpha``
(:class:`PrioritizedSampler`), 0 per invalid one. A valid start's mass is never zero. :class:`TreeSampler` is their
shared base: validity, trees and the tree draw (:meth:`TreeSampler.draw`, with or without replacement), which
:class:`PrioritizedSampler` uses as is; :class:`UniformSampler` draws from a ring range when it can.
"""

import numpy as np
import torch

from gpubuf import ops
from gpubuf._core.inputs import finite_float, priority_updates
from gpubuf._core.signals import signals_held
from gpubuf._core.staging import Staging
from gpubuf._core.state import check_tensor, chunks, copy_into, unaliased
from gpubuf.replay.ring import IN_EPISODE, NEXT_OBS, RowEvents, StartRing
from gpubuf.replay.sampling.device_priorities import DevicePriorityUpdates
from gpubuf.replay.sampling.draws import MassSetAside
from gpubuf.replay.sampling.tree import FANOUT, PrefixSumTree


class TreeSampler(RowEvents):
    """The shared base of the policies: validity and a prefix-sum tree per kind of a :class:`StartRing` (each kind's
    built on first use), tree descents, exact draws without replacement. Companions (``ShardedBuffer``,
    ``GraphSampler``) call its methods (:meth:`tree`, :meth:`total`, :meth:`descend`, ...) rather than reach into the
    trees."""

    prioritized = False

    def __init__(self, ring: StartRing, table: ops.Backend):
        self.ring, self.device, self.table = ring, table.device, table  # the table runs the trees' ops
        self._trees: dict[int, PrefixSumTree] = {}  # per kind, allocated on first use
        self._valid: dict[int, torch.Tensor] = {}  # (M*E,) bool device validity mask per kind, likewise
        self._active: set[int] = set()  # kinds whose tree and mask are kept up to date
        # set once a CUDA graph captured device-side priority updates: the kinds whose trees that graph updates
        self.frozen_kinds: frozenset | None = None
        self.allocations = 0  # bumped whenever tensors() grows
        self._staging = Staging(table.device)

    def tensors(self) -> list[torch.Tensor]:
        """Every device tensor the policy holds (trees and masks exist once their kind was first used)."""
        return [*(t.tree for t in self._trees.values()), *self._valid.values()]

    def activate(self, kind: int) -> None:
        """Build the tree and mask of ``kind`` (allocated on first use, then one pass over every row) unless they are
        kept already; signals are held meanwhile, and the kind counts as kept only once built."""
        if kind not in self._active:
            if self.frozen_kinds is not None:
                raise RuntimeError(
                    "sample: a CUDA graph captured GraphSampler.update_priorities of this buffer; it updates the "
                    "sampling trees the buffer kept at capture, and this draw needs another one (other "
                    "with_next_obs / boundaries / n_steps windows): make such a draw once before capturing (its own "
                    "GraphSampler, or one eager sample with the same arguments)")
            if kind not in self._trees:
                L = self.ring.max_rows * self.ring.n_envs
                tree = PrefixSumTree(L, self.table)
                self._valid[kind] = ops.allocate({"valid": (L,)}, {"valid": torch.bool}, self.device)["valid"]
                self._trees[kind] = tree
                self.allocations += 1
            with signals_held():
                self.refresh_rows(kind, 0, self.ring.max_rows)
                self._active.add(kind)
                self.kept_changed()

    def kept_changed(self) -> None:
        """The kinds kept current changed (one more was built)."""

    def rows_loaded(self, whole: bool) -> None:
        """A load: every kind's validity dropped, the kept kinds rebuilt in place (tensors handed out stay current)."""
        self.ring.forget_validity()
        for kind in sorted(self._active):
            self.refresh_rows(kind, 0, self.ring.max_rows)

    def rows_written(self, pos: int, before_wrap: int, T: int) -> None:
        """New rows were written at ``pos``: refresh the starts whose windows changed."""
        self.refresh_after_write(pos, T)

    def row_cut(self, row: int) -> None:
        """An episode was cut at held row ``row``: refresh the starts whose windows changed."""
        self.refresh_after_write(row, 1)

    def refresh_after_write(self, old_pos: int, T: int) -> None:
        """Refresh the starts whose windows changed after ``T`` rows were written at ``old_pos``."""
        if not self._active:
            return
        segments = self.ring.changed_rows(old_pos, T, self._active)
        for kind in self.kept_kinds():
            for r0, r1 in segments:
                self.refresh_rows(kind, r0, r1)

    def refresh_rows(self, kind: int, r0: int, r1: int) -> None:
        """Validity (host and device mask) and tree leaves of the starts in rows ``[r0, r1)``, then their parents."""
        ok, n_ok = self.ring.refresh(kind, r0, r1)
        lo, hi = r0 * self.ring.n_envs, r1 * self.ring.n_envs
        mask = self._valid[kind][lo:hi]
        if n_ok == hi - lo:
            mask.fill_(True)
        else:
            mask.copy_(self._staging.to_device(torch.from_numpy(ok), f"__valid{kind}_{r0 == 0}__"))
        self._trees[kind].update_range(lo, self.mass(slice(lo, hi), mask, n_ok == hi - lo))

    def valid_to_host(self) -> None:
        """Copy the kept kinds' device validity into the ring's host validity (after device writes)."""
        for kind in self._active:
            host = self.ring.valid[kind]
            host[:] = self._valid[kind].view(host.shape).cpu().numpy()
            self.ring.n_valid[kind] = int(np.count_nonzero(host))

    def mass(self, starts, valid: torch.Tensor, all_valid: bool) -> torch.Tensor:
        """Mass (float64, device) of flat ``starts`` (a slice or indices) of validity ``valid`` (``all_valid``: all)."""
        return valid.to(torch.float64)

    def count_valid(self, kind: int) -> int:
        """Valid starts of ``kind`` (from the ring range while they are one, else from the kept validity)."""
        if self.ring.one_range(kind):
            return self.ring.range_starts(kind)[1]
        self.activate(kind)
        return self.ring.n_valid[kind]

    def check_draw(self, kind: int, B: int, with_replacement: bool) -> None:
        """Raise ``ValueError`` unless ``B`` starts of ``kind`` can be drawn (any, or ``B`` distinct)."""
        n = self.count_valid(kind)
        if n == 0:
            what = (" without truncation" if kind & NEXT_OBS else "") + \
                (" inside one episode" if kind & IN_EPISODE else "")
            raise ValueError(f"sample: no valid sequence start yet ({self.ring.count} rows written "
                             f"per env, windows of {self.ring.window(kind)} rows{what})")
        if not with_replacement and B > n:
            raise ValueError(f"batch_size: {B} exceeds the {n} valid starts, which sampling without replacement needs")

    def kept_kinds(self) -> list[int]:
        """The kinds whose validity and tree are kept current, in the order writes refresh them."""
        return sorted(self._active)

    def valid_mask(self, kind: int) -> torch.Tensor:
        """(M*E,) bool on the device: ``kind``'s validity per start (built on first use, then kept current in place)."""
        self.activate(kind)
        return self._valid[kind]

    def tree(self, kind: int) -> PrefixSumTree:
        """The tree of ``kind``, built now unless kept already, and kept current from then on."""
        self.activate(kind)
        return self._trees[kind]

    def total(self, kind: int) -> torch.Tensor:
        """0-d float64 on the device: the sampling mass of every start of ``kind``."""
        return self.tree(kind).total()

    def descend(self, kind: int, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(flat starts (K,) int64, masses (K,) float64)`` of ``kind`` by mass, for uniforms ``u`` (K,) in [0, 1)."""
        return self.tree(kind).sample_masses(u)

    def descend_excluding(self, kind: int, old: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`descend` with the mass of flat starts ``old`` (K,) int64 (distinct) set aside:
        zeroed for the descent and restored after it, whatever happens (:class:`MassSetAside`)."""
        tree = self.tree(kind)
        with MassSetAside(tree, old):
            idx = tree.sample(u)
            return idx, tree.leaves(idx)

    def weigh(self, batch, mass: torch.Tensor | None) -> None:
        """Add the batch's importance weights for drawn masses ``mass`` (B,) (uniform: none)."""

    def sampling_mass(self, kind: int) -> torch.Tensor:
        """``(M*E,)`` float64 copy of every start's mass for ``kind``."""
        self.activate(kind)
        return self._trees[kind].masses()

    def uniforms(self, g: torch.Generator, n: int) -> torch.Tensor:
        """(n,) float64 uniforms in [0, 1) on the device, drawn by ``g`` on its own device."""
        u = torch.rand(n, dtype=torch.float64, generator=g, device=g.device)
        return self._staging.to_device(u, "__uniform__")

    def draw(self, kind: int, B: int, g: torch.Generator, with_replacement: bool):
        """``(flat starts (B,) int64, their masses (B,) float64)`` drawn with ``g`` in proportion to their mass: ``B``
        descents of the tree of ``kind`` (with replacement), else :meth:`_draw_without_replacement`."""
        tree = self.tree(kind)
        if with_replacement:
            return tree.sample_masses(self.uniforms(g, B))
        return self._draw_without_replacement(tree, B, g)

    def _draw_without_replacement(self, tree: PrefixSumTree, B: int, g: torch.Generator):
        """Exact sequential sampling without replacement: rounds of :meth:`_distinct_draws`; from the second round on,
        the drawn starts' mass is set aside between rounds and restored at the end (:class:`MassSetAside`)."""
        new, mass = self._distinct_draws(tree, B, g)
        if new.numel() == B:
            return new, mass
        chosen, masses, need = [new], [mass], B - new.numel()
        with MassSetAside(tree) as aside:
            while need > 0:
                aside.add(new, mass)
                new, mass = self._distinct_draws(tree, need, g)
                chosen.append(new)
                masses.append(mass)
                need -= new.numel()
        return torch.cat(chosen), torch.cat(masses)

    def _distinct_draws(self, tree: PrefixSumTree, need: int, g: torch.Generator):
        """``(starts (K,) int64, their masses (K,) float64)``: the distinct starts of one round of ``max(2 * need, 16)``
        draws with replacement from ``tree``, first appearances first, at most ``need`` (one device read)."""
        draws = tree.sample(self.uniforms(g, max(2 * need, 16)))
        uniq, inv = torch.unique(draws, return_inverse=True)
        first_seen = torch.full_like(uniq, draws.numel()).scatter_reduce_(
            0, inv, torch.arange(draws.numel(), device=draws.device), "amin")
        new = uniq[torch.argsort(first_seen)][:need]
        return new, tree.leaves(new)

    def state(self) -> dict:
        """The policy's entries of a buffer's ``state_dict``."""
        return {}

    def check_state(self, state: dict, pos: int, count: int):
        """Validate the policy's entries of ``state`` (rows held: the ``count`` rows before ``pos``)
        before any write; returns what :meth:`load_state` takes."""

    def load_state(self, state: dict, checked, owned: tuple) -> None:
        """Write the entries :meth:`check_state` accepted (``owned``: memory ranges a source may alias)."""

    def flushed(self) -> dict:
        """The policy's entries of a ``storage_dir`` flush (host values)."""
        return {}

    def reopen(self, state: dict | None, since: int) -> None:
        """Restore flushed entries of a re-opened directory (``None``: none); its ``since`` newest rows came later."""


class UniformSampler(TreeSampler):
    """Uniform sampling over the valid starts: mass 1 each."""

    def draw(self, kind: int, B: int, g: torch.Generator, with_replacement: bool):
        """``(flat starts (B,) int64, their masses (B,) float64 or None)`` drawn with generator ``g``. With replacement,
        while the valid starts are one ring range of rows, they are drawn from the range directly (no tree descent, no
        masses); otherwise the tree is descended (:meth:`TreeSampler.draw`)."""
        if with_replacement and self.ring.one_range(kind):
            return self._range_draw(kind, B, g), None
        return super().draw(kind, B, g, with_replacement)

    def _range_draw(self, kind: int, B: int, g: torch.Generator) -> torch.Tensor:
        """(B,) flat starts drawn uniformly among the ring range of valid starts: computed where ``g`` draws (for a host
        generator, on the host, so one copy of the starts reaches the device)."""
        M, E = self.ring.max_rows, self.ring.n_envs
        base, n = self.ring.range_starts(kind)
        u = torch.rand(B, dtype=torch.float64, generator=g, device=g.device)
        if g.device.type == "cpu":
            # uniform over the n valid (row, env) pairs: flat starts base * E + k, wrapped
            k = (u.numpy() * n).astype(np.int64)
            np.minimum(k, n - 1, out=k)
            k += base * E
            k %= M * E
            return self._staging.to_device(torch.from_numpy(k), "__starts__")
        k = u.mul(n).long().clamp_max_(n - 1)
        return k.div(E, rounding_mode="floor").add_(base).remainder_(M).mul_(E).add_(k.remainder(E)).to(self.device)


class PrioritizedSampler(TreeSampler):
    """Sampling in proportion to ``priority**alpha`` over valid starts.

    Priorities are ``(M*E,)`` float32 on the device; new starts get the running maximum priority
    (initially 1, never decreasing), mirrored on the host so that inserts never read the device.
    """

    prioritized = True

    def __init__(self, ring: StartRing, table: ops.Backend, alpha: float, beta: float, eps: float):
        super().__init__(ring, table)
        device = table.device
        self.alpha, self.eps, self.size = alpha, eps, ring.max_rows * ring.n_envs
        self._beta, self._beta_tensor = beta, None
        self.priority = ops.allocate({"priority": (self.size,)}, {"priority": torch.float32}, device)["priority"]
        # (1,) max_priority on the host, raised by the priority write (a CPU buffer's device updates own it once made)
        self._max_box, self._device_updates = torch.ones(1, dtype=torch.float64), None
        self._max_np = self._max_box.numpy()
        # (2,) float64 on the device: the code and largest new priority of the last write (``_result_np``: host view)
        self._result = torch.zeros(2, dtype=torch.float64, device=device)
        self._result_np = self._result.numpy() if device.type == "cpu" else None
        self._scratch_box = None  # (1,) float32 on a GPU: the maximum a checked write raises before device updates
        # the largest priority whose mass ``top**alpha`` over every start stays finite: the one overflow bound
        self.mass_limit = ops.mass_limit(alpha, self.size)
        self._rows = self.priority.view(ring.max_rows, ring.n_envs)
        self._kept = ([], [], [0], FANOUT)  # the kept trees, their validity masks, their level bounds and fan-out
        self._make_writer()
        self.check_mass("alpha", 1.0)

    def kept_changed(self) -> None:
        kinds = sorted(self._active)
        trees = [self._trees[k] for k in kinds]
        self._kept = ([t.tree for t in trees], [self._valid[k] for k in kinds], trees[0].offsets, trees[0].fanout)
        self._make_writer()  # for the trees kept now

    @property
    def beta(self) -> float:
        """The importance-sampling exponent (``>= 0``); a bad value raises naming ``beta``."""
        return self._beta

    @beta.setter
    def beta(self, value: float) -> None:
        self._beta = finite_float("beta", value, 0.0)
        if self._beta_tensor is not None:
            # in place, no host sync: captured graphs read it at replay
            self._beta_tensor.fill_(self._beta)

    @property
    def beta_tensor(self) -> torch.Tensor:
        """``()`` float64 on the device holding :attr:`beta`, the same tensor for the sampler's life."""
        if self._beta_tensor is None:
            self._beta_tensor = torch.full((), self._beta, dtype=torch.float64, device=self.device)
        return self._beta_tensor

    def weigh(self, batch, mass: torch.Tensor) -> None:
        """``batch.PER_weights`` (B,) float32 of drawn masses ``mass`` (B,): ``(P_i / min_batch P)**-beta``."""
        batch.PER_weights = self.table.importance_weights(mass, self._beta)

    @property
    def max_priority(self) -> float:
        """The running maximum priority (new starts get it). Once updates ran on the device (:meth:`device_updates`) it
        lives there: reading it reads the device, and first raises what those updates dropped
        (:meth:`~gpubuf.replay.sampling.device_priorities.DevicePriorityUpdates.raise_pending`)."""
        dev = self._device_updates
        if dev is None:
            return float(self._max_np[0])
        dev.raise_pending()
        return float(dev.max)

    @max_priority.setter
    def max_priority(self, value: float) -> None:
        self._max_np[0] = value
        if self._device_updates is not None:
            self._device_updates.max.fill_(value)

    def raise_max_priority(self, value: float) -> None:
        """``max_priority`` becomes ``max(max_priority, value)`` (new starts get it); no device read."""
        self._max_np[0] = max(self._max_np[0], value)
        if self._device_updates is not None:
            self._device_updates.max.clamp_(min=value)

    def check_updates(self) -> None:
        """Raise what device-side updates dropped since the last check (nothing when none ran)."""
        if self._device_updates is not None:
            self._device_updates.raise_pending()

    def device_updates(self) -> DevicePriorityUpdates:
        """The sync-free priority updates (made on first use; from then on ``max_priority`` lives on the device)."""
        if self._device_updates is None:
            self._device_updates = DevicePriorityUpdates(self, float(self._max_np[0]))
            if self.device.type == "cpu":  # one home for max_priority: the checked writes raise the device's
                self._max_box = self._device_updates.max.view(1)
                self._max_np = self._max_box.numpy()
            self._make_writer()  # the box a write raises moved
        return self._device_updates

    def tensors(self) -> list[torch.Tensor]:
        return super().tensors() + [self.priority]

    def rows_written(self, pos: int, before_wrap: int, T: int) -> None:
        """New rows take the running ``max_priority`` (order matters: before their masses are refreshed)."""
        top = self.new_row_priority()
        self._rows[pos:pos + before_wrap].fill_(top)
        if before_wrap < T:  # wrapped
            self._rows[:T - before_wrap].fill_(top)
        self.refresh_after_write(pos, T)

    def new_row_priority(self) -> float | torch.Tensor:
        """The priority new starts get, the running maximum: a float, or once device updates exist the device's ()
        tensor (no read-back)."""
        return float(self._max_np[0]) if self._device_updates is None else self._device_updates.max

    def mass(self, starts, valid: torch.Tensor, all_valid: bool) -> torch.Tensor:
        return self.table.masses(self.priority[starts], valid, self.alpha, all_valid)  # invalid starts: zero mass

    def check_mass(self, name: str, top: float) -> None:
        """Raise unless ``top**alpha`` over every start sums to a finite float64 (``top`` below :attr:`mass_limit`)."""
        if top >= self.mass_limit:
            raise ops.overflow_error(name, top, self.alpha, self.size)

    def host_indices(self, arr: np.ndarray) -> np.ndarray:
        """Host integer ``indices`` checked in range and widened to int64."""
        bad = (arr >= self.size) if arr.dtype.kind == "u" else (arr < 0) | (arr >= self.size)
        if bad.any():
            raise ops.priority_error(ops.BAD_INDEX, self.size, arr, None, self.eps, 0.0, self.alpha)
        return arr.astype(np.int64)

    def check_priorities(self, where: str, prio, top: float, pos: int, count: int) -> None:
        """Raise unless ``prio`` is ``(size,)`` float32 with every value in ``[0, top]`` and those
        of the starts in the ``count`` rows before row ``pos`` (the rows held) at least ``eps``."""
        check_tensor(where, prio, (self.size,), torch.float32)
        M, E, eps = self.ring.max_rows, self.ring.n_envs, float(np.float32(self.eps))
        oldest, at = (pos - count) % M, 0
        for piece in chunks(prio):
            rows = torch.arange(at, at + piece.numel()) // E
            held = piece[(rows - oldest) % M < count]
            if not bool(torch.isfinite(piece).all()) \
                    or not (float(piece.min()) >= 0 and float(piece.max()) <= top) \
                    or (held.numel() and float(held.min()) < eps):
                raise ValueError(f"{where}: expected priorities of held starts in [{eps:g}, max_priority {top:g}] and "
                                 "of the others in [0, max_priority], all finite")
            at += piece.numel()

    def state(self) -> dict:
        return {"beta": self.beta, "priority": self.priority, "max_priority": self.max_priority}

    def check_state(self, state: dict, pos: int, count: int, named: str = "state_dict['{}']") -> tuple[float, float]:
        beta = finite_float(named.format("beta"), state["beta"], 0.0)
        top = finite_float(named.format("max_priority"), state["max_priority"], 1.0)
        self.check_mass(named.format("max_priority"), top)
        self.check_priorities(named.format("priority"), state["priority"], top, pos, count)
        return beta, top

    def load_state(self, state: dict, checked: tuple[float, float], owned: tuple) -> None:
        copy_into(self.priority,
                  unaliased({"priority": state["priority"]}, {"priority": self.priority}, owned)["priority"])
        self.beta, self.max_priority = checked

    def flushed(self) -> dict:
        return {"priority": self.priority.cpu(), "max_priority": self.max_priority, "beta": self.beta}

    def reopen(self, state: dict | None, since: int) -> None:
        if state is not None:  # checked as a load_state_dict would, before anything is restored
            ring = self.ring  # the rows held at the flush: those held now, less the `since` newest
            beta, top = self.check_state(state, (ring.pos - since) % ring.max_rows, ring.count - since, "{}")
            self.priority.copy_(state["priority"])
            self.max_priority, self.beta = top, beta
        if since:  # rows written after the flush: new starts take the running max priority
            M = self.ring.max_rows
            first_row = (self.ring.pos - since) % M
            self.rows_written(first_row, min(since, M - first_row), since)

    def update_priorities(self, indices, td_errors) -> None:
        """Priorities ``|td| + eps`` (float32) of flat starts ``indices`` (duplicates keep their
        largest), every input checked before any write; host inputs are checked on the host (no
        device read), device inputs with one read-back. Empty inputs do nothing."""
        idx, td = priority_updates(indices, td_errors)
        if idx.numel() == 0:
            return
        on_host = idx.device.type == "cpu" and td.device.type == "cpu"
        if on_host and idx.dtype != torch.int64:  # unsigned and narrow ints: checked and widened on the host
            idx = torch.from_numpy(self.host_indices(idx.numpy()))
        td = td.detach()
        if on_host and self.device.type != "cpu":  # checked where they are: nothing is read back from the device
            _, code, top = ops.priority_checks(idx, td, self.eps, self.mass_limit, self.size)
            self._raise(int(code), float(top), idx, td)
            self.write(self._staging.stage(idx, "__upd_idx__", torch.int64),
                       self._staging.stage(td, "__upd_td__", td.dtype))
            self.raise_max_priority(float(top))
            return
        if not on_host:  # device inputs: one read-back of the write's code
            idx, td = self._staging.stage(idx, "__upd_idx__", torch.int64), self._staging.stage(td, "__upd_td__",
                                                                                                td.dtype)
        self._raise(*self.write(idx, td, read=True), idx, td)

    def check_write(self, indices, td_errors) -> None:
        """Raise what :meth:`update_priorities` would raise for these inputs, writing nothing (device inputs: one
        read of the device)."""
        idx, td = priority_updates(indices, td_errors)
        if idx.numel():
            _, code, top = ops.priority_checks(idx.to(torch.int64), td.detach(), self.eps, self.mass_limit, self.size)
            self._raise(int(code), float(top), idx, td)

    def _raise(self, code: int, top: float, idx: torch.Tensor, td: torch.Tensor) -> None:
        """Raise what a write's nonzero ``code`` names (:func:`gpubuf.ops.priority_error`)."""
        if code:
            raise ops.priority_error(code, self.size, idx, td, self.eps, top, self.alpha)

    def write(self, idx: torch.Tensor, td: torch.Tensor, read: bool = False):
        """Priorities ``|td| + eps`` of starts ``idx`` (K,) int64 (``td`` (K,) real), both contiguous on the device,
        their masses in every kept tree and ``max_priority``, unless a check fails (nothing written then): the
        priority write op, with no device read. ``read``: returns ``(code, largest new priority)`` (a read of the
        device on a GPU). Captured in a CUDA graph, it updates the trees kept now only, so no other tree may be
        built from then on (:attr:`frozen_kinds`)."""
        idx, td = idx.contiguous(), td.contiguous()  # the kernels and loops assume unit stride
        if self.table.capturing():
            self.frozen_kinds = frozenset(self._active)
        self._writer(idx, td, self.eps, self.alpha, self.mass_limit)
        if not read:
            return None
        if self._result_np is not None:
            return int(self._result_np[0]), float(self._result_np[1])
        code, top = self._result.tolist()
        if not code:
            self.raise_max_priority(top)
        return int(code), top

    def written_code(self) -> torch.Tensor:
        """() int32 on the device: the code of the last :meth:`write` (0: written), not read back."""
        return self._result[0].to(torch.int32)

    def _make_writer(self) -> None:
        """The table's priority writer into the tensors a write updates now (kept trees, the maximum's box)."""
        box = self._max_box if self.device.type == "cpu" else self._device_box()
        self._writer = self.table.priority_writer(self.priority, *self._kept, box, self._result)

    def _device_box(self) -> torch.Tensor:
        """(1,) on a GPU: the maximum a write raises (the device updates' own once they exist)."""
        if self._device_updates is not None:
            return self._device_updates.max.view(1)
        if self._scratch_box is None:
            self._scratch_box = torch.zeros(1, dtype=torch.float32, device=self.device)
        return self._scratch_box
