"""Where a replay buffer's transitions live: one storage object, chosen once at construction.

Every storage has the same small surface: :meth:`~MemoryStorage.stage` (check and convert an insert's leaves, before
anything is written), :meth:`~MemoryStorage.write` (commit staged rows at a ring position),
:meth:`~MemoryStorage.gather` (the windows of sampled starts, on the sampling device), and the journal hooks a buffer
calls around its writes, flushes and loads (no-ops but for files).

- :class:`MemoryStorage`: time-major ``(M, E, *shape)`` tensors on the sampling device, or in host memory
  (``storage_device="cpu"``: windows gathered on the host into pinned memory, copied over non-blocking; why
  time-major there too: :mod:`gpubuf.replay.storage.tiers`);
- :class:`MappedStorage`: the env-major files of a ``storage_dir`` (:mod:`gpubuf.replay.storage.directory`).
"""

import numpy as np
import torch

from gpubuf import ops
from gpubuf._core.signals import signals_held
from gpubuf._core.staging import Staging, check_disjoint, overlaps
from gpubuf._core.transition import flatten, leaf_name
from gpubuf.ops import as_words, gather_word
from gpubuf.ops.indexing import window_rows
from gpubuf.replay.config import NOT_IN_NUMPY, ReplayConfig
from gpubuf.replay.storage import tiers
from gpubuf.replay.storage.directory import StorageDir


