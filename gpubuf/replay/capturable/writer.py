"""GraphWriter: replay inserts whose bookkeeping stays on the buffer's device, so that the step that writes them can be
traced whole by ``torch.compile(fullgraph=True)`` or captured in a CUDA graph, beside a ``GraphSampler``.

An insert here is device ops on fixed shapes: the rows go to ``(position + arange(T)) % M`` read from the device copy of
the ring (:class:`~gpubuf.replay.capturable.device_ring.DeviceRing`); the row flags, the counters, the new starts'
priorities (``max_priority``, on the device), the validity masks and prefix-sum trees of every sampling kind and the
episode marks are updated from device values; nothing is read back and nothing the host decides depends on the data. The
host's copy of the bookkeeping catches up when the buffer is next called eagerly (one read of the device).

Value checks run on the device: a cast that must look at the values (``float64`` into ``float32`` storage, ``int64``
into ``int32``) is checked there, and an insert with a value that does not fit writes nothing (no row, no counter);
the failure is counted on the device and raised by :meth:`GraphWriter.check` or the buffer's next eager call.
"""

import torch

from gpubuf._core.concurrency import locked_on_device
from gpubuf._core.copies import refuse_copies
from gpubuf._core.inputs import cast_keeps_values, cast_refusal, check_device_flags, lossless
from gpubuf._core.staging import memory_ranges, overlaps
from gpubuf._core.transition import flatten, leaf_name


def check_writable(buffer) -> None:
    """``ValueError`` naming ``buffer`` unless a graph writer can write it: storage on the sampling device, no
    ``storage_dir`` journal, rate limiter or selector (each decides on the host)."""
    why = None
    if buffer.storage.dir is not None:
        why = "it writes a storage_dir, whose journal brackets each insert on the host"
    elif buffer.storage_device != buffer.device:
        why = f"its storage is on {buffer.storage_device}, not its device {buffer.device}"
    elif buffer.rate_limiter is not None:
        why = "its rate limiter waits on the host"
    elif buffer.selector is not None:
        why = f"its selector {buffer.selector!r} follows the rows on the host"
    if why:
        raise ValueError(f"buffer: a GraphWriter writes from device state only; {why}")


@refuse_copies("its tensors may be captured in a CUDA graph of its buffer; build a new one with copy.graph_writer() "
               "on the buffer's copy")
