"""The prioritized replay's ops (Triton kernel in ``kernels/priorities.py``): the checked priority write, the
sampling masses of priorities and the importance weights of drawn masses.

A priority write of starts ``idx`` (K,) int64 and TD errors ``td`` (K,) sets ``priority[idx] = float32(|td|) +
eps`` (duplicates keep their largest) only when every check passes: each index in ``[0, size)`` (else
:data:`BAD_INDEX`), each new priority finite in float32 (else :data:`NOT_FINITE`), and, both passing, the largest
below ``limit`` (:func:`mass_limit`: the largest priority whose ``**alpha`` mass over every start stays finite in
float64; else :data:`OVERFLOW`). It then sets the masses of the written starts in every kept tree (``priority **
alpha`` where the start is valid, else 0: :func:`masses_twin`) and raises the running maximum ``box`` (1,). A
failed write leaves every priority as it was (the trees get their unchanged masses back), so the op never reads
the device: ``result`` (2,) float64 receives the code (the failed checks' bits, 0 when written) and the largest
finite new priority. :func:`priority_error` is the one message table of a code.

The importance weights are torch ops (or a host loop), not a registered op: ``torch.compile`` traces their twin.
"""

import functools
import math
from collections.abc import Callable

import numpy as np
import torch

from gpubuf._core.signals import signals_held
from gpubuf.kernels import BAD_INDEX, NOT_FINITE, OVERFLOW
from gpubuf.ops import host_loops
from gpubuf.ops.prefix_tree import offsets_array, update_twin
from gpubuf.ops.registry import Op

_LOG_MAX = math.log(torch.finfo(torch.float64).max)


def mass_limit(alpha: float, size: int) -> float:
    """The largest priority whose mass ``priority ** alpha`` summed over ``size`` starts stays finite in float64
    (``inf`` for ``alpha == 0``): a new priority at or above it overflows."""
    return math.inf if alpha == 0 else math.exp(min((_LOG_MAX - math.log(size)) / alpha, 700.0))


def overflow_error(name: str, top: float, alpha: float, size: int) -> ValueError:
    """The error naming ``name`` for a priority ``top`` whose mass overflows."""
    return ValueError(f"{name}: priority {top:g} ** alpha {alpha:g} over {size} starts overflows float64 sampling "
                      "mass; lower alpha or scale the TD errors")


def priority_error(code: int, size: int, idx, td: torch.Tensor | None, eps: float, top: float,
                   alpha: float) -> Exception:
    """The error a checked update raises for a nonzero ``code`` of a write of ``td`` at ``idx`` (a tensor, or a host
    array of any integer dtype): ``IndexError`` naming ``indices`` (the values outside ``[0, size)``), else
    ``ValueError`` naming ``td_errors`` (the values whose ``|td| + eps`` is not finite), else the overflow of
    ``top``."""
    if code & BAD_INDEX:
        return IndexError(f"indices: expected flat start indices in [0, {size}), got "
                          f"{idx[(idx < 0) | (idx >= size)][:5].tolist()}")
    if code & NOT_FINITE:
        bad = td[~torch.isfinite(td.to(torch.float32).abs().add_(eps))]
        return ValueError(f"td_errors: |td| + eps must be finite (float32), got {bad[:5].tolist()}")
    return overflow_error("td_errors, alpha", top, alpha, size)


def masses_twin(priority: torch.Tensor, valid: torch.Tensor, alpha: float, all_valid: bool = False) -> torch.Tensor:
    """(n,) float64 sampling masses of priorities ``priority`` (n,) float32: ``priority ** alpha`` where ``valid``
    (n,) bool, else 0 (``all_valid``: every one valid)."""
    mass = priority.to(torch.float64).pow_(alpha)
    return mass if all_valid else mass.mul_(valid)


def masses_host(priority: torch.Tensor, valid: torch.Tensor, alpha: float, all_valid: bool = False) -> torch.Tensor:
    """:func:`masses_twin` of host tensors in one compiled loop."""
    out = np.empty(priority.shape[0])
    host_loops.masses(priority.numpy(), valid.numpy(), alpha, out)
    return torch.from_numpy(out)