class MemoryStorage:
    """Time-major ``(M, E, *shape)`` storage of every leaf of ``config`` on ``device``."""

    dir = None  # the StorageDir of a MappedStorage

    def __init__(self, config: ReplayConfig, device: torch.device):
        M, E = config.max_rows, config.n_envs
        lead = (M, E) if config.vectorized_env else (M,)
        base = ops.allocate({leaf.name: lead + leaf.shape for leaf in config.leaves},
                            {leaf.name: leaf.dtype for leaf in config.leaves}, device)
        self._bind(config, device, base, base)

    def _bind(self, config: ReplayConfig, device: torch.device, views: dict, base: dict) -> None:
        """Keep ``views`` ``{name: (M, E, *shape)}`` (time-major, as written) of contiguous ``base`` tensors."""
        M, E = config.max_rows, config.n_envs
        # what each op call runs: a storage_dir's env-major files gather with the twins
        self.config, self.device, self.table = config, device, ops.backend_table(device, env_major=self.dir is not None)
        self.data = {leaf.path: views[leaf.name] for leaf in config.leaves}
        self.flat = {leaf.path: base[leaf.name].view(M * E, -1) for leaf in config.leaves}  # (M*E, D) contiguous
        self.words = {p: as_words(t)[0] for p, t in self.flat.items()}  # windows are gathered as int words
        # host storage as numpy views: a same-dtype host array is written by one numpy slice assignment
        self.host = {p: t.numpy() for p, t in self.data.items() if device.type == "cpu" and t.dtype not in NOT_IN_NUMPY}
        self.staging = Staging(device)
        self._host_jobs: dict = {}  # (B, with_next_obs) -> host_jobs

    def tensors(self) -> list[torch.Tensor]:
        return list(self.data.values())

    def rows(self, path: tuple) -> torch.Tensor:
        """(M*E, D) rows of leaf ``path`` in its dtype. Traced by ``torch.compile``: viewed from the words inside the
        traced code, so that a step writing the words and reading the rows sees one graph input per leaf (compiling
        backends cannot follow a write to one input through another of a different dtype)."""
        if not self.table.tracing() or self.words[path].dtype == self.flat[path].dtype:
            return self.flat[path]
        return self.words[path].view(torch.uint8).view(self.flat[path].dtype).view(self.flat[path].shape)

    def stage(self, values: dict, given: dict, owned: tuple) -> dict:
        """Each leaf of an insert converted for storage (where any conversion fails, before any write): a numpy array
        for a same-dtype host input into host storage, else a staged tensor."""
        staged = {}
        for leaf in self.config.leaves:
            t = values[leaf.path]
            if leaf.path in self.host and type(given[leaf.path]) is np.ndarray \
                    and t.dtype == leaf.dtype and not overlaps(t, owned):
                staged[leaf.path] = t.numpy()  # one numpy slice assignment, which cannot fail
            else:
                staged[leaf.path] = self.staging.stage(t, leaf.name, leaf.dtype, owned)
        return staged

    def write(self, staged: dict, pos: int, before_wrap: int, T: int) -> None:
        """Rows ``pos .. pos + before_wrap - 1`` and ``0 .. T - before_wrap - 1`` = the staged rows."""
        for p, src in staged.items():
            dst = self.host[p] if isinstance(src, np.ndarray) else self.data[p]
            if before_wrap == T:
                dst[pos:pos + T] = src
            else:
                dst[pos:] = src[:before_wrap]
                dst[:T - before_wrap] = src[before_wrap:]

    # ------------------------------------------------------------------ windows

    def check_out(self, out, jobs: list, device, owned: tuple) -> dict:
        """``{output path: (tensor or None, stored path, shift, shape)}``, checking a caller's ``out``."""
        if out is None:
            return {d: (None, s, shift, shape) for d, s, shift, shape in jobs}
        given, result, by_path = flatten(out, "out"), {}, self.config.by_path
        for d, s, shift, shape in jobs:
            t, dtype = given.get(d), by_path[s].dtype
            if (not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype
                    or t.device != device or not t.is_contiguous()):
                got = (f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__)
                raise ValueError(f"out.{leaf_name(d)}: expected a contiguous {dtype} tensor of "
                                 f"shape {shape} on {device}, got {got}")
            result[d] = (t, s, shift, shape)
        check_disjoint({f"out.{leaf_name(d)}": t for d, (t, *_) in result.items()}, owned)
        return result

    def gather(self, starts: torch.Tensor, jobs: dict, device: torch.device) -> dict:
        """``{output path: (B, n, ...) tensor on device}``: the windows of flat ``starts`` (B,) for
        :meth:`check_out`'s ``jobs`` (into the given tensors where there are)."""
        B = starts.shape[0]
        if self.device == device:
            result, work = self.outputs(B, jobs, device)
            self.gather_windows(work, starts)
            return result
        # host storage: gather on the host (into pinned memory for CUDA), then one non-blocking copy per leaf
        host, work = self.outputs(B, {d: (None, *rest) for d, (_, *rest) in jobs.items()},
                                  self.device, pin=device.type == "cuda")
        self.gather_windows(work, starts.to(self.device))
        return {d: t.to(device, non_blocking=True) if jobs[d][0] is None
                else jobs[d][0].copy_(t, non_blocking=True)
                for d, t in host.items()}

    def host_jobs(self, B: int, with_next_obs: bool, device) -> list | None:
        """The host's steady-state gather of fresh outputs with the torch twin (else ``None``): ``[(output path, rows
        (M*E, D), shift, output shape, words' dtype or None)]`` per ``(B, with_next_obs)``; wide rows as int words."""
        if device != self.device or not self.table.host_gather:
            return None
        jobs = self._host_jobs.get((B, with_next_obs))
        if jobs is None:
            jobs = []
            for d, s, shift, shape in self.config.jobs(B, with_next_obs):
                src = self.flat[s]
                if src.shape[1] == 0:
                    return None
                if gather_word(src.dtype, src.shape[1] * src.element_size()) is None:
                    jobs.append((d, src, shift, shape, None))
                else:
                    jobs.append((d, self.words[s], shift, shape, self.config.by_path[s].dtype))
            if len(self._host_jobs) >= 8:
                self._host_jobs.clear()
            self._host_jobs[(B, with_next_obs)] = jobs
        return jobs

    def gather_host_jobs(self, jobs: list, starts: torch.Tensor) -> dict:
        """``{output path: tensor}``: the windows of flat ``starts`` (B,) for :meth:`host_jobs`
        (the twin's rows, :func:`gpubuf.ops.indexing.window_rows`)."""
        n, E, M = self.config.n_steps, self.config.n_envs, self.config.max_rows
        rows, result = {}, {}
        for d, src, shift, shape, dtype in jobs:
            if shift not in rows:
                rows[shift] = window_rows(starts, n, shift, E, M)
            t = torch.index_select(src, 0, rows[shift])
            result[d] = (t if dtype is None else t.view(dtype)).view(shape)
        return result

    def gather_windows(self, work: list, starts: torch.Tensor) -> None:
        """Fill :meth:`outputs`' ``work`` with the windows of flat ``starts`` (B,) on this storage's device."""
        config = self.config
        self.table.window_gather(work, starts, config.n_steps, config.n_envs, config.max_rows)

    def outputs(self, B: int, jobs: dict, device, pin: bool = False) -> tuple[dict, list]:
        """``({output path: tensor}, [(stored words, output words (B, n, D), shift)])`` for ``jobs``: the given output
        tensors, or fresh ones on ``device`` (``pin``: in pinned host memory)."""
        n, result, work, by_path = self.config.n_steps, {}, [], self.config.by_path
        for d, (dst, s, shift, shape) in jobs.items():
            src = self.words[s]
            if dst is None and src.shape[1] == 0:  # zero-width leaf: nothing to gather
                result[d] = torch.empty(shape, dtype=by_path[s].dtype, device=device)
                continue
            if dst is None:
                try:
                    words = torch.empty((B, n, src.shape[1]), dtype=src.dtype, device=device, pin_memory=pin)
                except (RuntimeError, torch.OutOfMemoryError) as err:
                    raise MemoryError(f"batch_size: {B} windows need an output of shape {shape} for {leaf_name(d)}, "
                                      f"which cannot be allocated on {device} ({str(err).splitlines()[0]})") from None
                dst = words.view(torch.uint8).view(by_path[s].dtype).view(shape)
            else:  # a caller's tensor may sit at any offset: both sides get a word type they share
                flat = self.flat[s]
                src, words = as_words(flat, dst.view(B * n, flat.shape[1]))
                words = words.view(B, n, src.shape[1])
            work.append((src, words, shift))
            result[d] = dst
        return result, work

    # ------------------------------------------------------------------ journal hooks (files only)

    closed = False

    def check_open(self) -> None:
        """Raise if the storage can no longer be written."""

    def before_write(self, pos: int, count: int, total: int, T: int) -> None:
        """About to write ``T`` rows at ``pos`` of a ring holding ``count`` rows."""

    def after_write(self, pos: int, count: int, total: int) -> None:
        """The rows are written; the ring now holds ``count`` rows before ``pos``."""

    def before_load(self, total: int) -> None:
        """About to overwrite every row."""

    def flush(self, ring, state: dict) -> None:
        """Save ``state`` (host values) and the ring's counters beside the rows so that a later
        process re-opens them (a ``storage_dir``: every file written back); here nothing."""

    def close(self) -> None:
        """Release what lets this storage be written (a ``storage_dir``'s lock)."""

    def reopen(self, ring, reopen, generator: torch.Generator) -> bool:
        """Restore what a re-opened directory holds into ``ring``, the sampler (``reopen(flushed state or None, rows
        held written after it)``) and ``generator``; returns whether its flushed state was saved by a flush cut short
        (the buffer then completes it). Nothing to re-open here."""
        return False


