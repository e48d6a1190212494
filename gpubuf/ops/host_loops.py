"""Compiled host loops (numba) for the CPU calls where a chain of small torch ops is the floor.

On the CPU a tree walk or update is a chain of two dozen torch ops of a few microseconds of dispatch each; a loop
compiled once does the same work in one call. These loops run the CPU side of the prefix-sum tree ops (descent, leaf and
range updates), of the checked priority update and of the importance weights, when numba is installed (``pip install
gpubuf[fast]``) and ``GPUBUF_NUMBA`` is not ``0``; otherwise the pure-torch twins run, and the tests run both. Each loop
does what its twin does, in exact arithmetic: a parent is the sum of its ``fanout`` children added in order (every CPU
write of a tree goes through the same loops, so a tree stays one function of its leaves), and a descent takes the first
child whose running sum exceeds the remaining mass, never a child of zero mass.

numba is imported, and the loops compiled (cached on disk), at the first call of any of them, not at ``import gpubuf``.
The loops are written below as plain Python (``_name``); the public ``name`` first compiles them all, then is the
compiled loop itself.
"""

import importlib.util
import os

import numpy as np

from gpubuf.kernels import BAD_INDEX, NOT_FINITE, OVERFLOW  # the checks of a priority write, as bits

ENABLED = os.environ.get("GPUBUF_NUMBA", "1").strip() != "0" and importlib.util.find_spec("numba") is not None
_LOOPS = ("tree_update", "tree_update_range", "tree_sample", "tree_sample_masses", "importance_weights",
          "priority_write", "priority_masses", "masses", "priority_update", "put_flags", "ring_write",
          "refresh_starts")  # callees before their callers


_COMPILED = False


def _compile_all() -> None:
    """Compile every loop and bind ``name`` and ``_name`` to it (the loops call each other by ``_name``); division
    as in numpy (a zero divisor gives inf or NaN, as the torch twins do, not an exception)."""
    scope = globals()
    if scope["_COMPILED"]:  # a caller kept a first-call wrapper (the backend table's insert loops)
        return
    try:
        import numba
    except ImportError as err:
        raise RuntimeError(f"gpubuf's compiled host loops need numba, which failed to import ({err}); set "
                           "GPUBUF_NUMBA=0 to run the torch paths") from err
    for name in _LOOPS:
        scope[name] = scope["_" + name] = numba.njit(cache=True, nogil=True, error_model="numpy")(scope["_" + name])
    scope["_COMPILED"] = True


def _first_call(name: str):
    def call(*args):
        _compile_all()
        return globals()[name](*args)

    call.__name__ = call.__qualname__ = name
    return call


def _tree_update(tree, offsets, fanout, idx, values):  # pragma: no cover (compiled)
    """Leaves ``tree[idx] = values`` (K,), then each touched parent, level by level, the ordered sum of its children."""
    K = idx.shape[0]
    for i in range(K):
        tree[idx[i]] = values[i]
    nodes = np.sort(idx)
    for k in range(1, offsets.shape[0] - 1):
        c0, p0, prev = offsets[k - 1], offsets[k], -1
        for i in range(K):
            p = nodes[i] // fanout
            nodes[i] = p
            if p != prev:
                s = 0.0
                for j in range(c0 + p * fanout, c0 + (p + 1) * fanout):
                    s += tree[j]
                tree[p0 + p] = s
                prev = p


def _tree_update_range(tree, offsets, fanout, lo, values):  # pragma: no cover (compiled)
    """Leaves ``tree[lo:lo + n] = values`` (n,), then their parents, the ordered sums of their children."""
    n = values.shape[0]
    for i in range(n):
        tree[lo + i] = values[i]
    a, b = lo, lo + n
    for k in range(1, offsets.shape[0] - 1):
        c0, p0 = offsets[k - 1], offsets[k]
        a, b = a // fanout, (b - 1) // fanout + 1
        for p in range(a, b):
            s = 0.0
            for j in range(c0 + p * fanout, c0 + (p + 1) * fanout):
                s += tree[j]
            tree[p0 + p] = s


