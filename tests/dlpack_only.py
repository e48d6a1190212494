"""An array that speaks only the DLPack protocol, as JAX or CuPy arrays do (wraps a numpy or torch array)."""


class DlpackOnly:
    def __init__(self, arr):
        self._arr = arr

    def __dlpack__(self, **kwargs):
        return self._arr.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._arr.__dlpack_device__()
