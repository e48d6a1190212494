"""Selectors: which valid starts a replay buffer's ``sample`` draws, when not the buffer's own uniform or
prioritized draw (``selector=`` of either buffer's constructor).

Every selector picks among the starts that are valid for the call (its ``with_next_obs`` and ``boundaries``), so
windows, episode boundaries, frame stacks and n-step returns behave exactly as with the buffer's own draw. ``age``
of a start is how many rows its env wrote after the start's row (0: the newest row).

- :class:`Recency`: with replacement, start ``i`` with probability ``(age_i + 1) ** -exponent / sum over the valid
  starts`` (DreamerV3's recency selector).
- :class:`Mixture`: with replacement, a batch of ``B`` made of ``n_c`` starts of each component ``c`` of
  ``uniform`` (over the valid starts), ``prioritized`` (``priority**alpha``, a prioritized buffer's) and
  ``recency``; the counts ``n_c`` are the fractions times ``B`` rounded by largest remainder (ties to the first
  component), so start ``i`` is drawn ``sum_c n_c * p_c(i)`` times per batch on average.
- :class:`Fifo` / :class:`Lifo`: a queue: each start is served once, the oldest (newest) valid starts not yet
  served first, ``B`` distinct starts per call; ``ValueError`` while fewer than ``B`` unserved starts are valid
  (gate the learner with ``buffer.num_unserved`` or a rate limiter). A start served and then overwritten by a
  new row is new again.
- :class:`Online`: DreamerV3's online queue: each batch first takes the valid starts not yet served, oldest first
  (at most ``B``), and fills the rest from ``base`` (a :class:`Recency` or :class:`Mixture`, or ``None``: the
  buffer's own draw, as ``with_replacement`` says). Every new start is thus served once before it is left to the
  base's chances. It draws with replacement as the buffer does: a batch larger than the valid starts takes each
  once, then the rest from the base.

A prioritized buffer's ``PER_weights`` are ``(q_i / min_batch q) ** -beta`` with ``q_i`` the selector's
probability of start ``i`` (the base's for :class:`Online`'s queued starts; 1 for :class:`Fifo`/:class:`Lifo`).
:class:`Recency` and :class:`Mixture` draw on the device from device state only (the validity masks, the
priority tree, the newest row), so a :class:`~gpubuf.GraphSampler` samples with them inside a CUDA graph; the
queues decide on the host and are not offered there. Their served marks ride along in ``state_dict`` (a state
without them: every start unserved) and copies; a re-opened ``storage_dir`` starts with every start unserved.
Costs: :class:`Recency` and :class:`Mixture`'s uniform part sum the masses of every start per call (O(capacity),
unlike the tree's O(log) descents); the queues scan the host validity of every start per call.
"""

import math
import weakref

import numpy as np
import torch

from gpubuf._core.state import check_tensor, host_tensor
from gpubuf.replay.ring import RowEvents
from gpubuf.replay.sampling.draws import MassSetAside, proportional_draw

COMPONENTS = ("uniform", "prioritized", "recency")