def _tree_sample(tree, offsets, fanout, u, out):  # pragma: no cover (compiled)
    """``out[b]`` = the leaf uniform ``u[b]`` picks, in proportion to the leaves' masses: from the top node down,
    the first child whose running sum exceeds the remaining mass (the last child of positive mass when rounding
    puts the mass at or past the node's)."""
    top = offsets.shape[0] - 2
    total = 0.0
    for j in range(offsets[top], offsets[top] + fanout):
        total += tree[j]
    for b in range(u.shape[0]):
        target = min(u[b] * total, total * (1.0 - 2.0**-52))
        node = 0
        for k in range(top, -1, -1):
            base = offsets[k] + node * fanout
            run, chosen = 0.0, -1
            for j in range(fanout):
                c = tree[base + j]
                if c > 0:
                    if run + c > target:
                        chosen = j
                        break
                    run += c
            if chosen < 0:  # rounding: the last child of positive mass, and the mass before it
                chosen, run, before = 0, 0.0, 0.0
                for j in range(fanout):
                    if tree[base + j] > 0:
                        chosen, run = j, before
                    before += tree[base + j]
            target = max(target - run, 0.0)
            node = node * fanout + chosen
        out[b] = node


def _tree_sample_masses(tree, offsets, fanout, u, out, mass):  # pragma: no cover (compiled)
    """:func:`tree_sample`, and ``mass[b]`` = the picked leaf's mass."""
    _tree_sample(tree, offsets, fanout, u, out)
    for b in range(out.shape[0]):
        mass[b] = tree[out[b]]


def _importance_weights(mass, beta, out):  # pragma: no cover (compiled)
    """``out`` (B,) float32 = ``(mass / min(mass)) ** -beta`` of drawn masses ``mass`` (B,) float64."""
    low = mass[0]
    for b in range(1, mass.shape[0]):
        if mass[b] < low:
            low = mass[b]
    for b in range(mass.shape[0]):
        out[b] = (mass[b] / low) ** -beta


def _priority_write(priority, idx, td, eps, limit):  # pragma: no cover (compiled)
    """Priorities ``float32(|td| + eps)`` (K,) of starts ``idx`` (K,) int64, duplicates keeping their largest, checked
    first: returns ``(code, top)``, the failed checks' bits (nothing written unless 0) and the largest new priority."""
    size, code, top = priority.shape[0], 0, np.float32(0.0)
    for i in range(idx.shape[0]):
        if idx[i] < 0 or idx[i] >= size:
            code |= BAD_INDEX
        v = np.float32(abs(np.float32(td[i]))) + eps
        if not np.isfinite(v):
            code |= NOT_FINITE
        elif v > top:
            top = v
    if code == 0 and top >= limit:
        code |= OVERFLOW
    if code == 0:
        for i in range(idx.shape[0]):
            priority[idx[i]] = np.float32(abs(np.float32(td[i]))) + eps
        for i in range(idx.shape[0]):
            v = np.float32(abs(np.float32(td[i]))) + eps
            if v > priority[idx[i]]:
                priority[idx[i]] = v
    return code, top


def _priority_masses(priority, idx, valid, alpha, out):  # pragma: no cover (compiled)
    """``out`` (K,) float64 = ``priority[idx] ** alpha`` where ``valid[idx]``, else 0: the masses of starts ``idx``."""
    for i in range(idx.shape[0]):
        j = idx[i]
        out[i] = np.float64(priority[j]) ** alpha if valid[j] else 0.0


def _masses(priority, valid, alpha, out):  # pragma: no cover (compiled)
    """``out`` (n,) float64 = ``priority ** alpha`` where ``valid``, else 0 (``priority``, ``valid``: (n,))."""
    for i in range(out.shape[0]):
        out[i] = np.float64(priority[i]) ** alpha if valid[i] else 0.0


def _priority_update(priority, idx, td, eps, limit, alpha, valid, tree, offsets, fanout, top_box,
                     result):  # pragma: no cover (compiled)
    """:func:`priority_write`, then the masses of ``idx`` in one tree (``valid``, ``tree``, ``offsets``, ``fanout``)
    and ``top_box[0] = max(top_box[0], largest new priority)``, all in one call (no Python signal handler runs
    between them); nothing written when a check fails. ``result`` (2,) = ``(code, top)`` of :func:`priority_write`."""
    code, top = _priority_write(priority, idx, td, eps, limit)
    if code == 0:
        mass = np.empty(idx.shape[0])
        _priority_masses(priority, idx, valid, alpha, mass)
        _tree_update(tree, offsets, fanout, idx, mass)
        if top > top_box[0]:
            top_box[0] = top
    result[0] = code
    result[1] = top


