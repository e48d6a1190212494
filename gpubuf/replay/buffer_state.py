"""BufferState: what a replay buffer saves, loads, copies and writes back to its ``storage_dir``.

A base of :class:`~gpubuf.TransitionBuffer`, working on the parts the buffer builds: ``state_dict`` /
``load_state_dict`` (checked whole before any write), the constructor arguments its copies are built from, and the
``flush``, ``close`` and re-open of a ``storage_dir``."""

import warnings

import torch

from gpubuf._core import checkpoint
from gpubuf._core.concurrency import locked
from gpubuf._core.copies import CopiedByState
from gpubuf._core.signals import signals_held
from gpubuf._core.state import copy_into, host_tensor, unaliased
from gpubuf._core.transition import unflatten


class BufferState(checkpoint.Checkpointable, CopiedByState):
    """State, copies and ``storage_dir`` write-back of a replay buffer."""

    def copy_args(self) -> dict:
        """Constructor arguments of an empty buffer that this one's ``state_dict`` loads into (its copies')."""
        c = self.config
        lead = (1, c.n_envs) if c.vectorized_env else (1,)
        sample = unflatten({leaf.path: torch.zeros(lead + leaf.shape, dtype=leaf.dtype) for leaf in c.leaves})
        limiter = self.rate_limiter
        return {"max_size": c.max_size, "sample_batch_size": c.sample_batch_size, "data_sample": sample,
                "vectorized_env": c.vectorized_env, "n_steps": c.n_steps, "device": str(self.device),
                "storage_device": self._init_storage[0], "rate_limiter": None if limiter is None else limiter.fresh(),
                "selector": None if self.selector is None else self.selector.fresh(),
                "storage_dtypes": {leaf.name: leaf.dtype for leaf in c.leaves if leaf.chosen} or None,
                "sample_dtypes": {c.by_path[p].name: d for p, d in c.sample_dtypes} or None, **dict(c.extra)}

    def copy_refusal(self) -> str | None:
        if self.storage.dir is None:
            return None
        return (f"its rows live in the files of storage_dir {str(self.storage.dir.path)!r}, which "
                "one buffer at a time may hold; save a checkpoint (buffer.save(path)) or load "
                "buffer.state_dict() into a new buffer, or close() it and re-open the directory "
                "where it is needed")

    def _reopen(self, state: dict | None, since: int) -> None:
        """Restore a re-opened ``storage_dir``'s flushed ``state`` (``None``: none) into the sampler and the
        rate limiter (``since``: rows held written after that flush)."""
        self.sampler.reopen(state, since)
        for part in self.parts:
            part.rows_loaded(True)
        if self.rate_limiter is not None:
            saved = None if state is None else state.get("rate_limiter")
            if saved is not None:  # every row written after the flush, held still or overwritten since
                after = max(0, self.ring.total - int(state["total"])) if since else 0
                saved = {**saved, "inserts": saved["inserts"] + after * self.config.n_envs}
            self.rate_limiter.load(saved, len(self))

    @locked
    def state_dict(self) -> dict:
        """Configuration, data (the storage itself, not copies), counters, truncation flags, RNG state and the sampler's
        own entries: tensors and plain values only; with a rate limiter, its counts (``"rate_limiter"``)."""
        state = self.config.as_dict()
        state.update(shapes={leaf.name: leaf.shape for leaf in self.config.leaves},
                     data={leaf.name: self.storage.data[leaf.path] for leaf in self.config.leaves}, pos=self.ring.pos,
                     count=self.ring.count, trunc=torch.from_numpy(self.ring.trunc.copy()),
                     rng=self.generator.get_state(), **self.sampler.state())
        if self.selector is not None:
            state.update(self.selector.state())
        if self.rate_limiter is not None:
            state["rate_limiter"] = self.rate_limiter.state()
        return state

    @locked
    def load_state_dict(self, state) -> None:
        """Restore a :meth:`state_dict` (saved on any device), validated whole first: a mismatch raises naming the key
        and changes nothing. Should reading the data fail after validation (an I/O error), the buffer is emptied rather
        than left half-loaded. A rate limiter takes the state's counts (a state without them: as many inserts as
        transitions held, and samples that put the ratio in the middle of its band); a limiter's counts in the state of
        a buffer without one are ignored."""
        optional = ("rate_limiter", "selector_served")  # taken apart from the checked entries
        limits = served = None
        if isinstance(state, dict):
            limits, served = state.get("rate_limiter"), state.get("selector_served")
            state = {k: v for k, v in state.items() if k not in optional}
        template = {k: v for k, v in self.state_dict().items() if k not in optional}
        if self.selector is not None:
            self.selector.check_state(served)
            if served is not None:  # read now (a checkpoint's file-backed tensor): no I/O once writing began
                served = host_tensor(served)
        pos, count, rng, (trunc, ends, last) = self.config.check_state(state, template)
        checked = self.sampler.check_state(state, pos, count)
        data = {leaf.name: self.storage.data[leaf.path] for leaf in self.config.leaves}
        sources = unaliased({name: state["data"][name] for name in data}, data, self._owned)
        self.storage.check_open()
        with signals_held():
            self.storage.before_load(self.ring.total)
            try:
                for name, t in data.items():
                    copy_into(t, sources[name])
                self.sampler.load_state(state, checked, self._owned)
            except BaseException:  # the data is half-read (a read error): forget every row
                self.ring.restore(0, 0)
                for part in self.parts:
                    part.rows_loaded(False)
                raise
            self.ring.restore(pos, count, trunc, ends, last=last)
            for part in self.parts:  # validity, trees and marks are rebuilt from the rows
                part.rows_loaded(True)
            self.generator.set_state(rng)
            if self.rate_limiter is not None:
                self.rate_limiter.load(limits, len(self))
            if self.selector is not None:
                self.selector.load({} if served is None else {"selector_served": served})
        self.flush()  # a storage_dir now holds the loaded state

    @locked
    def flush(self):
        """With a ``storage_dir``: save the sampling RNG state (and priorities, ``max_priority``, ``beta`` when
        prioritized) beside the files and write every file back to disk, so that a later process re-opens this buffer as
        it is now. Without one: nothing to do. Returns ``self``."""
        limiter = {} if self.rate_limiter is None else {"rate_limiter": self.rate_limiter.state()}
        self.storage.flush(self.ring, {"rng": self.generator.get_state(), **self.sampler.flushed(), **limiter})
        return self

    @locked
    def close(self) -> None:
        """With a ``storage_dir``: :meth:`flush`, then release the directory's lock (this buffer can still be sampled,
        no longer written); closing twice is harmless. ``with TransitionBuffer(...) as buf:`` closes on exit. Without
        one, or in a forked child of the process that opened the directory (which keeps its lock): nothing to do. Rows
        that writers in other processes published are committed first (as far as the rate limiter lets them in); a
        ``RowsWaiting`` warning names any left in their queues.

        The directory is released whatever fails on the way. A deferred priority update that failed its checks and was
        not raised yet (``update_priorities(..., deferred=True)``, a ``GraphSampler``'s) is raised after the release and
        the flush (which keeps the priorities as they are: the failed update wrote nothing), so it is never silent and
        re-opening the directory works; any other error of the flush is raised with the directory released too. A
        ``with`` block whose body raised closes the same way but lets the body's exception through, with the close's own
        error as a warning."""
        if self.storage.closed:
            return
        hub, pending = getattr(self, "_hub", None), None
        try:
            if hub is not None:
                hub.collect(report=False, wait=True)  # Ray actors' rows published before the close too
            if self.sampler.prioritized:
                try:  # reported once the directory is released
                    self.sampler.check_updates()
                except (IndexError, ValueError) as err:
                    pending = err
            self.flush()
        finally:
            self.storage.close()
        if hub is not None:
            hub.warn_closed()
        if pending is not None:
            raise pending

    def __enter__(self):
        return self

    def __exit__(self, kind, error, trace) -> None:  # ``with`` closes a storage_dir buffer
        try:  # the body's own exception goes on; the close's is a warning
            self.close()
        except Exception as err:  # noqa: BLE001 (reported, not swallowed)
            if kind is None:
                raise
            warnings.warn(f"close() on leaving the with block that raised {kind.__name__}: "
                          f"{type(err).__name__}: {err}", RuntimeWarning, stacklevel=2)