class Selector(RowEvents):
    """The base of the selectors: the buffer it is attached to, and its hooks."""

    capturable = False  # draws from device state only (a GraphSampler may use it)
    queue = False  # keeps served marks
    replacement_only = False  # draws with replacement only (the buffer's default becomes True)

    def __init__(self):
        self._buffer = None

    @property
    def buffer(self):
        """The buffer this selector selects for (``None`` before :meth:`attach`, or once that buffer is gone): held
        weakly, as the buffer holds its selector, so that dropping the buffer frees it at once."""
        return None if self._buffer is None else self._buffer()

    def attach(self, buffer) -> None:
        """Select for ``buffer`` (one at most: ``ValueError`` for a selector attached already)."""
        if self.buffer is not None:
            raise ValueError(f"selector: this {type(self).__name__} selects for another buffer already; give "
                             "each buffer its own")
        self._buffer = weakref.ref(buffer)
        M, dev = buffer.ring.max_rows, buffer.device
        self._rows = torch.arange(M, device=dev)
        self._newest = torch.zeros((), dtype=torch.int64, device=dev)  # the newest row, kept current by writes

    def fresh(self) -> "Selector":
        """An unattached selector of the same configuration (a copied buffer's)."""
        raise NotImplementedError

    def check(self, kind: int, B: int, with_replacement: bool) -> None:
        """``ValueError`` unless a draw of ``B`` starts of ``kind`` can run (``replacement_only``: with replacement)."""
        if self.replacement_only and not with_replacement:
            raise ValueError(f"with_replacement: a {type(self).__name__} selector draws with replacement; "
                             "pass with_replacement=True (or leave it None)")

    def distinct(self, with_replacement: bool) -> bool:
        """Whether a draw (``with_replacement`` as asked) returns ``B`` distinct starts, so needs that many valid."""
        return not with_replacement

    def draw(self, kind: int, B: int, g: torch.Generator, with_replacement: bool):
        """``(flat starts (B,) int64, their probabilities (B,) float64 or None)``, drawn with ``g``."""
        return self.draw_u(kind, self.buffer.sampler.uniforms(g, B))

    def draw_u(self, kind: int, u: torch.Tensor, groups: int = 1):
        """:meth:`draw` from given uniforms ``u`` (B,) float64 on the device (what a graph replays); ``groups``: ``u``
        is that many batches of equal size (a GraphSampler's minibatches), each drawn as a batch of its own."""
        raise NotImplementedError

    def prob(self, kind: int, idx: torch.Tensor) -> torch.Tensor:
        """(K,) float64: the probability that one draw picks each of ``idx``."""
        raise NotImplementedError

    def rows_written(self, pos: int, before_wrap: int, T: int) -> None:
        """Rows were written (ring position now ``buffer.ring.pos``)."""
        self._newest.fill_((self.buffer.ring.pos - 1) % self.buffer.ring.max_rows)

    def rows_loaded(self, whole: bool = True) -> None:
        """The rows changed wholesale (a load, a re-open)."""
        self._newest.fill_((self.buffer.ring.pos - 1) % self.buffer.ring.max_rows)

    def state(self) -> dict:
        return {}

    def check_state(self, served) -> None:
        """``ValueError`` unless ``served`` (a state's ``"selector_served"``, or None) can be loaded."""

    def load(self, state: dict) -> None:
        """Take the entries :meth:`state` saved (absent ones: their defaults), checked by :meth:`check_state`."""

    def _valid(self, kind: int) -> torch.Tensor:
        return self.buffer.sampler.valid_mask(kind)

    def _recency_mass(self, kind: int, exponent: float) -> torch.Tensor:
        """(M*E,) float64: ``(age + 1) ** -exponent`` of every valid start, 0 elsewhere."""
        ring = self.buffer.ring
        age = (self._newest - self._rows).remainder_(ring.max_rows)
        w = age.add_(1).to(torch.float64).pow_(-exponent)  # (M,) per row
        return (w.unsqueeze(1) * self._valid(kind).view(ring.max_rows, ring.n_envs)).view(-1)


class Recency(Selector):
    """Start ``i`` in proportion to ``(age_i + 1) ** -exponent`` (``exponent > 0``; DreamerV3: 1), with replacement."""

    capturable = replacement_only = True

    def __init__(self, exponent: float = 1.0):
        super().__init__()
        if not _number(exponent) or not 0 < exponent < math.inf:
            raise ValueError(f"exponent: expected a finite number > 0, got {exponent!r}")
        self.exponent = float(exponent)

    def fresh(self) -> "Recency":
        return Recency(self.exponent)

    def draw_u(self, kind: int, u: torch.Tensor, groups: int = 1):  # independent draws: groups change nothing
        mass = self._recency_mass(kind, self.exponent)
        idx, total = proportional_draw(mass, u)
        return idx, mass[idx] / total

    def prob(self, kind: int, idx: torch.Tensor) -> torch.Tensor:
        mass = self._recency_mass(kind, self.exponent)
        return mass[idx] / mass.sum()

    def __repr__(self) -> str:
        return f"Recency(exponent={self.exponent:g})"


