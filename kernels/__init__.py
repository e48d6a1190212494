"""Triton kernels and launchers (shipped as ``gpubuf.kernels``); the only place importing triton.

One module per kernel family (``history``, ``prefix_tree``, ``priorities``, ``sequence``,
``stacks``): its kernels, their launchers and ``variants()``, every (signature, constexprs) the
launchers compile (``signatures.py`` compiles them ahead of time). This package imports nothing from
``gpubuf``; this file and ``words.py`` import no Triton.

Copy kernels serve many keys (leaves) per launch: the launcher views each ``(source, destination)``
pair as rows of int words (:func:`gpubuf.kernels.words.as_words`), groups pairs by word type, and
uploads one int64 table per group (``source address, destination address, words per row, extra
ints...`` per pair); one launch per group reads its pair's row from the table with
``tl.program_id(1)``.

Triton launches on the current CUDA device, not its arguments': every launcher launches under
:func:`on_device` of its tensors (a buffer on ``cuda:1`` launches there, whatever is current).
"""

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from gpubuf.kernels.words import as_words

INDEX = ("i32", "i64")  # Triton passes a Python int as i32, or i64 from 2**31 on

# bits of a replay row's episode mark (one uint8 per flat row, ``stacks`` kernels): the row's
# transition terminated; a return stops before this row (truncated, or a row holding no
# transition); an episode ends after this row (a frame stack never reaches past it)
MARK_TERM, MARK_STOP, MARK_BOUNDARY = 1, 2, 4
# bits of a priority write's code (``priorities`` kernels): an index outside the priorities; a
# ``|td| + eps`` NaN or infinite in float32; the largest new priority's ``**alpha`` mass over every
# start would overflow float64
BAD_INDEX, NOT_FINITE, OVERFLOW = 1, 2, 4


def on_device(t: torch.Tensor):
    """Context making ``t``'s CUDA device current while kernels launch (``torch.cuda.device``); a
    no-op for host tensors (interpreted kernels)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def word_groups(pairs: list,
                extra: list | None = None) -> list[tuple[torch.Tensor, np.ndarray, int]]:
    """``(anchor, table, most words per row)`` per word type for contiguous 2-D ``(src, dst)``
    ``pairs``.

    ``anchor`` is the first pair's source word view (its pointer type names the group's word);
    ``table`` is ``(G, 3 + len(extra[i]))`` host int64: source and destination addresses, words per
    row, then the pair's ``extra`` ints. Pairs with zero-width rows are left out.
    """
    groups: dict[torch.dtype, list] = {}
    for i, (src, dst) in enumerate(pairs):
        if src.shape[1] == 0:
            continue
        s, d = as_words(src, dst)
        groups.setdefault(s.dtype, []).append((s, d, () if extra is None else extra[i]))
    out = []
    for members in groups.values():
        table = np.array([[s.data_ptr(), d.data_ptr(), s.shape[1], *x] for s, d, x in members],
                         dtype=np.int64)
        out.append((members[0][0], table, int(table[:, 2].max())))
    return out


def upload(table: np.ndarray, device: torch.device) -> torch.Tensor:
    """``table`` (host int64) on ``device``; on CUDA one non-blocking copy from pinned memory
    (torch's caching host allocator reuses the pinned block only once the copy that read it has
    run)."""
    t = torch.from_numpy(np.ascontiguousarray(table))
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


@dataclass(frozen=True)
class Variant:
    """One compilation unit: the kernel, its signature (name -> Triton type) and constexpr
    values."""

    name: str
    fn: object
    signature: dict
    constexprs: dict

    @property
    def label(self) -> str:
        types = ",".join(t for t in self.signature.values() if t != "constexpr")
        consts = ",".join(f"{k}={v}" for k, v in self.constexprs.items() if k != "BELOW_ONE")
        return f"{self.name}({types}; {consts})"


def signature(names: str, types: dict, default: str) -> dict:
    """Triton types of the space-separated argument ``names``: ``types[name]``, else ``default``
    (an index type)."""
    return {n: types.get(n, default) for n in names.split()}


def variant(name: str, fn, names: str, types: dict, index: str,
            consts: dict | None = None) -> Variant:
    """The :class:`Variant` of kernel ``fn``: the :func:`signature` of its arguments ``names``, then
    its ``consts`` (``tl.constexpr`` name -> value)."""
    consts = consts or {}
    return Variant(name, fn, {**signature(names, types, index),
                              **dict.fromkeys(consts, "constexpr")}, consts)
