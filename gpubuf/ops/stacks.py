"""Replay frame stacks and n-step returns from single stored frames (Triton kernels in
``kernels/stacks.py``).

Rows are flat ``step * E + env`` (time-major) or ``env * M + step`` (``env_major``: a
``storage_dir``'s files; the twins only). ``marks`` (M*E,) uint8 holds each time-major row's
``MARK_*`` bits; ``held`` (2,) int64 the oldest row held and the rows held.

A stack ending at row ``t`` of an env holds ``k`` frames, oldest first: frame ``q`` is row ``t -
min((k - 1 - q) * stride, back)``, ``back`` the rows before ``t`` that are held and in ``t``'s
episode (an episode starts after a row marked ``MARK_BOUNDARY``): at an episode start the stack is
padded with the episode's oldest frame held, never a frame of the previous episode or a row the
ring no longer holds.

An n-step return from start row ``r`` takes rewards ``r, r + 1, ...``: at most ``n``; never a row
marked ``MARK_STOP`` but the first (a truncation, or a row holding no transition: the return stops
before it and bootstraps from its observation) unless it is also marked ``MARK_TERM``, never a row
whose next row is not held; a ``MARK_TERM`` row is the last taken. With ``m`` rewards taken, the
bootstrap row is ``r + m`` and its factor ``gamma**m`` (0 after a termination).

The pure-torch twins (the tests' oracle and the torch backend on a GPU, with their launchers'
signatures), their numpy ports for host tensors (the CPU implementation: small index arithmetic
costs less in numpy), the ``torch.ops.gpubuf`` registrations and the functions the buffers call.
"""

import numpy as np
import torch

from gpubuf.kernels import MARK_BOUNDARY, MARK_STOP, MARK_TERM
from gpubuf.kernels.words import as_words
from gpubuf.ops.device import route, writes_only


def _rows(step, env, E: int, M: int, env_major: bool) -> torch.Tensor:
    return env * M + step if env_major else step * E + env


