"""RateLimiter: how many samples a replay buffer serves per inserted transition (Reverb's semantics).

A limiter keeps two exact counts, ``inserts`` (transitions inserted: ``T * n_envs`` per vectorized insert,
``T`` otherwise) and ``samples`` (windows sampled: ``B`` per call), and the buffer's ``size``
(transitions held). With ``diff = inserts * samples_per_insert - samples``:

- a sample of ``n`` may run once ``size >= min_size_to_sample`` and ``diff - n >= min_diff``;
- an insert of ``n`` may run while ``size < min_size_to_sample`` (filling up is never blocked: no sample can run
  yet, so an insert waiting there could only wait forever; the insert that crosses ``min_size_to_sample`` may take
  ``diff`` past ``max_diff``, and samples then run until it is back in the band), or when
  ``diff + n * samples_per_insert <= max_diff``.

No deadlock (the band rule): let ``I`` be the most one insert moves ``diff`` (``n * samples_per_insert``) and ``S``
the most one sample moves it (``n``). If ``max_diff - min_diff >= I + S``, a waiting insert or a waiting sample can
always run: while ``size < min_size_to_sample`` inserts run; after, a sample of ``s <= S`` runs unless
``diff < min_diff + s``, and then ``diff < min_diff + S <= max_diff - I``, so an insert of ``i <= I`` runs. The
limiter enforces it: the buffer refuses at construction a band narrower than one insert of a row (``n_envs``
transitions vectorized, else 1) plus a sample of ``sample_batch_size``, and every call refuses (``ValueError``,
counting nothing) a size that, with the largest call of the other kind seen so far, the band cannot hold (the
default sample of ``sample_batch_size`` counts as seen from the start, so no insert can shut it out).

A blocked call waits on a condition of the buffer's own lock, which it lets go of while it waits, so the other side
runs and wakes it; ``timeout`` (seconds; ``None``: wait as long as it takes, ``0``: never wait) ends a wait with
``TimeoutError``. A call that fails after its turn came (a bad argument, no valid start) gives its counts back."""

import math
import threading
import time
from numbers import Integral, Real