class Mixture(Selector):
    """Fractions of each batch drawn ``uniform``-ly, ``prioritized`` (a prioritized buffer's priorities) and by
    ``recency`` (:class:`Recency` with ``exponent``), with replacement; fractions ``>= 0``, not all 0, normalised
    to sum 1."""

    capturable = replacement_only = True

    def __init__(self, uniform: float = 0.0, prioritized: float = 0.0, recency: float = 0.0, exponent: float = 1.0):
        super().__init__()
        fractions = {"uniform": uniform, "prioritized": prioritized, "recency": recency}
        for name, f in fractions.items():
            if not _number(f) or not 0 <= f < math.inf:
                raise ValueError(f"{name}: expected a finite fraction >= 0, got {f!r}")
        total = sum(fractions.values())
        if total <= 0:
            raise ValueError("uniform, prioritized, recency: expected at least one fraction > 0, got all 0")
        self.fractions = {k: float(v) / total for k, v in fractions.items()}
        self.exponent = Recency(exponent).exponent  # checked as Recency checks it

    def fresh(self) -> "Mixture":
        return Mixture(**self.fractions, exponent=self.exponent)

    def attach(self, buffer) -> None:
        if self.fractions["prioritized"] > 0 and not buffer.sampler.prioritized:
            raise ValueError(f"prioritized: a {type(buffer).__name__} has no priorities; use a "
                             "PrioritizedTransitionBuffer, or set prioritized=0")
        super().attach(buffer)

    def counts(self, B: int) -> dict[str, int]:
        """Starts of each component in a batch of ``B``: largest remainder, ties to the first component."""
        exact = {k: f * B for k, f in self.fractions.items()}
        n = {k: int(math.floor(v)) for k, v in exact.items()}
        order = sorted(COMPONENTS, key=lambda k: (-(exact[k] - n[k]), COMPONENTS.index(k)))
        for k in order[:B - sum(n.values())]:
            n[k] += 1
        return n

    def draw_u(self, kind: int, u: torch.Tensor, groups: int = 1):
        """Each of the ``groups`` batches of ``u`` holds :meth:`counts` starts of each component (in component
        order), so every minibatch is the mixture its probabilities assume."""
        B = u.numel() // groups
        n, parts, at, grid = self.counts(B), [], 0, u.view(groups, B)
        for name in COMPONENTS:
            if n[name]:
                part = self._component(name, kind, grid[:, at:at + n[name]].reshape(-1))
                parts.append(part.view(groups, n[name]))
                at += n[name]
        idx = (parts[0] if len(parts) == 1 else torch.cat(parts, 1)).view(-1)
        return idx, self.prob(kind, idx, n)

    def _component(self, name: str, kind: int, u: torch.Tensor) -> torch.Tensor:
        if name == "prioritized":
            return self.buffer.sampler.descend(kind, u)[0]
        mass = self._valid(kind).to(torch.float64) if name == "uniform" else self._recency_mass(kind, self.exponent)
        return proportional_draw(mass, u)[0]

    def prob(self, kind: int, idx: torch.Tensor, n: dict | None = None) -> torch.Tensor:
        """``sum_c (n_c / B) * p_c(idx)`` (``n``: the counts of the batch; ``None``: the fractions)."""
        weights = self.fractions if n is None else {k: v / sum(n.values()) for k, v in n.items()}
        q = torch.zeros(idx.shape, dtype=torch.float64, device=idx.device)
        sampler = self.buffer.sampler
        for name, w in weights.items():
            if w == 0:
                continue
            if name == "uniform":
                valid = self._valid(kind)
                q += w * valid[idx].to(torch.float64) / valid.sum()
            elif name == "prioritized":
                q += w * sampler.tree(kind).leaves(idx) / sampler.total(kind)
            else:
                mass = self._recency_mass(kind, self.exponent)
                q += w * mass[idx] / mass.sum()
        return q

    def __repr__(self) -> str:
        parts = ", ".join(f"{k}={v:g}" for k, v in self.fractions.items() if v)
        return f"Mixture({parts}, exponent={self.exponent:g})"