def stack_twin(jobs: list, starts: torch.Tensor, marks: torch.Tensor, held: torch.Tensor, n: int,
               k: int, stride: int, E: int, M: int, env_major: bool = False) -> None:
    """For each ``(storage (M*E, D), out (B, n, k, D), shift)`` in ``jobs``: the ``k``-frame stacks
    ending at rows ``(start // E + j + shift) % M``, j < n, of flat starts (B,). Frame rows are
    computed once per distinct shift."""
    B = starts.shape[0]
    if B == 0:
        return
    dev = starts.device
    env, step = (starts % E).view(B, 1, 1), (starts // E).view(B, 1, 1)
    reach = torch.arange(k - 1, -1, -1, device=dev) * stride  # (k,) rows back per frame
    rows = {}
    for storage, out, shift in jobs:
        if shift not in rows:
            t = (step + torch.arange(shift, n + shift, device=dev).view(1, n, 1)) % M  # (B, n, 1)
            back = torch.zeros_like(t)
            if (k - 1) * stride:
                i = torch.arange(1, (k - 1) * stride + 1, device=dev)  # (W,) rows back
                before = (t - i) % M  # (B, n, W)
                ok = (i <= (t - held[0]) % M) & (marks[before * E + env] & MARK_BOUNDARY == 0)
                back = ok.cumprod(2).sum(2, keepdim=True)  # (B, n, 1) first stop
            frame = (t - torch.minimum(reach, back)) % M  # (B, n, k)
            rows[shift] = _rows(frame, env, E, M, env_major).view(-1)
        src, dst = as_words(storage, out.view(B * n * k, storage.shape[1]))
        torch.index_select(src, 0, rows[shift], out=dst)


def return_twin(starts: torch.Tensor, reward: torch.Tensor, marks: torch.Tensor,
                held: torch.Tensor, outs: tuple, gamma: torch.Tensor, n: int, E: int, M: int,
                env_major: bool = False) -> None:
    """n-step returns of flat starts (B,) from ``reward`` (M*E,) into ``outs`` = (return, discount,
    bootstrap row (time-major), terminated, cut) (B,); ``gamma`` (1,) float64."""
    B = starts.shape[0]
    if B == 0:
        return
    ret, disc, boot, term, cut = outs
    dev = starts.device
    env, r = (starts % E).view(B, 1), (starts // E).view(B, 1)
    avail = held[1] - 1 - (r - held[0]) % M  # (B, 1) held rows after the start
    i = torch.arange(n, device=dev)
    step = (r + i) % M  # (B, n)
    mark = marks[step * E + env]
    ends = mark & MARK_TERM != 0
    stop = ((i >= 1) & (mark & MARK_STOP != 0) & ~ends) | (i >= avail)
    # reward i is taken when no stop at or before i and no termination before i
    blocked = stop.clone()
    blocked[:, 1:] |= ends[:, :-1]
    taken = (~blocked).cumprod(1).bool()
    factors = torch.cat([torch.ones(1, dtype=torch.float64, device=dev),
                         gamma.expand(n)]).cumprod(0)  # (n + 1,) gamma ** i
    rewards = reward.view(-1)[_rows(step, env, E, M, env_major)].to(torch.float64)
    ret.copy_(torch.where(taken, factors[:n] * rewards, 0.0).sum(1))
    m = taken.sum(1)
    ended = (taken & ends).any(1)
    disc.copy_(torch.where(ended, 0.0, factors[m]))
    boot.copy_((r.view(B) + m) % M * E + env.view(B))
    term.copy_(ended)
    cut.copy_(~ended & (m < n))


def stack_host(jobs: list, starts: torch.Tensor, marks: torch.Tensor, held: torch.Tensor, n: int,
               k: int, stride: int, E: int, M: int, env_major: bool = False) -> None:
    """:func:`stack_twin` for host tensors, its index arithmetic in numpy (a few microseconds less
    per op than torch on small arrays); the rows are gathered with ``torch.index_select``."""
    B = starts.shape[0]
    if B == 0:
        return
    s, mk = starts.numpy(), marks.numpy()
    oldest = int(held[0])
    env, step = (s % E).reshape(B, 1, 1), (s // E).reshape(B, 1, 1)
    reach = np.arange(k - 1, -1, -1) * stride  # (k,)
    rows = {}
    for storage, out, shift in jobs:
        if shift not in rows:
            t = (step + np.arange(shift, n + shift).reshape(1, n, 1)) % M  # (B, n, 1)
            back = np.zeros_like(t)
            if (k - 1) * stride:
                i = np.arange(1, (k - 1) * stride + 1)
                ok = i <= (t - oldest) % M
                ok &= (mk[(t - i) % M * E + env] & MARK_BOUNDARY) == 0
                back = np.cumprod(ok, 2).sum(2, keepdims=True)
            frame = (t - np.minimum(reach, back)) % M
            rows[shift] = torch.from_numpy(_rows(frame, env, E, M, env_major).reshape(-1))
        src, dst = as_words(storage, out.view(B * n * k, storage.shape[1]))
        torch.index_select(src, 0, rows[shift], out=dst)


def return_host(starts: torch.Tensor, reward: torch.Tensor, marks: torch.Tensor,
                held: torch.Tensor, outs: tuple, gamma: torch.Tensor, n: int, E: int, M: int,
                env_major: bool = False) -> None:
    """:func:`return_twin` for host tensors, in numpy (the outputs' memory written through numpy
    views)."""
    B = starts.shape[0]
    if B == 0:
        return
    ret, disc, boot, term, cut = (t.numpy() for t in outs)
    s, mk, g = starts.numpy(), marks.numpy(), float(gamma[0])
    oldest, count = int(held[0]), int(held[1])
    env, r = (s % E).reshape(B, 1), (s // E).reshape(B, 1)
    i = np.arange(n)
    step = (r + i) % M  # (B, n)
    mark = mk[step * E + env]
    ends = (mark & MARK_TERM) != 0
    blocked = (i >= count - 1 - (r - oldest) % M) | ((mark & MARK_STOP) != 0) & ~ends & (i >= 1)
    blocked[:, 1:] |= ends[:, :-1]
    taken = np.cumprod(~blocked, 1, dtype=bool)
    factors = np.cumprod(np.concatenate([[1.0], np.full(n, g)]))  # gamma ** i, i <= n
    rewards = reward.numpy().reshape(-1)[_rows(step, env, E, M, env_major)].astype(np.float64)
    ret[:] = np.where(taken, factors[:n] * rewards, 0.0).sum(1)
    m = taken.sum(1)
    ended = (taken & ends).any(1)
    disc[:] = np.where(ended, 0.0, factors[m])
    boot[:] = (r[:, 0] + m) % M * E + env[:, 0]
    term[:] = ended
    cut[:] = ~ended & (m < n)


def stack_cpu(storages: list, outs: list, shifts: list, starts, marks, held, n, k, stride, E,
              M) -> None:
    """The CPU implementation."""
    stack_host(list(zip(storages, outs, shifts, strict=True)), starts, marks, held, n, k, stride,
               E, M)


def stack_cuda(storages: list, outs: list, shifts: list, starts, marks, held, n, k, stride, E,
               M) -> None:
    """The CUDA implementation: the Triton launcher, imported when it first runs."""
    from gpubuf.kernels.stacks import stack

    stack(list(zip(storages, outs, shifts, strict=True)), starts, marks, held, n, k, stride, E, M)


def return_cpu(starts, reward, marks, held, ret, disc, boot, term, cut, gamma, n, E, M) -> None:
    """The CPU implementation."""
    return_host(starts, reward, marks, held, (ret, disc, boot, term, cut), gamma, n, E, M)


def return_cuda(starts, reward, marks, held, ret, disc, boot, term, cut, gamma, n, E, M) -> None:
    """The CUDA implementation: the Triton launcher, imported when it first runs."""
    from gpubuf.kernels.stacks import returns

    returns(starts, reward, marks, held, (ret, disc, boot, term.view(torch.uint8),
                                          cut.view(torch.uint8)), gamma, n, E, M)


torch.library.define("gpubuf::frame_stack",
                     "(Tensor[] storages, Tensor(a!)[] outs, int[] shifts, Tensor starts, "
                     "Tensor marks, Tensor held, int n, int k, int stride, int E, int M) -> ()")
torch.library.impl("gpubuf::frame_stack", "CPU", stack_cpu)
torch.library.impl("gpubuf::frame_stack", "CUDA", stack_cuda)
torch.library.register_fake("gpubuf::frame_stack", writes_only)
torch.library.define("gpubuf::n_step_return",
                     "(Tensor starts, Tensor reward, Tensor marks, Tensor held, Tensor(a!) ret, "
                     "Tensor(b!) disc, Tensor(c!) boot, Tensor(d!) term, Tensor(e!) cut, "
                     "Tensor gamma, int n, int E, int M) -> ()")
torch.library.impl("gpubuf::n_step_return", "CPU", return_cpu)
torch.library.impl("gpubuf::n_step_return", "CUDA", return_cuda)
torch.library.register_fake("gpubuf::n_step_return", writes_only)


def frame_stack(backend: str, jobs: list, starts: torch.Tensor, marks: torch.Tensor,
                held: torch.Tensor, n: int, k: int, stride: int, E: int, M: int,
                env_major: bool = False) -> None:
    """For each (storage (M*E, D), out (B, n, k, D), shift) in jobs: k-frame stacks at stride
    ``stride`` ending at the rows of the windows of flat starts (B,), shifted."""
    jobs = [(storage, out, int(shift)) for storage, out, shift in jobs]
    args = (int(n), int(k), int(stride), int(E), int(M))
    how = route(backend, starts.device) if not env_major else "torch"
    if how == "dispatch":
        torch.ops.gpubuf.frame_stack.default([j[0] for j in jobs], [j[1] for j in jobs],
                                             [j[2] for j in jobs], starts, marks, held, *args)
    elif how == "triton":
        from gpubuf.kernels.stacks import stack

        stack(jobs, starts, marks, held, *args)
    elif starts.device.type == "cpu":
        stack_host(jobs, starts, marks, held, *args, env_major=env_major)
    else:
        stack_twin(jobs, starts, marks, held, *args, env_major=env_major)


def n_step_return(backend: str, starts: torch.Tensor, reward: torch.Tensor, marks: torch.Tensor,
                  held: torch.Tensor, outs: tuple, gamma: torch.Tensor, n: int, E: int, M: int,
                  env_major: bool = False) -> None:
    """n-step returns of flat starts (B,) into ``outs`` = (return, discount (float), bootstrap row
    (int64, time-major), terminated, cut (bool)) (B,); ``reward`` (M*E,), ``gamma`` (1,)
    float64."""
    args = (int(n), int(E), int(M))
    how = route(backend, starts.device) if not env_major else "torch"
    if how == "dispatch":
        torch.ops.gpubuf.n_step_return.default(starts, reward, marks, held, *outs, gamma, *args)
    elif how == "triton":
        from gpubuf.kernels.stacks import returns

        ret, disc, boot, term, cut = outs
        returns(starts, reward, marks, held,
                (ret, disc, boot, term.view(torch.uint8), cut.view(torch.uint8)), gamma, *args)
    elif starts.device.type == "cpu":
        return_host(starts, reward, marks, held, outs, gamma, *args, env_major=env_major)
    else:
        return_twin(starts, reward, marks, held, outs, gamma, *args, env_major=env_major)


def stack_tables(jobs: list, B: int, n: int, k: int, device: torch.device) -> list:
    """The Triton stack gather's pointer tables for fixed ``(storage, out (B, n, k, D), shift)`` jobs,
    uploaded once (CUDA only): :func:`frame_stack_fixed` launches them, also inside a CUDA graph."""
    from gpubuf.kernels.stacks import plan

    return plan(jobs, B, n, k, device)


def frame_stack_fixed(tables: list, starts: torch.Tensor, marks: torch.Tensor, held: torch.Tensor,
                      n: int, k: int, stride: int, E: int, M: int) -> None:
    """:func:`frame_stack` into the outputs of :func:`stack_tables` for flat starts (B,) int64."""
    from gpubuf.kernels.stacks import stack_planned

    stack_planned(tables, starts, marks, held, n, k, stride, E, M)
