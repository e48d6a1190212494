"""Shared index-valued builders and a pure-Python replay model for the tests (no tests here).

Every inserted row carries ``value = global_step * E + env`` in all float leaves, so a sampled window shows
which rows it read: the env is ``value % E`` and the global step ``value // E``.
"""

import numpy as np
import torch

from gpubuf import Transition


def make_transition(g0: int, T: int, E: int, trunc_steps=(), obs_dim: int = 2, vectorized: bool = True,
                    multi_agent: bool = False) -> Transition:
    """T rows for global steps g0..g0+T-1; truncated at the given global steps (all envs)."""
    g = torch.arange(g0, g0 + T, dtype=torch.float64).unsqueeze(1)
    v = (g * E + torch.arange(E)).to(torch.float32)  # (T, E)
    trunc = torch.zeros(T, E, dtype=torch.bool)
    for s in trunc_steps:
        if g0 <= s < g0 + T:
            trunc[s - g0] = True
    obs = v.unsqueeze(-1).repeat(1, 1, obs_dim)
    if multi_agent:
        obs = {"a0": obs, "a1": {"pos": v.unsqueeze(-1) + 0.5}}
    tr = Transition(observation=obs, action=v.clone(), reward=v.clone(), terminated=torch.zeros(T, E, dtype=torch.bool),
                    truncated=trunc, info={"step": v.to(torch.int64)})
    if not vectorized:
        assert E == 1
        tr = Transition(**{k: _squeeze(getattr(tr, k)) for k in ("observation", "action", "reward", "terminated",
                                                                  "truncated", "next_observation", "info")})
    return tr


def index_rows(T: int, E: int, start: int = 0, *, obs_dim: int = 2, by_env: bool = True, signed_obs: bool = False,
               term_every: int = 0, trunc_every: int = 0, int_action: bool = False, info: bool = False) -> Transition:
    """T time-major numpy rows ``(T, E, ...)`` for steps ``start..start+T-1``, valued by index.

    ``v = step * E + env`` (``by_env``) or ``v = step`` (float32, ``(T, E)``) in observation
    ``(T, E, obs_dim)`` (``[v, -v]`` with ``signed_obs``), action (int64 with ``int_action``) and reward;
    terminated on steps divisible by ``term_every`` (counted from ``start``), truncated where ``v`` is
    divisible by ``trunc_every``; ``info={"id": v}`` (int64) with ``info``."""
    step = np.arange(start, start + T)[:, None]
    v = (step * E + np.arange(E) if by_env else step.repeat(E, 1)).astype(np.float32)
    obs = np.stack([v, -v], -1) if signed_obs else np.broadcast_to(v[..., None], (T, E, obs_dim)).copy()
    term = np.zeros((T, E), bool)
    if term_every:
        term[::term_every] = True
    trunc = v % trunc_every == 0 if trunc_every else np.zeros((T, E), bool)
    return Transition(observation=obs, action=v.astype(np.int64) if int_action else v.copy(), reward=v.copy(),
                      terminated=term, truncated=trunc, info={"id": v.astype(np.int64)} if info else {})


def _squeeze(x):
    if x is None:
        return None
    if isinstance(x, dict):
        return {k: _squeeze(v) for k, v in x.items()}
    return x[:, 0]


class Model:
    """Pure-Python model of the contract: global rows, truncation flags, priorities per flat start."""

    def __init__(self, M: int, E: int, n: int):
        self.M, self.E, self.n = M, E, n
        self.total = 0  # rows ever inserted per env
        self.trunc: dict[int, bool] = {}
        self.prio: dict[int, float] = {}
        self.max_prio = 1.0

    def insert(self, T: int, trunc_steps=()):
        for g in range(self.total, self.total + T):
            self.trunc[g] = g in trunc_steps
            for e in range(self.E):
                self.prio[(g % self.M) * self.E + e] = self.max_prio
        self.total += T

    def valid_starts(self, with_next_obs: bool) -> set[int]:
        """Flat starts of valid windows (kind by with_next_obs)."""
        W = self.n + int(with_next_obs)
        count = min(self.total, self.M)
        out = set()
        for g in range(self.total - count, self.total - W + 1):
            if with_next_obs and any(self.trunc[g + j] for j in range(self.n)):
                continue
            for e in range(self.E):
                out.add((g % self.M) * self.E + e)
        return out

    def global_step(self, flat: int) -> int:
        """The live global step stored at the flat start's row."""
        row = flat // self.E
        count = min(self.total, self.M)
        for g in range(self.total - count, self.total):
            if g % self.M == row:
                return g
        raise AssertionError(f"row {row} not written")

    def update(self, idx, td, eps):
        best: dict[int, float] = {}
        for i, t in zip(idx, td, strict=True):
            p = abs(float(t)) + eps
            best[int(i)] = max(best.get(int(i), -1.0), p)
        for i, p in best.items():
            self.prio[i] = float(np.float32(p))
            self.max_prio = max(self.max_prio, float(np.float32(p)))


def check_windows(batch: Transition, idx, model: Model, with_next_obs: bool):
    """Each sampled window is contiguous, inside written rows, valid, and matches its flat start."""
    obs = batch.observation if not isinstance(batch.observation, dict) else batch.observation["a0"]
    v = obs[..., 0].cpu().double()
    if model.n == 1:
        v = v.unsqueeze(1)
    E = model.E
    env, g = (v % E).long(), (v // E).long()
    assert (env == env[:, :1]).all(), "a window mixes envs"
    assert (g == g[:, :1] + torch.arange(model.n)).all(), "a window is not contiguous"
    valid = model.valid_starts(with_next_obs)
    flat = ((g[:, 0] % model.M) * E + env[:, 0]).tolist()
    assert set(flat) <= valid, f"invalid starts {sorted(set(flat) - valid)}"
    if idx is not None:
        assert idx.cpu().tolist() == flat
    if with_next_obs:
        nxt = batch.next_observation if not isinstance(batch.next_observation, dict) else batch.next_observation["a0"]
        nv = nxt[..., 0].cpu().double()
        if model.n == 1:
            nv = nv.unsqueeze(1)
        assert torch.equal(nv, v + E), "next_observation is not the following row"


def assert_gets_equal(got: dict | None, expected: dict | None) -> None:
    """Two history ``get`` results are the same: both ``None``, or the same keys in the same order with
    equal values (NaN equal to NaN). ``expected`` may hold numpy arrays (a model's); where it holds
    tensors, dtypes and shapes must match too."""
    assert (got is None) == (expected is None)
    if got is None:
        return
    assert list(got) == list(expected)
    for key, want in expected.items():
        have = got[key].cpu()
        if isinstance(want, torch.Tensor):
            assert have.dtype == want.dtype and have.shape == want.shape, key
        want = torch.as_tensor(want).to(have.dtype)
        torch.testing.assert_close(have, want.cpu(), rtol=0, atol=0, equal_nan=True, msg=key)


def reference_return(reward, terminated, stop, r: int, e: int, held: int, n: int, gamma: float):
    """``(return, discount, rows used)`` of the n-step return from row ``r`` of env ``e``, by definition: rows whose
    successor is held (``< held - 1``), stopping before a ``stop`` row and after a ``terminated`` one (discount 0).
    ``reward``, ``terminated``, ``stop``: ``(rows, envs)`` arrays."""
    total, disc, m = 0.0, 1.0, 0
    for j in range(n):
        if r + j >= held - 1 or stop[r + j, e]:
            break
        total += disc * reward[r + j, e]
        disc, m = disc * gamma, m + 1
        if terminated[r + j, e]:
            return total, 0.0, m
    return total, disc, m