class _Queue(Selector):
    """Served marks ``(M, E)`` on the host, cleared where rows are written."""

    queue = True
    newest_first = False

    def attach(self, buffer) -> None:
        super().attach(buffer)
        self.served = np.zeros((buffer.ring.max_rows, buffer.ring.n_envs), dtype=bool)

    def rows_written(self, pos: int, before_wrap: int, T: int) -> None:
        super().rows_written(pos, before_wrap, T)
        self.served[pos:pos + before_wrap] = False
        self.served[:T - before_wrap] = False

    def unserved(self, kind: int) -> int:
        """Valid starts of ``kind`` not yet served."""
        self.buffer.sampler.activate(kind)  # the ring's validity of kind kept from now on
        return int((self.buffer.ring.valid[kind] & ~self.served).sum())

    def take(self, kind: int, k: int) -> np.ndarray:
        """Up to ``k`` unserved valid flat starts, oldest (``newest_first``: newest) row first, env order within
        a row; marked served."""
        ring = self.buffer.ring
        self.buffer.sampler.activate(kind)
        rows = (ring.oldest + np.arange(ring.count)) % ring.max_rows
        if self.newest_first:
            rows = rows[::-1]
        cand = ring.valid[kind][rows] & ~self.served[rows]  # (count, E) in serving order
        pick = np.flatnonzero(cand.ravel())[:k]
        r, e = rows[pick // ring.n_envs], pick % ring.n_envs
        self.served[r, e] = True
        return r * ring.n_envs + e

    def state(self) -> dict:
        return {"selector_served": torch.from_numpy(self.served.copy())}

    def check_state(self, served) -> None:
        if served is not None:
            check_tensor("selector_served", served, self.served.shape, torch.bool)

    def load(self, state: dict) -> None:
        served = state.get("selector_served")
        self.served[:] = False if served is None else host_tensor(served).numpy()


class Fifo(_Queue):
    """A queue: the oldest valid starts not yet served, ``B`` distinct per call, each served once."""

    def fresh(self) -> "Fifo":
        return type(self)()

    def distinct(self, with_replacement: bool) -> bool:
        return True  # each start is served once

    def check(self, kind: int, B: int, with_replacement: bool) -> None:
        n = self.unserved(kind)
        if n < B:
            raise ValueError(f"batch_size: {B} exceeds the {n} valid starts not yet served by this "
                             f"{type(self).__name__} queue (each start is served once; wait for more rows)")

    def draw(self, kind: int, B: int, g: torch.Generator, with_replacement: bool):
        idx = torch.from_numpy(self.take(kind, B)).to(self.buffer.device)
        return idx, torch.ones(B, dtype=torch.float64, device=idx.device)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Lifo(Fifo):
    """A stack: the newest valid starts not yet served, ``B`` distinct per call, each served once."""

    newest_first = True


class Online(_Queue):
    """First the unserved valid starts, oldest first (at most ``B``), then ``base`` (``None``: the buffer's draw)."""

    def __init__(self, base: Selector | None = None):
        super().__init__()
        if base is not None and not isinstance(base, (Recency, Mixture)):
            raise ValueError(f"base: expected None, a Recency or a Mixture, got {type(base).__name__}")
        self.base = base
        self.replacement_only = base is not None

    def fresh(self) -> "Online":
        return Online(None if self.base is None else self.base.fresh())

    def attach(self, buffer) -> None:
        if self.base is not None:
            self.base.attach(buffer)
        super().attach(buffer)

    def rows_written(self, pos: int, before_wrap: int, T: int) -> None:
        super().rows_written(pos, before_wrap, T)
        if self.base is not None:
            self.base.rows_written(pos, before_wrap, T)

    def rows_loaded(self, whole: bool = True) -> None:
        super().rows_loaded(whole)
        if self.base is not None:
            self.base.rows_loaded(whole)

    def check(self, kind: int, B: int, with_replacement: bool) -> None:
        if self.base is not None:
            self.base.check(kind, B, with_replacement)

    def draw(self, kind: int, B: int, g: torch.Generator, with_replacement: bool):
        sampler, dev = self.buffer.sampler, self.buffer.device
        new = torch.from_numpy(self.take(kind, B)).to(dev)
        k = B - new.numel()
        if k == 0:
            return new, self._prob(kind, new)
        if self.base is not None:
            rest, _ = self.base.draw(kind, k, g, True)
        elif with_replacement:
            rest, _ = sampler.draw(kind, k, g, True)
        else:  # distinct from the queued ones too
            rest, _ = _distinct_rest(sampler, kind, k, g, new)
        idx = torch.cat([new, rest])
        return idx, self._prob(kind, idx)

    def _prob(self, kind: int, idx: torch.Tensor) -> torch.Tensor | None:
        if self.base is not None:
            return self.base.prob(kind, idx)
        if not self.buffer.sampler.prioritized:
            return None
        sampler = self.buffer.sampler
        return sampler.tree(kind).leaves(idx) / sampler.total(kind)

    def __repr__(self) -> str:
        return f"Online(base={self.base!r})"


def _distinct_rest(sampler, kind: int, k: int, g: torch.Generator, taken: torch.Tensor) -> tuple:
    """``k`` starts drawn without replacement by ``sampler``, none of them in ``taken``."""
    with MassSetAside(sampler.tree(kind), taken):
        return sampler.draw(kind, k, g, False)


def _number(x) -> bool:
    return not isinstance(x, (bool, np.bool_)) and isinstance(x, (int, float, np.integer, np.floating))


def check_selector(selector) -> Selector | None:
    if selector is not None and not isinstance(selector, Selector):
        raise ValueError(f"selector: expected None or a gpubuf selector (Recency, Mixture, Fifo, Lifo, Online), "
                         f"got {type(selector).__name__}")
    return selector
