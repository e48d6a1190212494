"""Sampling with frame stacks and n-step returns built from the single frames a replay buffer stores.

:class:`StackSpec` holds a sample call's ``frame_stack``, ``frame_stride`` and ``n_step_return``, checked against the
buffer; :class:`StackedGather` gathers one batch for sampled flat starts: observation leaves as stacks, the other leaves
as plain windows, and with ``n_step_return`` the return, its discount and the bootstrap observation (the rules:
:mod:`gpubuf.ops.stacks`), into the outputs a :class:`~gpubuf.replay.sampling.plan.SamplePlan` gives it.
"""

import dataclasses
import math

import numpy as np
import torch

from gpubuf import ops
from gpubuf._core.transition import Transition, unflatten

RETURN_FIELDS = ("reward", "terminated", "truncated")  # replaced by the n-step transition's
# why a vectorized_env=False buffer has no stacks or returns, and the buffer that has them
SINGLE_TRANSITIONS = (": a vectorized_env=False buffer holds single transitions with their own next_observation, "
                      "not each env's rows in order. For n-step returns or frame stacks build a vectorized buffer "
                      "from the source's transition_sample() (in a same-step autoreset mode its truncated episodes' "
                      "last transitions have no next observation; a next-step env loses nothing), or keep this one for "
                      "1-step targets, each with its true next observation (docs/replay.md, 'Same-step envs: which "
                      "buffer')")
# (1,) float64 tensors of the discounts asked for, per (gamma, device): 8 at most, so an annealed
# gamma keeps none of its past values (a GraphSampler keeps its own)
_GAMMAS = ops.LRU(8)


def gamma_tensor(gamma: float, device: torch.device) -> torch.Tensor:
    """``(1,)`` float64 tensor of ``gamma`` on ``device`` (cached: :data:`_GAMMAS`)."""
    return _GAMMAS.get((gamma, device), lambda: torch.tensor([gamma], dtype=torch.float64, device=device))


@dataclasses.dataclass(frozen=True)
class StackSpec:
    """A checked request: ``k`` frames per stack (``None``: no stacks) at ``stride`` rows apart;
    returns of at most ``n`` rewards (``None``: none) discounted by ``gamma``."""

    k: int | None
    stride: int
    n: int | None
    gamma: float

    @classmethod
    def build(cls, config, frame_stack, frame_stride, n_step_return) -> "StackSpec | None":
        """The spec of a sample call (``None`` when it asks for neither), or ``ValueError`` naming the argument."""
        if frame_stack is None:  # a stride means nothing without stacks, returns or not
            if isinstance(frame_stride, bool) or not isinstance(frame_stride, (int, np.integer)) or frame_stride != 1:
                raise ValueError("frame_stride: needs frame_stack, got "
                                 f"frame_stride={frame_stride!r} and frame_stack=None")
            if n_step_return is None:
                return None
        M = config.max_rows
        k = None if frame_stack is None else _int("frame_stack", frame_stack, 1, M)
        stride = _int("frame_stride", frame_stride, 1, M)
        if k is not None and (k - 1) * stride >= M:
            raise ValueError(f"frame_stack: a stack of {k} frames at stride {stride} spans "
                             f"{(k - 1) * stride + 1} rows; the buffer holds {M} rows per env")
        if not config.paths("observation"):
            raise ValueError("frame_stack/n_step_return: the buffer stores no observation")
        if config.stores_next_obs:
            raise ValueError("frame_stack/n_step_return: build next observations from the following rows; this buffer "
                             "stores next_observation (store each frame once, in observation)"
                             + ("" if config.vectorized_env else SINGLE_TRANSITIONS))
        n, gamma = None, 1.0
        if n_step_return is not None:
            if not isinstance(n_step_return, (tuple, list)) or len(n_step_return) != 2:
                raise ValueError(f"n_step_return: expected (n, gamma), got {n_step_return!r}")
            n = _int("n_step_return[0]", n_step_return[0], 1, M)
            gamma = n_step_return[1]
            if isinstance(gamma, bool) or not isinstance(gamma, (int, float, np.floating)) \
                    or not 0.0 <= float(gamma) <= 1.0 or math.isnan(float(gamma)):
                raise ValueError(f"n_step_return[1]: expected a discount gamma in [0, 1], got {gamma!r}")
            gamma = float(gamma)
            rewards = config.paths("reward")
            if len(rewards) != 1 or config.by_path[rewards[0]].shape != ():
                got = [(config.by_path[p].name, config.by_path[p].shape) for p in rewards]
                raise ValueError(f"n_step_return: needs one scalar reward per row, the buffer stores {got}")
            if config.by_path[rewards[0]].dtype in (torch.bool, torch.complex64, torch.complex128):
                raise ValueError("n_step_return: needs a real-valued reward, the buffer stores "
                                 f"{config.by_path[rewards[0]].dtype}")
            if not config.paths("terminated"):
                raise ValueError("n_step_return: needs a terminated leaf (returns stop at a "
                                 "termination, with discount 0); the buffer stores none")
            if config.n_steps != 1:
                raise ValueError(f"n_step_return: returns are per transition; this buffer samples windows of "
                                 f"n_steps={config.n_steps} rows (build it with n_steps=1)")
        return cls(k, stride, n, gamma)


