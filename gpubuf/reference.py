"""Rows as int words for the buffers' word views (:func:`as_words`, defined beside the kernels that copy them).

The torch twins of the kernels live with their ops in :mod:`gpubuf.ops`.
"""

from gpubuf.kernels.words import as_words

__all__ = ["as_words"]