class GraphWriter:
    """Device-side inserts into a :class:`~gpubuf.TransitionBuffer` (or prioritized one), built by
    :meth:`TransitionBuffer.graph_writer`. :meth:`insert` writes what ``buffer.insert`` writes, rows, flags,
    counters, priorities and validity alike, with device ops only.

    Building one keeps every sampling kind's tree and the episode marks current from then on (a graph that inserts
    cannot build them later), and moves ``max_priority`` to the device. The host's bookkeeping is then a copy: each
    eager call of the buffer first reads the device's counters (and the flags of rows written since), the documented
    price of ``len``, ``sample``, ``state_dict`` and the others; ``GraphSampler`` calls and :meth:`insert` read none.
    """

    def __init__(self, buffer):
        check_writable(buffer)
        self.buffer, self._guard, self.config = buffer, buffer.guard, buffer.config
        sampler, M, E = buffer.sampler, buffer.config.max_rows, buffer.config.n_envs
        for kind in buffer.config.kinds:
            sampler.activate(kind)
        self._trees = {k: sampler.tree(k) for k in buffer.config.kinds}
        self._valid = {k: sampler.valid_mask(k).view(M, E) for k in buffer.config.kinds}
        self._marks = buffer.episode_marks()
        self._max = sampler.device_updates().max if sampler.prioritized else None
        self.ring = buffer.device_ring()
        # what the configuration derives, read now (a traced call cannot compute a cached property: it takes a lock)
        c = buffer.config
        self._paths, self._flag_paths = set(c.by_path), (*c.flag_paths, c.term_paths)
        self._envs = torch.arange(E, device=buffer.device)
        # every tensor the buffer holds (none is allocated from now on): eager inputs reaching them are copied
        self._owned = memory_ranges([*buffer.storage.tensors(), *sampler.tensors(), *buffer.reader.tensors(),
                                     self.ring.counters, self.ring.flags])

    @locked_on_device
    def insert(self, transition, valid: torch.Tensor | None = None) -> None:
        """Write ``T`` rows per env at the device's write position, as ``buffer.insert(transition)`` does, with no
        host read: leaves ``(T, E, ...)`` (``(T, ...)`` not vectorized) on the buffer's device with the stored leaves
        and shapes, and dtypes that keep their values in the stored ones (checked on the host when the cast is
        refused whatever the values, else on the device: see :meth:`check`). All or nothing; ``valid``: a () bool
        on the device, the caller's own checks (false: the insert writes nothing and counts as dropped)."""
        self._write(self._stage(*self.check_inputs(transition, valid)))

    def check_inputs(self, transition, valid: torch.Tensor | None = None) -> tuple:
        """Raise what :meth:`insert` raises on the host (``ValueError``/``TypeError`` naming the leaf or ``valid``),
        writing nothing: a caller writing several buffers in one step checks each before writing any. Returns
        ``(leaves, T, valid)``."""
        values, T = self._checked(transition)
        if valid is not None:
            check_device_flags("valid", valid, (), self.buffer.device)
        return values, T, valid

    def _stage(self, values: dict, T: int, valid) -> tuple:
        """What :meth:`insert` writes, staged: every conversion and device check, nothing written."""
        ok = self._values_fit(values, valid)
        c, ring, b = self.config, self.ring, self.buffer
        pos, count, total, dropped = ring.counters.clone().unbind()  # as before this insert
        rows = (pos + torch.arange(T, device=b.device)) % c.max_rows
        flat = (rows[:, None] * c.n_envs + self._envs).reshape(-1)  # (T * E,) flat rows
        stored = {leaf.path: values[leaf.path].detach().to(leaf.dtype) for leaf in c.leaves}
        words = {p: self._as_words(b.storage.words[p], flat, new, ok) for p, new in stored.items()}
        flags = self._row_flags(stored, T)
        if ok is not None:  # a dropped insert leaves the rows' own flags
            flags = torch.where(ok, flags, ring.flags.index_select(1, rows))
        return T, ok, rows, flat, stored, words, flags, (pos, count, total, dropped)

    def _write(self, staged: tuple) -> None:
        """Write what :meth:`_stage` staged (device ops that cannot fail on staged data)."""
        T, ok, rows, flat, stored, words, flags, (pos, count, total, dropped) = staged
        M, ring = self.config.max_rows, self.ring
        for p, src in words.items():
            self.buffer.storage.words[p].index_copy_(0, flat, src)
        ring.flags.index_copy_(1, rows, flags)
        step = T if ok is None else T * ok.to(torch.int64)
        count = torch.clamp(count + step, max=M)
        dropped = dropped if ok is None else dropped + (~ok).to(torch.int64)
        ring.counters.copy_(torch.stack([(pos + step) % M, count, total + step, dropped]))
        self._refresh(pos, T, count, rows, stored, ok)

    def _refresh(self, old_pos, T: int, count, rows, stored: dict, ok) -> None:
        """New starts' priorities, then every kind's validity and masses around the rows written, and the marks."""
        c, b = self.config, self.buffer
        M, E = c.max_rows, c.n_envs
        oldest = (self.ring.counters[0] - count) % M
        if self._max is not None:
            prio = b.sampler.priority.view(M, E)
            top = self._max.expand(T, E)
            prio.index_copy_(0, rows, top if ok is None else torch.where(ok, top, prio.index_select(0, rows)))
        W = max(b.ring.window(k) for k in self._trees)
        K = min(T + W - 1, M)  # rows whose starts' windows changed: the longest window before the rows, and them
        changed = (old_pos + (T - K) + torch.arange(K, device=b.device)) % M
        starts = (changed[:, None] * E + self._envs).reshape(-1)
        for kind, tree in self._trees.items():
            valid = self.ring.validity(changed, kind, oldest, count)
            self._valid[kind].index_copy_(0, changed, valid)
            tree.update(starts, b.sampler.mass(starts, valid.reshape(-1), False))
        marks, bits = self._marks, self._marks.bits(stored, T)
        if ok is not None:
            bits = torch.where(ok, bits, marks.marks.view(M, E).index_select(0, rows))
        marks.marks.view(M, E).index_copy_(0, rows, bits)
        marks.held.copy_(torch.stack([oldest, count]))

    def _as_words(self, words: torch.Tensor, flat: torch.Tensor, new: torch.Tensor, ok) -> torch.Tensor:
        """``new`` (K rows of the stored dtype) as rows of a leaf's storage ``words`` (M*E, D), to be written at rows
        ``flat`` (K,) (where ``ok``, a () bool, is false: those rows' own words). The words the gathers read are
        written, never a view of another dtype (which ``torch.compile``'s functionalization cannot follow); an eager
        input reaching the buffer's own memory is copied first."""
        src = new.reshape(flat.shape[0], -1)
        traced = self.buffer.table.tracing()
        if not traced and overlaps(src, self._owned):
            src = src.clone()
        if src.dtype != words.dtype:
            # viewed as words from offset 0 with row-major strides (a traced step cannot ask; its compiler fuses it)
            if traced or src.stride() != (src.shape[1], 1) \
                    or src.storage_offset() * src.element_size() % words.element_size():
                src = src.clone(memory_format=torch.contiguous_format)
            src = src.view(torch.uint8).view(words.dtype)
        if ok is not None:
            src = torch.where(ok, src, words.index_select(0, flat))
        return src

    def _checked(self, transition) -> tuple[dict, int]:
        """``({path: tensor}, T)`` after the checks that need no values: leaves, shapes, devices, dtypes."""
        given, c = flatten(transition), self.config
        if given.keys() != self._paths:
            raise ValueError(f"transition: expected the leaves {[leaf.name for leaf in c.leaves]}, got "
                             f"{[leaf_name(p) for p in given]}")
        env = (c.n_envs,) if c.vectorized_env else ()
        T = None
        for leaf in c.leaves:
            t = given[leaf.path]
            want = env + leaf.shape
            if not isinstance(t, torch.Tensor) or t.device.type != self.buffer.device.type or t.layout != torch.strided:
                got = f"a {t.layout} tensor on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{leaf.name}: expected a tensor on {self.buffer.device}, got {got}")
            if t.dim() != len(want) + 1 or tuple(t.shape[1:]) != want or (T is not None and t.shape[0] != T):
                raise ValueError(f"{leaf.name}: expected shape ({T or 'T'}, {', '.join(map(str, want))}), got "
                                 f"{tuple(t.shape)}")
            T = t.shape[0]
            why = cast_refusal(t.dtype, leaf.dtype)
            if why:
                raise TypeError(f"{leaf.name}: cannot store {t.dtype} in the stored dtype {leaf.dtype} ({why})")
        if not 1 <= T <= c.max_rows:
            raise ValueError(f"transition: expected 1 <= T <= {c.max_rows} rows per insert, got T = {T}")
        return given, T

    def _values_fit(self, values: dict, valid):
        """() bool on the device: whether every leaf whose cast depends on its values keeps them, and ``valid`` (the
        caller's () bool) holds; ``None``: nothing to check."""
        ok = valid
        for leaf in self.config.leaves:
            t = values[leaf.path]
            if not lossless(t.dtype, leaf.dtype):
                fits = cast_keeps_values(t, leaf.dtype)
                ok = fits if ok is None else ok & fits
        return ok

    def _row_flags(self, stored: dict, T: int) -> torch.Tensor:
        """(3, T, E) bool: the ring's flags of the rows ``stored`` (a row set where any value of the leaf is)."""
        E = self.config.n_envs
        trunc, ends, last, term = self._flag_paths

        def any_set(paths):
            out = torch.zeros(T, E, dtype=torch.bool, device=self.buffer.device)
            for p in paths:
                out = out | (stored[p].reshape(T, E, -1) != 0).any(2)
            return out

        return torch.stack([any_set(trunc) & ~any_set(term), any_set(ends), any_set(last)])

    def check(self) -> None:
        """Raise ``ValueError`` when inserts wrote nothing since the last check (a value its stored dtype cannot hold,
        found on the device), once; the buffer's catch-up (:meth:`TransitionBuffer.catch_up`), which every eager
        call of the buffer runs first, raises it too."""
        self.buffer.catch_up()


def dropped_error(dropped: int) -> ValueError:
    """The error of ``dropped`` graph inserts that wrote nothing."""
    return ValueError(f"GraphWriter.insert: {dropped} insert(s) since the last check wrote nothing: a value failed its "
                      "check on the device (one its stored dtype cannot hold, or a check of the caller's such as a "
                      "TensorSource's non-finite actions)")
