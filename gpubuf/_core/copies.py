"""Copies of a buffer (``copy.copy``, ``copy.deepcopy``, ``pickle``, ``torch.save``), made through its state.

A buffer's parts share memory (host views of its storage, cached gather plans, staging), and a field-by-field copy
splits them: such a copy writes into memory its reads never see. So a buffer is copied as a user would copy it by hand:
a new buffer built with the original's constructor arguments, then loaded with its ``state_dict()``. The copy is
independent (storage, generator and caches of its own) and complete (rows, counters, priorities, ``beta``, RNG state);
it is made under the original's lock, so another thread's call lands wholly before or after it. ``copy.copy`` gives such
an independent copy too (a shallow one would share storage with half of its bookkeeping). A pickle holds the state as
bytes (``torch.save`` of it, made under the lock), so any pickler carries it whole: ``multiprocessing`` (spawn and
forkserver arguments and queues, whose tensor pickling would otherwise share memory that a temporary owns), Ray,
``torch.save``. Making one takes the buffer's size in host memory; ``torch.load`` of a pickled buffer needs
``weights_only=False``, as for any object.

What cannot be copied this way refuses with ``TypeError`` naming what to use instead: a buffer on a ``storage_dir`` (one
buffer at a time holds its directory), and objects bound to a live env, process group or captured graph."""

import io

import torch


def rebuild(cls, blob: bytes):
    """The buffer a pickle holds: ``blob`` is ``torch.save`` of its constructor arguments and
    state; ``cls`` its class, or (pickles since 0.2.0) its class's name among the copied classes."""
    if isinstance(cls, str):
        cls = COPIED[cls]
    saved = torch.load(io.BytesIO(blob), weights_only=False)  # the library's own bytes
    buffer = cls(**saved["args"])
    buffer.load_state_dict(saved["state"])
    return buffer


# pickles name ``rebuild`` as ``gpubuf._rebuild_buffer`` and the class by its name: module moves break no pickle
rebuild.__module__, rebuild.__qualname__ = "gpubuf", "_rebuild_buffer"
COPIED: dict[str, type] = {}  # class name -> class, for every subclass of CopiedByState


class CopiedByState:
    """``__copy__`` / ``__deepcopy__`` / ``__reduce__`` through ``state_dict`` for a buffer with a ``lock``; subclasses
    say how they are built (:meth:`copy_args`) and why they may not be (:meth:`copy_refusal`)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__module__.startswith("gpubuf."):
            COPIED.setdefault(cls.__name__, cls)

    def copy_args(self) -> dict:  # hook: keyword arguments that build an empty twin of this buffer
        raise NotImplementedError

    def copy_refusal(self) -> str | None:  # hook: why this buffer cannot be copied, or None
        return None

    def _check_copyable(self) -> None:
        why = self.copy_refusal()
        if why is not None:
            raise TypeError(f"{type(self).__name__}: cannot be copied or pickled: {why}")

    def __copy__(self):
        return self.__deepcopy__({})

    def __deepcopy__(self, memo):
        with self.lock:
            self._check_copyable()
            twin = type(self)(**self.copy_args())
            twin.load_state_dict(self.state_dict())
        memo[id(self)] = twin
        return twin

    def __reduce__(self):
        with self.lock:
            self._check_copyable()
            blob = io.BytesIO()
            torch.save({"args": self.copy_args(), "state": self.state_dict()}, blob)
        cls = type(self)
        return rebuild, (cls.__name__ if COPIED.get(cls.__name__) is cls else cls, blob.getvalue())


def refuse_copies(why: str):
    """A class decorator: ``__copy__``/``__deepcopy__``/``__reduce_ex__`` raise ``TypeError`` saying
    ``why`` (an object bound to something a copy cannot take along)."""

    def refuse(self, *args):
        raise TypeError(f"{type(self).__name__}: cannot be copied or pickled: {why}")

    def decorate(cls):
        cls.__copy__ = cls.__deepcopy__ = cls.__reduce_ex__ = refuse
        return cls

    return decorate
