"""Replay frame stacks and n-step returns from single stored frames (Triton kernels in ``kernels/stacks.py``).

Rows are flat ``step * E + env`` (time-major) or ``env * M + step`` (``env_major``: a
``storage_dir``'s files; the twins only). ``marks`` (M*E,) uint8 holds each time-major row's
``MARK_*`` bits; ``held`` (2,) int64 the oldest row held and the rows held.

A stack ending at row ``t`` of an env holds ``k`` frames, oldest first: frame ``q`` is row ``t - min((k - 1 - q) *
stride, back)``, ``back`` the rows before ``t`` that are held and in ``t``'s episode (an episode starts after a row
marked ``MARK_BOUNDARY``): at an episode start the stack is padded with the episode's oldest frame held, never a frame
of the previous episode or a row the ring no longer holds.

An n-step return from start row ``r`` takes rewards ``r, r + 1, ...``: at most ``n``; never a row
marked ``MARK_STOP`` but the first (a truncation, or a row holding no transition: the return stops
before it and bootstraps from its observation) unless it is also marked ``MARK_TERM``, never a row
whose next row is not held; a ``MARK_TERM`` row is the last taken. With ``m`` rewards taken, the
bootstrap row is ``r + m`` and its factor ``gamma**m`` (0 after a termination).

The twins' index arithmetic is :mod:`gpubuf.ops.indexing`'s, run in numpy for host tensors. Beside the ops: the fixed
pointer tables of the Triton stack gather.
"""

import functools

import numpy as np
import torch

from gpubuf.kernels.words import as_words
from gpubuf.ops import indexing
from gpubuf.ops.registry import Op, from_lists, kernel


def _index_args(starts: torch.Tensor, marks: torch.Tensor, held: torch.Tensor) -> tuple:
    """``(starts, marks, oldest row, rows held, arange)`` for :mod:`gpubuf.ops.indexing`: numpy arrays
    and ints for host tensors (small index arithmetic costs less in numpy), else the tensors."""
    if starts.device.type == "cpu":
        return starts.numpy(), marks.numpy(), int(held[0]), int(held[1]), np.arange
    return starts, marks, held[0], held[1], functools.partial(torch.arange, device=starts.device)