def _put_flags(flags, new, pos):  # pragma: no cover (compiled)
    """Rows ``pos, pos + 1, ...`` (mod M) of ``flags`` (M, E) bool = ``new`` (T, E); returns the change in set flags."""
    M, change = flags.shape[0], 0
    for t in range(new.shape[0]):
        r = (pos + t) % M
        for e in range(new.shape[1]):
            change += np.int64(new[t, e]) - np.int64(flags[r, e])
            flags[r, e] = new[t, e]
    return change


def _ring_write(trunc, ends, last, new_trunc, new_ends, new_last, pos, counts, priority, top):  # pragma: no cover
    """The row flags of ``T`` rows written at row ``pos`` of a ring: ``trunc``, ``ends``, ``last`` (M, E) bool = the
    new rows' ``new_*`` (T, E) (a (0, E) array: no such leaf), ``counts`` (3,) int64 += the changes in set flags; the
    new starts' ``priority`` (M*E,) float32 = ``top`` (an empty ``priority``: none kept)."""
    counts[0] += _put_flags(trunc, new_trunc, pos)
    counts[1] += _put_flags(ends, new_ends, pos)
    counts[2] += _put_flags(last, new_last, pos)
    M, E = trunc.shape
    if priority.shape[0]:
        T = max(new_trunc.shape[0], new_ends.shape[0], new_last.shape[0])
        for t in range(T):
            r = (pos + t) % M
            for e in range(E):
                priority[r * E + e] = np.float32(top)


def _refresh_starts(valid, mask, trunc, ends, last, kind, n_steps, last_t, oldest, a, K, priority, alpha, tree,
                    offsets, fanout):  # pragma: no cover (compiled)
    """The validity of kind ``kind`` (bit 0: next observations read, bit 1: inside one episode) of every start of
    the ``K`` rows ``a, a + 1, ...`` (mod M), written to the ring's ``valid`` and the sampler's ``mask`` (M*E,) bool,
    and their masses (``priority ** alpha``, an empty ``priority``: 1; 0 where invalid) to the tree's leaves, then
    their parents; returns the change in valid starts. A start is valid when its row's time index (0 = ``oldest``)
    is at most ``last_t`` and its window holds no forbidden flag (:func:`gpubuf.replay.ring.forbidden_starts`)."""
    M, E = trunc.shape
    change = 0
    mass = np.empty(K * E)
    for i in range(K):
        r = (a + i) % M
        in_time = (r - oldest) % M <= last_t
        for e in range(E):
            ok = in_time and not last[r, e]
            if ok and kind & 1:
                for s in range(n_steps):
                    ok = ok and not trunc[(r + s) % M, e]
            if ok and kind & 2:
                for s in range(n_steps - 1):
                    ok = ok and not ends[(r + s) % M, e]
            j = r * E + e
            change += np.int64(ok) - np.int64(valid[j])
            valid[j] = ok
            mask[j] = ok
            if not ok:
                mass[i * E + e] = 0.0
            elif priority.shape[0]:
                mass[i * E + e] = np.float64(priority[j]) ** alpha
            else:
                mass[i * E + e] = 1.0
    head = min(K, M - a)  # rows before the wrap
    _tree_update_range(tree, offsets, fanout, a * E, mass[:head * E])
    if head < K:
        _tree_update_range(tree, offsets, fanout, 0, mass[head * E:])
    return change


tree_update = _first_call("tree_update")
tree_update_range = _first_call("tree_update_range")
tree_sample = _first_call("tree_sample")
tree_sample_masses = _first_call("tree_sample_masses")
importance_weights = _first_call("importance_weights")
priority_write = _first_call("priority_write")
priority_masses = _first_call("priority_masses")
masses = _first_call("masses")
priority_update = _first_call("priority_update")
ring_write = _first_call("ring_write")
refresh_starts = _first_call("refresh_starts")
