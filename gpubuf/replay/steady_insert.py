"""SteadyInsert: the steady-state path of a replay insert into host memory.

A training loop inserts rows of one layout every step, straight from its env's numpy outputs. Once
an insert of numpy arrays of the stored dtypes has passed the checked path, its signature (fields,
dict keys, dtypes, shapes) is kept; a later insert with the same signature skips what the signature
already settled (leaf order, shapes, value-preserving casts, staging) and its arrays are written by
numpy slice assignments, which cannot fail on arrays of the stored dtype and shape. Anything else
takes the checked path, and so does an array reaching the buffer's own memory (it is copied there)."""

import bisect

import numpy as np

from gpubuf._core.transition import FIELDS, Transition


def _signature(value):
    """A hashable signature of one field: ``(dtype, shape)`` of a numpy array, a tuple of ``(key,
    signature)`` for a dict, ``None`` for ``None``; ``False`` for anything else (never matches)."""
    if type(value) is np.ndarray:
        return value.dtype, value.shape
    if value is None:
        return None
    if type(value) is dict:
        sig = tuple((k, _signature(v)) for k, v in value.items())
        return False if any(s is False for _, s in sig) else sig
    return False


class SteadyInsert:
    """The last accepted insert signature of one buffer (host storage only)."""

    def __init__(self, config, storage):
        self.paths = [leaf.path for leaf in config.leaves]
        self.dtypes = {p: storage.host[p].dtype for p in storage.host}
        self.enabled = storage.device.type == "cpu" and len(self.dtypes) == len(self.paths)
        self.sig = None

    def learn(self, transition: Transition, given: dict) -> None:
        """Keep ``transition``'s signature once checked, if every leaf was a numpy array of the stored dtype."""
        if self.enabled and all(type(given[p]) is np.ndarray and given[p].dtype == self.dtypes[p] for p in self.paths):
            sig = tuple(_signature(getattr(transition, f)) for f in FIELDS)
            self.sig = None if False in sig else sig

    def match(self, transition, owned: tuple) -> dict | None:
        """``{path: numpy array}`` of an insert with the kept signature whose arrays do not reach
        ``owned`` memory (sorted byte ranges); ``None``: take the checked path."""
        if self.sig is None or type(transition) is not Transition:
            return None
        fields = transition.__dict__
        for f, want in zip(FIELDS, self.sig, strict=True):
            v = fields[f]
            if type(v) is np.ndarray:
                if want is None or want != (v.dtype, v.shape):
                    return None
            elif _signature(v) != want:
                return None
        arrays = {}
        for p in self.paths:
            a = fields[p[0]]
            for k in p[1:]:
                a = a[k]
            if not a.flags.c_contiguous or _may_reach(a, owned):
                return None
            arrays[p] = a
        return arrays


def _may_reach(a: np.ndarray, owned: tuple) -> bool:
    """Whether array ``a``'s memory may overlap ``owned`` (sorted byte ranges of the buffer's tensors): never when
    the array it views (or itself) allocated its own memory, which no tensor holds; else its bytes are compared."""
    root = a
    while type(root.base) is np.ndarray:
        root = root.base
    if root.flags.owndata:
        return False
    lo = a.__array_interface__["data"][0]
    i = bisect.bisect_left(owned, (lo + a.nbytes,)) - 1
    return i >= 0 and owned[i][1] > lo