class MappedStorage(MemoryStorage):
    """Env-major ``(E, M, *shape)`` files of the ``storage_dir`` ``path`` (re-opened when it holds this
    configuration; ``reopened`` says so), host memory written through time-major views. Every write (insert,
    load, flush, priority and beta updates) passes :meth:`check_open` first, which refuses a process other than
    the one that opened the directory; there :attr:`closed` is true (:mod:`gpubuf.replay.storage.directory`)."""

    def __init__(self, config: ReplayConfig, path):
        M, E = config.max_rows, config.n_envs
        self.dir = StorageDir(path, config.as_dict(batch=False), {leaf.name: (E, M) + leaf.shape
                                                                  for leaf in config.leaves},
                              {leaf.name: leaf.dtype for leaf in config.leaves})
        base = self.dir.tensors
        views = {k: t.transpose(0, 1) if config.vectorized_env else t[0] for k, t in base.items()}
        self._bind(config, torch.device("cpu"), views, base)
        self.reopened = self.dir.reopened

    def gather_windows(self, work: list, starts: torch.Tensor) -> None:
        config = self.config
        tiers.env_major_gather(work, starts, config.n_steps, config.n_envs, config.max_rows, prefetch=True)

    @property
    def closed(self) -> bool:  # closed, or (a forked child) open in another process
        return self.dir.closed

    def check_open(self) -> None:
        """Raise unless this process may write the directory now: ``RuntimeError`` in a process
        other than the one that opened it (:meth:`~gpubuf.replay.storage.directory.StorageDir.check_writer`),
        ``ValueError`` once closed. One pid comparison: cheap enough for every insert."""
        d = self.dir
        d.check_writer()
        if d.lock.file.closed:
            raise ValueError(f"storage_dir: {str(d.path)!r} was closed; open a new buffer on it to write")

    def before_write(self, pos: int, count: int, total: int, T: int) -> None:
        # held rows about to go: forgotten
        self.dir.before_write(pos, count, total, T, self.config.max_rows)

    def after_write(self, pos: int, count: int, total: int) -> None:
        self.dir.commit(pos, count, total)

    def before_load(self, total: int) -> None:
        self.dir.before_load(total)  # a load killed half-way re-opens as an empty buffer

    def reopen(self, ring, reopen, generator: torch.Generator) -> bool:
        # everything is restored and checked before the directory is claimed (lock file, a journal
        # of the earlier format converted): a refused re-open leaves it as it was
        if not self.reopened:
            self.dir.claim()
            return False
        M, paths = self.config.max_rows, sum(self.config.flag_paths, [])
        pos, count, total, flushes = self.dir.opened_counters(M)
        trunc, ends, last = self.config.row_flags({p: self.data[p] for p in paths}, M)
        ring.restore(pos, count, trunc, ends, total, last)
        ahead = self.dir.restore_flushed(ring, flushes, reopen, generator)
        self.dir.claim()
        return ahead

    def flush(self, ring, state: dict) -> None:
        self.check_open()
        with signals_held():
            self.dir.save_state({"total": ring.total, **state}, (ring.pos, ring.count, ring.total))

    def close(self) -> None:
        self.dir.close()


def word_views(result: dict, work: list) -> dict | None:
    """``{output path: (index into work, dtype, shape)}``: which gathered words of :meth:`MemoryStorage.outputs`'
    ``work`` each output leaf of ``result`` views (so a traced caller can rebuild the leaves as views of the words
    it writes); ``None`` when a leaf views none (a zero-width leaf)."""
    views = {}
    for path, t in result.items():
        i = next((i for i, (_, words, _) in enumerate(work) if words.data_ptr() == t.data_ptr()
                  and words.numel() * words.element_size() == t.numel() * t.element_size()), None)
        if i is None:
            return None
        views[path] = (i, t.dtype, tuple(t.shape))
    return views


def leaves_of_words(views: dict, work: list) -> dict:
    """The output leaves :func:`word_views` describes, made again as views of ``work``'s words."""
    return {path: work[i][1].view(torch.uint8).view(dtype).view(shape) for path, (i, dtype, shape) in views.items()}