def _int(name: str, value, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not lo <= value <= hi:
        raise ValueError(f"{name}: expected an int in [{lo}, {hi}], got {value!r}")
    return int(value)


class StackedGather:
    """The stacks and returns of ``B`` flat starts for ``spec``, a read stage of a
    :class:`~gpubuf.replay.sampling.plan.SamplePlan`: observation leaves as stacks, and with ``n_step_return`` the
    return, its discount and the bootstrap stacks, into the outputs it is given (:meth:`outputs`). :attr:`plain` lists
    the other leaves' jobs ``(output path, stored path, shift, shape)``, which the plan reads as plain windows."""

    def __init__(self, reader, spec: StackSpec, B: int, with_next_obs: bool):
        config, storage = reader.config, reader.storage
        self.config, self.storage, self.spec, self.B = config, storage, spec, B
        self.device, self.marks, self.table = reader.device, reader.marks(), storage.table
        self.pin = storage.device.type == "cpu" and self.device.type == "cuda"
        n, k = config.n_steps, spec.k
        lead = (B, n) if n > 1 else (B,)
        by_path = config.by_path
        self.plain, self.stacks, self.boots = [], [], []
        # next observations: the following rows' stacks, unless a return says where to bootstrap
        for d, s, shift, shape in config.jobs(B, with_next_obs and spec.n is None):
            if spec.n is not None and s[0] in RETURN_FIELDS:
                continue
            if s[0] == "observation" and k is not None:
                self.stacks.append((d, s, shift, lead + (k,) + by_path[s].shape))
            else:
                self.plain.append((d, s, shift, shape))
        if spec.n is not None:
            for s in config.paths("observation"):
                stack = () if k is None else (k,)
                self.boots.append((("next_observation",) + s[1:], s, 0, (B,) + stack + by_path[s].shape))
            (self.reward,) = config.paths("reward")
            rtype = torch.float64 if by_path[self.reward].dtype == torch.float64 else torch.float32
            self.return_types = (rtype, rtype, torch.int64, torch.bool, torch.bool)
            self.gamma = gamma_tensor(spec.gamma, storage.device)  # held: a captured graph reads it

    def outputs(self) -> dict:
        """Fresh outputs ``{path: tensor}`` on the storage's device (pinned for CUDA), returns' under ``"returns"``."""
        here, dtypes = self.storage.device, {leaf.path: leaf.dtype for leaf in self.config.leaves}
        out = {d: torch.empty(shape, dtype=dtypes[s], device=here, pin_memory=self.pin)
               for d, s, _, shape in self.stacks + self.boots}
        if self.spec.n is not None:
            out["returns"] = tuple(torch.empty(self.B, dtype=t, device=here, pin_memory=self.pin)
                                   for t in self.return_types)
        return out

    def tables(self, out: dict) -> dict:
        """The Triton copy tables of the stacks and bootstrap stacks of ``out``, uploaded once."""
        n, k = self.config.n_steps, self.spec.k or 1
        stack_tables = self.table.stack_tables
        return {"stacks": stack_tables(self._jobs(self.stacks, out), self.B, n, k, self.device),
                "boots": stack_tables(self._jobs(self.boots, out), self.B, 1, k, self.device)}

    def _jobs(self, jobs: list, out: dict) -> list:
        return [(self.storage.rows(s), out[d], shift) for d, s, shift, _ in jobs]

    def run(self, starts: torch.Tensor, out: dict, tables: dict | None = None) -> None:
        """Fill ``out`` (:meth:`outputs`) for flat ``starts`` (B,) int64 (``tables``: ``out``'s, launched instead)."""
        config, spec, storage, marks = self.config, self.spec, self.storage, self.marks
        n, k, E, M = config.n_steps, spec.k or 1, config.n_envs, config.max_rows
        local = starts.to(storage.device)  # host storage: the starts are read back once
        if tables is not None:
            self.table.frame_stack_fixed(tables["stacks"], local, marks.marks, marks.held, n, k, spec.stride, E, M)
        else:
            self.table.frame_stack(self._jobs(self.stacks, out), local, marks.marks, marks.held, n, k, spec.stride,
                                   E, M)
        if spec.n is None:
            return
        returns = out["returns"]
        reward = storage.rows(self.reward).view(-1)
        self.table.n_step_return(local, reward, marks.marks, marks.held, returns, self.gamma, spec.n, E, M)
        if tables is not None:
            self.table.frame_stack_fixed(tables["boots"], returns[2], marks.marks, marks.held, 1, k, spec.stride, E, M)
        else:
            self.table.frame_stack(self._jobs(self.boots, out), returns[2], marks.marks, marks.held, 1, k,
                                   spec.stride, E, M)

    def assemble(self, out: dict, plain: dict) -> Transition:
        """The batch of ``out`` (:meth:`outputs`) and the plain windows ``plain``, on the buffer's device."""
        result = dict(plain)
        for d, *_ in self.stacks + self.boots:
            result[d] = out[d].to(self.device, non_blocking=True)
        batch = unflatten(result)
        if self.spec.n is not None:
            ret, disc, _, term, cut = (t.to(self.device, non_blocking=True) for t in out["returns"])
            batch.reward, batch.discount, batch.terminated, batch.truncated = ret, disc, term, cut
        return batch