def stack_twin(jobs: list, starts: torch.Tensor, marks: torch.Tensor, held: torch.Tensor, n: int,
               k: int, stride: int, E: int, M: int, env_major: bool = False) -> None:
    """For each ``(storage (M*E, D), out (B, n, k, D), shift)`` in ``jobs``: the ``k``-frame stacks
    ending at rows ``(start // E + j + shift) % M``, j < n, of flat starts (B,). Frame rows are
    computed once per distinct shift (:func:`gpubuf.ops.indexing.stack_steps`)."""
    B = starts.shape[0]
    if B == 0:
        return
    s, mk, oldest, _, arange = _index_args(starts, marks, held)
    env, step = (s % E).reshape(B, 1, 1), (s // E).reshape(B, 1, 1)
    rows = {}
    for storage, out, shift in jobs:
        if shift not in rows:
            frame = indexing.stack_steps(step, env, mk, oldest, n, k, stride, shift, E, M, arange)
            rows[shift] = torch.as_tensor(indexing.flat_rows(frame, env, E, M, env_major).reshape(-1))
        src, dst = as_words(storage, out.view(B * n * k, storage.shape[1]))
        torch.index_select(src, 0, rows[shift], out=dst)


def return_twin(starts: torch.Tensor, reward: torch.Tensor, marks: torch.Tensor,
                held: torch.Tensor, outs: tuple, gamma: torch.Tensor, n: int, E: int, M: int,
                env_major: bool = False) -> None:
    """n-step returns of flat starts (B,) from ``reward`` (M*E,) into ``outs`` = (return, discount,
    bootstrap row (time-major), terminated, cut) (B,); ``gamma`` (1,) float64 (the rewards taken:
    :func:`gpubuf.ops.indexing.return_rewards`; host tensors in numpy, as the index arithmetic)."""
    B = starts.shape[0]
    if B == 0:
        return
    s, mk, oldest, count, arange = _index_args(starts, marks, held)
    env, r = (s % E).reshape(B, 1), (s // E).reshape(B, 1)
    step, taken, ends = indexing.return_rewards(r, env, mk, oldest, count, n, E, M, arange)
    rows = indexing.flat_rows(step, env, E, M, env_major)
    host = isinstance(s, np.ndarray)
    if host:  # written through numpy views of the outputs
        factors, where = np.cumprod(np.concatenate([[1.0], np.full(n, float(gamma[0]))])), np.where
        rewards = _host_rewards(reward, rows)
    else:  # gamma read where it lives: a captured graph reads it at replay
        factors = torch.cat([torch.ones(1, dtype=torch.float64, device=starts.device), gamma.expand(n)]).cumprod(0)
        where, rewards = torch.where, reward.view(-1)[rows].to(torch.float64)
    # factors (n + 1,) gamma ** i; m rewards taken
    m = taken.sum(1)
    ended = (taken & ends).any(1)
    values = (where(taken, factors[:n] * rewards, 0.0).sum(1), where(ended, 0.0, factors[m]),
              (r[:, 0] + m) % M * E + env[:, 0], ended, ~ended & (m < n))
    for out, value in zip(outs, values, strict=True):
        if host:
            out.numpy()[:] = value
        else:
            out.copy_(value)


def _host_rewards(reward: torch.Tensor, rows: np.ndarray) -> np.ndarray:
    """float64 ``reward`` (M*E,) (host) at flat ``rows`` (any shape); a dtype numpy lacks (bfloat16, float8) is read
    through torch at those rows only."""
    if reward.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        taken = reward.reshape(-1)[torch.from_numpy(rows.reshape(-1))]
        return taken.to(torch.float64).numpy().reshape(rows.shape)
    return reward.numpy().reshape(-1)[rows].astype(np.float64)


def return_cpu(starts, reward, marks, held, ret, disc, boot, term, cut, gamma, n, E, M) -> None:
    """The CPU implementation: the twin."""
    return_twin(starts, reward, marks, held, (ret, disc, boot, term, cut), gamma, n, E, M)


def return_cuda(starts, reward, marks, held, ret, disc, boot, term, cut, gamma, n, E, M) -> None:
    """The CUDA implementation: the Triton launcher, imported when it first runs."""
    from gpubuf.kernels.stacks import returns

    returns(starts, reward, marks, held, (ret, disc, boot, term.view(torch.uint8),
                                          cut.view(torch.uint8)), gamma, n, E, M)


def stack_launch(jobs: list, starts, marks, held, n, k, stride, E, M) -> None:
    """The Triton launcher for the twin's call form, imported when it first runs."""
    from gpubuf.kernels.stacks import stack

    stack(jobs, starts, marks, held, int(n), int(k), int(stride), int(E), int(M))


def stack_traced(jobs: list, starts, marks, held, n, k, stride, E, M) -> None:
    """The twin's call form through the dispatcher (``torch.compile`` traces the op)."""
    STACK.dispatch([j[0] for j in jobs], [j[1] for j in jobs], [int(j[2]) for j in jobs], starts, marks, held,
                   int(n), int(k), int(stride), int(E), int(M))


def return_launch(starts, reward, marks, held, outs, gamma, n, E, M) -> None:
    """The Triton launcher for the twin's call form, imported when it first runs."""
    from gpubuf.kernels.stacks import returns

    ret, disc, boot, term, cut = outs
    returns(starts, reward, marks, held, (ret, disc, boot, term.view(torch.uint8), cut.view(torch.uint8)), gamma,
            int(n), int(E), int(M))


def return_traced(starts, reward, marks, held, outs, gamma, n, E, M) -> None:
    """The twin's call form through the dispatcher (``torch.compile`` traces the op)."""
    RETURN.dispatch(starts, reward, marks, held, *outs, gamma, int(n), int(E), int(M))


stack_cpu = from_lists(stack_twin)  # the CPU implementation: the twin
stack_cuda = from_lists(kernel("stacks", "stack"))  # the CUDA implementation: the launcher

# the buffers call them with job lists and output tuples (the twins' form), which go straight to the twin or
# launcher; env-major rows (a storage_dir's files) run the twins only
STACK = Op("frame_stack", "(Tensor[] storages, Tensor(a!)[] outs, int[] shifts, Tensor starts, "
           "Tensor marks, Tensor held, int n, int k, int stride, int E, int M) -> ()",
           stack_cpu, stack_cuda, calls=(stack_twin, stack_twin, stack_launch, stack_traced))
RETURN = Op("n_step_return", "(Tensor starts, Tensor reward, Tensor marks, Tensor held, "
            "Tensor(a!) ret, Tensor(b!) disc, Tensor(c!) boot, Tensor(d!) term, Tensor(e!) cut, "
            "Tensor gamma, int n, int E, int M) -> ()", return_cpu, return_cuda,
            calls=(return_twin, return_twin, return_launch, return_traced))


def stack_tables(jobs: list, B: int, n: int, k: int, device: torch.device) -> list:
    """The Triton stack gather's pointer tables for fixed ``(storage, out (B, n, k, D), shift)`` jobs,
    uploaded once (where Triton runs): :func:`frame_stack_fixed` launches them, also inside a CUDA graph."""
    from gpubuf.kernels.stacks import tables

    return tables(jobs, B, n, k, device)


def frame_stack_fixed(tables: list, starts: torch.Tensor, marks: torch.Tensor, held: torch.Tensor,
                      n: int, k: int, stride: int, E: int, M: int) -> None:
    """The stacks of :func:`stack_twin` into the outputs of :func:`stack_tables` for flat starts (B,) int64."""
    from gpubuf.kernels.stacks import stack_from_tables

    stack_from_tables(tables, starts, marks, held, n, k, stride, E, M)