class RateLimiter:
    """Reverb-style rate limiter of one replay buffer (give it to the buffer's ``rate_limiter=``).

    Args:
        samples_per_insert: samples served per inserted transition (``> 0``).
        min_size_to_sample: transitions held before the first sample (``>= 1``).
        min_diff, max_diff: the band ``inserts * samples_per_insert - samples`` stays in; their gap must be at
            least ``2 * max(1, samples_per_insert)`` (one sample and one insert of one transition), and at least an
            insert's and a sample's moves together (module docstring: else both could be blocked).
        timeout: seconds a blocked ``sample``/``insert`` waits before ``TimeoutError`` (``None``: no limit)."""

    def __init__(self, samples_per_insert: float, min_size_to_sample: int, min_diff: float, max_diff: float,
                 timeout: float | None = None):
        self.samples_per_insert = _positive("samples_per_insert", samples_per_insert)
        if _flag(min_size_to_sample) or not isinstance(min_size_to_sample, Integral) or min_size_to_sample < 1:
            raise ValueError(f"min_size_to_sample: expected an int >= 1, got {min_size_to_sample!r}")
        self.min_size_to_sample = int(min_size_to_sample)
        for name, v in (("min_diff", min_diff), ("max_diff", max_diff)):
            if _flag(v) or not isinstance(v, Real) or math.isnan(v):
                raise ValueError(f"{name}: expected a number (inf allowed), got {v!r}")
        gap = 2 * max(1.0, self.samples_per_insert)
        if not max_diff - min_diff >= gap:
            raise ValueError(f"min_diff, max_diff: expected max_diff - min_diff >= {gap:g} "
                             f"(2 * max(1, samples_per_insert)), got {min_diff!r} and {max_diff!r}")
        self.min_diff, self.max_diff = float(min_diff), float(max_diff)
        if timeout is not None and (_flag(timeout) or not isinstance(timeout, Real) or not timeout >= 0):
            raise ValueError(f"timeout: expected None or seconds >= 0, got {timeout!r}")
        self.timeout = timeout if timeout is None or type(timeout) in (int, float) else float(timeout)
        self.inserts = self.samples = 0
        self.size = 0  # transitions the buffer holds (set by the buffer)
        self.attached = False  # limits a buffer (one at most)
        self._guard = None  # that buffer's CallGuard
        self._cond = threading.Condition()
        self.largest = {"insert": 0.0, "sample": 0.0}  # the most one call of each kind moved diff (band rule)
        self.poll = None  # called every few ms while a call waits: commits rows of writers in other processes

    @classmethod
    def min_size(cls, min_size_to_sample: int, timeout: float | None = None) -> "RateLimiter":
        """Samples wait for ``min_size_to_sample`` transitions; nothing else is limited."""
        return cls(1.0, min_size_to_sample, -math.inf, math.inf, timeout)

    @classmethod
    def sample_to_insert_ratio(cls, samples_per_insert: float, min_size_to_sample: int, error_buffer,
                               timeout: float | None = None) -> "RateLimiter":
        """Hold ``samples / inserts`` at ``samples_per_insert``: ``diff`` within ``error_buffer`` (a number, or
        ``(below, above)``) of ``samples_per_insert * min_size_to_sample``."""
        pair = error_buffer if isinstance(error_buffer, (tuple, list)) else (error_buffer, error_buffer)
        if len(pair) != 2 or any(_flag(v) or not isinstance(v, Real) or not v >= 0 for v in pair):
            raise ValueError(f"error_buffer: expected a number >= 0 or two of them (below, above), got "
                             f"{error_buffer!r}")
        below, above = pair
        spi = _positive("samples_per_insert", samples_per_insert)
        gap = 2 * max(1.0, spi)
        if not below + above >= gap:
            raise ValueError(f"error_buffer: expected below + above >= {gap:g} (2 * max(1, samples_per_insert): one "
                             f"sample and one insert must fit in the band), got {error_buffer!r}")
        offset = spi * min_size_to_sample if isinstance(min_size_to_sample, Integral) else 0.0
        return cls(samples_per_insert, min_size_to_sample, offset - below, offset + above, timeout)

    # ------------------------------------------------------------------ checks

    @property
    def diff(self) -> float:
        return self.inserts * self.samples_per_insert - self.samples

    def can_sample(self, n: int) -> bool:
        """Whether a sample of ``n`` windows may run now."""
        return self.size >= self.min_size_to_sample and self.diff - n >= self.min_diff

    def can_insert(self, n: int) -> bool:
        """Whether an insert of ``n`` transitions may run now."""
        return self.size < self.min_size_to_sample or self.diff + n * self.samples_per_insert <= self.max_diff

    def fits(self, n: int) -> bool:
        """Whether an insert of ``n`` transitions keeps ``diff`` within the band, or the buffer at most filled up:
        what a commit that may take fewer rows takes, so that it crosses ``min_size_to_sample`` by no more than its
        smallest part (:meth:`can_insert` lets any insert run while filling up)."""
        return self.size + n <= self.min_size_to_sample or self.diff + n * self.samples_per_insert <= self.max_diff

    def attach(self, guard, row: int = 1, batch: int = 1) -> None:
        """This limiter now limits the buffer of ``guard`` (its :class:`~gpubuf._core.concurrency.CallGuard`):
        waits let go of that buffer's lock. ``row``: the transitions of the smallest insert (a row of all envs);
        ``batch``: the buffer's default sample, reserved (an insert the band cannot hold beside it is refused)."""
        self.attached, self._guard = True, guard
        self._cond = threading.Condition(guard.lock)
        self.largest["insert"] = max(self.largest["insert"], row * self.samples_per_insert)
        self.largest["sample"] = max(self.largest["sample"], float(batch))

    def insert_cap(self, batch: int) -> int:
        """The most transitions one insert may hold (at least 1) so that it and a sample of ``batch`` (or the largest
        seen, if more) fit in the band; reserved: a later sample is checked against it."""
        span = self.max_diff - self.min_diff
        with self._cond:
            most = max(batch, self.largest["sample"])
            cap = 2**62 if math.isinf(span) else max(1, int((span - most) // self.samples_per_insert))
            self.largest["insert"] = max(self.largest["insert"], cap * self.samples_per_insert)
        return cap

    def _check_sizes(self, what: str, n: int) -> None:
        """``ValueError`` when a ``what`` of ``n`` and the largest call of the other kind seen so far could both
        wait forever (the band rule, module docstring); else remember its size."""
        if what == "insert" and self.size < self.min_size_to_sample:
            return  # filling up: never waits
        step = n * self.samples_per_insert if what == "insert" else float(n)
        other = "sample" if what == "insert" else "insert"
        most, span = self.largest[other], self.max_diff - self.min_diff
        if step + most > span:
            seen = (f" and {_a(other)} ({_moves(other, most, self.samples_per_insert)}) seen before by {most:g}: "
                    "together" if most else ",")
            raise ValueError(f"rate_limiter: {_a(what)} of {n} moves inserts * samples_per_insert - samples by "
                             f"{step:g}{seen} more than max_diff - min_diff = {span:g}, so "
                             f"{'both could wait for each other forever' if most else 'it could never run'} "
                             "(widen error_buffer, or insert and sample fewer at a time)")
        self.largest[what] = max(self.largest[what], step)

    # ------------------------------------------------------------------ turns

    def take(self, what: str, n: int, sized: bool = False) -> None:
        """Wait (without the buffer's lock) until a ``what`` (``"sample"``/``"insert"``) of ``n`` may run, then
        count it; ``TimeoutError`` after :attr:`timeout` seconds; ``ValueError`` for a size the band cannot hold
        (``sized``: the caller checked its size against the band already, as the commits of writers do)."""
        can = self.can_sample if what == "sample" else self.can_insert
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        with self._cond:
            if not sized:
                self._check_sizes(what, n)
            while not can(n):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"rate_limiter: {_a(what)} of {n} waited {self.timeout} s ({self})")
                if self.poll is None:
                    self._wait(left)
                else:  # rows from other processes arrive only when this process commits them
                    self._wait(_POLL_S if left is None else min(left, _POLL_S))
                    self.poll()
            self._count(what, n)

    def _wait(self, left: float | None) -> None:
        """Wait on the condition, the buffer's lock let go of (a thread taking it meanwhile starts from depth 0)."""
        guard = self._guard
        depth = None if guard is None else guard.depth
        if guard is not None:
            guard.depth = 0
        try:
            self._cond.wait(left)
        finally:
            if guard is not None:
                guard.depth = depth

    def give_back(self, what: str, n: int) -> None:
        """Undo the count of a ``what`` of ``n`` that failed after its turn."""
        with self._cond:
            self._count(what, -n)

    def _count(self, what: str, n: int) -> None:
        if what == "sample":
            self.samples += n
        else:
            self.inserts += n
        self._cond.notify_all()

    def set_size(self, size: int) -> None:
        """The buffer now holds ``size`` transitions."""
        with self._cond:
            self.size = size
            self._cond.notify_all()

    # ------------------------------------------------------------------ state and copies

    def state(self) -> dict:
        return {"inserts": self.inserts, "samples": self.samples}

    def load(self, state: dict | None, size: int) -> None:
        """Counts from :meth:`state` (``None``: ``size`` inserts and the samples that put ``diff`` in the middle of
        its band, so neither side waits at once)."""
        with self._cond:
            if state is None:
                self.inserts = size
                mid = 0.0 if math.isinf(self.min_diff) or math.isinf(self.max_diff) else \
                    (self.min_diff + self.max_diff) / 2
                self.samples = max(0, int(size * self.samples_per_insert - mid))
            else:
                for key in ("inserts", "samples"):
                    v = state.get(key) if isinstance(state, dict) else None
                    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                        raise ValueError(f"state_dict['rate_limiter'][{key!r}]: expected an int >= 0, got {v!r}")
                self.inserts, self.samples = state["inserts"], state["samples"]
            self.size = size
            self._cond.notify_all()

    def config(self) -> tuple:
        return (self.samples_per_insert, self.min_size_to_sample, self.min_diff, self.max_diff, self.timeout)

    def fresh(self) -> "RateLimiter":
        """A limiter of the same configuration with zero counts (a copied buffer's)."""
        return RateLimiter(*self.config())

    def __getstate__(self):
        state = dict(self.__dict__)
        del state["_cond"], state["_guard"]
        return {**state, "attached": False, "poll": None}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.__dict__.setdefault("largest", {"insert": 0.0, "sample": 0.0})  # a pickle of an earlier release
        self._guard, self._cond = None, threading.Condition()

    def __repr__(self) -> str:
        return (f"RateLimiter(samples_per_insert={self.samples_per_insert:g}, min_size_to_sample="
                f"{self.min_size_to_sample}, min_diff={self.min_diff:g}, max_diff={self.max_diff:g}; inserts="
                f"{self.inserts}, samples={self.samples}, size={self.size})")


_POLL_S = 0.002  # how often a waiting call commits rows of writers in other processes


def check_limiter(limiter, capacity: int, row: int = 1, batch: int = 1) -> "RateLimiter | None":
    """``limiter`` checked for a buffer holding ``capacity`` transitions, whose smallest insert holds ``row`` and
    default sample ``batch`` (``None``: none); ``TypeError`` / ``ValueError`` naming ``rate_limiter``."""
    if limiter is None:
        return None
    if not isinstance(limiter, RateLimiter):
        raise TypeError(f"rate_limiter: expected a gpubuf.RateLimiter or None, got {type(limiter).__name__}")
    if limiter.attached:
        raise ValueError("rate_limiter: this RateLimiter already limits another buffer (its counts are that "
                         "buffer's); give each buffer its own")
    if limiter.min_size_to_sample > capacity:
        raise ValueError(f"rate_limiter: min_size_to_sample={limiter.min_size_to_sample} exceeds the "
                         f"{capacity} transitions the buffer holds, so it could never sample")
    span, step = limiter.max_diff - limiter.min_diff, row * limiter.samples_per_insert
    if step + batch > span:
        raise ValueError(f"rate_limiter: an insert of one row ({row} transitions) moves inserts * samples_per_insert "
                         f"- samples by {step:g} and a sample of sample_batch_size={batch} windows by {batch}, "
                         f"together more than its band max_diff - min_diff = {span:g}, so an inserting and a "
                         "sampling thread could both wait forever (widen error_buffer, or sample fewer at a time)")
    return limiter


def _moves(what: str, step: float, spi: float) -> str:
    return f"{step:g} windows" if what == "sample" else f"{step / spi:g} transitions"


def _a(what: str) -> str:
    return f"an {what}" if what == "insert" else f"a {what}"


def _positive(name: str, v) -> float:
    if _flag(v) or not isinstance(v, Real) or not v > 0 or math.isinf(v):
        raise ValueError(f"{name}: expected a finite number > 0, got {v!r}")
    return float(v)


def _flag(v) -> bool:
    """Whether ``v`` is a bool (Python's or numpy's), which no count or size of the limiter takes."""
    return isinstance(v, bool) or type(v).__name__ == "bool_"