def checks_twin(idx: torch.Tensor, td: torch.Tensor, eps: float, limit: float,
                size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(new priorities (K,) float32, code () int32, largest finite new priority () float32)`` of a write of
    ``td`` (K,) at ``idx`` (K,), K >= 1, where they are: the checks of the module docstring."""
    new = td.to(torch.float32).abs().add_(eps)
    finite = torch.isfinite(new)
    top = torch.where(finite, new, 0.0).amax()
    code = ((idx < 0) | (idx >= size)).any().to(torch.int32) * BAD_INDEX + (~finite.all()).to(torch.int32) * NOT_FINITE
    return new, torch.where((code == 0) & (top.double() >= limit), OVERFLOW, code), top


def write_twin(priority, trees, valids, offsets, fanout, idx, td, eps, alpha, limit, box, result) -> None:
    """The checked priority write (see the module docstring) in torch ops, with no device read."""
    if idx.shape[0] == 0:
        result.zero_()
        return
    size = priority.shape[0]
    new, code, top = checks_twin(idx, td, eps, limit, size)
    ok = code == 0
    safe = idx.clamp(0, size - 1)
    priority.scatter_reduce_(0, safe, torch.where(ok, new, priority.index_select(0, safe)), "amax", include_self=False)
    written = priority.index_select(0, safe)
    for tree, valid in zip(trees, valids, strict=True):
        update_twin(tree, offsets, fanout, safe, masses_twin(written, valid.index_select(0, safe), alpha))
    box.copy_(torch.maximum(box, torch.where(ok, top, 0.0).to(box.dtype)))
    result.copy_(torch.stack([code.to(torch.float64), top.to(torch.float64)]))


def write_host_checked(priority, trees, valids, offsets, fanout, idx, td, eps, alpha, limit, box, result) -> None:
    """The CPU implementation without the compiled loops: the checks read on the host (no device there), then the
    writes only when they pass, with signals held (the twin's branch-free form writes every call)."""
    if idx.shape[0] == 0:
        result.zero_()
        return
    size = priority.shape[0]
    new = td.to(torch.float32).abs().add_(eps)
    top = float(new.max())  # NaN or inf here iff anywhere
    finite = math.isfinite(top)
    if not finite:  # the largest finite one, for the message
        top = float(torch.where(torch.isfinite(new), new, 0.0).max())
    low, high = torch.aminmax(idx)
    code = (BAD_INDEX if int(low) < 0 or int(high) >= size else 0) | (0 if finite else NOT_FINITE)
    if not code and top >= limit:
        code = OVERFLOW
    result.numpy()[:] = code, top
    if code:
        return
    with signals_held():  # priorities, trees and the maximum: all written or none
        priority.scatter_reduce_(0, idx, new, "amax", include_self=False)
        written = priority.index_select(0, idx)
        for tree, valid in zip(trees, valids, strict=True):
            update_twin(tree, offsets, fanout, idx, masses_twin(written, valid.index_select(0, idx), alpha))
        held = box.numpy()
        held[0] = max(held[0], top)


def write_host(priority, trees, valids, offsets, fanout, idx, td, eps, alpha, limit, box, result) -> None:
    """The CPU implementation: the compiled host loops when enabled (one call with one tree), else
    :func:`write_host_checked`. ``idx`` int64 and ``td`` float32 or float64 (else converted), both contiguous."""
    if not host_loops.ENABLED:
        write_host_checked(priority, trees, valids, offsets, fanout, idx, td, eps, alpha, limit, box, result)
        return
    td = td if td.dtype in (torch.float32, torch.float64) else td.to(torch.float32)
    p, i, t, e, r, b = priority.numpy(), idx.numpy(), td.numpy(), np.float32(eps), result.numpy(), box.numpy()
    off = offsets_array(offsets)
    if len(trees) == 1:
        host_loops.priority_update(p, i, t, e, limit, alpha, valids[0].numpy(), trees[0].numpy(), off, fanout, b, r)
        return
    with signals_held():  # priorities, trees and the maximum: all written or none
        code, top = host_loops.priority_write(p, i, t, e, limit)
        r[0], r[1] = code, top
        if code == 0:
            mass = np.empty(i.shape[0])
            for tree, valid in zip(trees, valids, strict=True):
                host_loops.priority_masses(p, i, valid.numpy(), alpha, mass)
                host_loops.tree_update(tree.numpy(), off, fanout, i, mass)
            b[0] = max(b[0], top)


def host_writer(priority, trees, valids, offsets, fanout, box, result) -> Callable:
    """``write(idx, td, eps, alpha, limit)``: :func:`write_host` into these persistent host tensors, their arrays
    made at the first call (eager: it may be built while traced), so that a steady update converts only its inputs."""
    if len(trees) != 1:
        return functools.partial(write_into, write_host, priority, trees, valids, offsets, fanout, box, result)
    held = []  # (priority, valid, tree, offsets, fanout, box, result) as arrays

    def write(idx, td, eps, alpha, limit):
        if not held:
            held.extend((priority.numpy(), valids[0].numpy(), trees[0].numpy(), offsets_array(offsets), fanout,
                         box.numpy(), result.numpy()))
        p, *arrays = held
        td = td if td.dtype in (torch.float32, torch.float64) else td.to(torch.float32)
        host_loops.priority_update(p, idx.numpy(), td.numpy(), np.float32(eps), limit, alpha, *arrays)

    return write


def write_into(write, priority, trees, valids, offsets, fanout, box, result, idx, td, eps, alpha, limit) -> None:
    """``write`` (a priority write in the op's schema order) with the persistent tensors first."""
    write(priority, trees, valids, offsets, fanout, idx, td, eps, alpha, limit, box, result)


def write_cuda(priority, trees, valids, offsets, fanout, idx, td, eps, alpha, limit, box, result) -> None:
    """The CUDA implementation: the Triton write, then the kept trees' masses (torch ops) and the Triton tree update."""
    from gpubuf.kernels import prefix_tree, priorities

    priorities.write(priority, idx, td, eps, limit, box, result)
    safe = idx.clamp(0, priority.shape[0] - 1)
    written = priority.index_select(0, safe)
    for tree, valid in zip(trees, valids, strict=True):
        prefix_tree.update(tree, offsets, fanout, safe, masses_twin(written, valid.index_select(0, safe), alpha))


WRITE = Op("priority_write", "(Tensor(a!) priority, Tensor(b!)[] trees, Tensor[] valids, int[] offsets, int fanout, "
           "Tensor idx, Tensor td, float eps, float alpha, float limit, Tensor(c!) box, Tensor(d!) result) -> ()",
           write_twin, write_cuda, write_host, host_loop=True)


def weights_twin(mass: torch.Tensor, beta, out: torch.Tensor | None = None, work: tuple | None = None) -> torch.Tensor:
    """``(mass / min of each minibatch) ** -beta`` as float32 of drawn masses ``mass`` (B,) or (K, B) float64 (a
    minibatch: a row); ``beta`` a float or a 0-d float64 tensor (read when this runs: a captured graph reads it at
    replay). Returns ``out`` (float32, ``mass``'s shape) when given, else a fresh tensor. ``work``: ``(minimum (K,
    1) or (1,), negated beta ())`` float64 tensors, so that an eager call allocates nothing (``mass`` is then
    overwritten); a traced call computes out of place whatever is given."""
    if work is not None and not torch.compiler.is_compiling():
        low, neg = work
        torch.amin(mass, -1, keepdim=True, out=low)
        if isinstance(beta, torch.Tensor):
            beta = torch.neg(beta, out=neg)
        else:
            beta = -beta
        return out.copy_(mass.div_(low).pow_(beta))
    neg = torch.neg(beta) if isinstance(beta, torch.Tensor) else -beta
    weights = (mass / mass.amin(-1, keepdim=True)).pow_(neg)
    return weights.to(torch.float32) if out is None else out.copy_(weights)


def weights_host(mass: torch.Tensor, beta, out: torch.Tensor | None = None, work: tuple | None = None) -> torch.Tensor:
    """:func:`weights_twin` of (B,) host masses, a float ``beta`` and no ``out`` by one compiled loop; else the twin."""
    if out is not None or mass.dim() != 1 or isinstance(beta, torch.Tensor) or not mass.numel():
        return weights_twin(mass, beta, out, work)
    out = torch.empty(mass.shape, dtype=torch.float32)
    host_loops.importance_weights(mass.contiguous().numpy(), beta, out.numpy())
    return out
