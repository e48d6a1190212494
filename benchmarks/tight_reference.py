"""The floor of each call in ``bench_overhead.py``: the same steady-state work in the fewest torch ops,
with no checks.

Same layouts as gpubuf (slot-major ``(max_len * E, D)`` history storage per key; time-major
``(M, E, ...)`` replay storage per leaf, flat start ``row * E + env``), same dtypes, leaves and
outputs. History row indices are cached per ring slot, as gpubuf's lockstep plans are. The replay
reference covers the benchmark's steady state: one row per env per insert, windows of one row with
the next observation. Uniform sampling draws from the ring range of valid starts (gpubuf's draw
while no truncation is stored), so its insert keeps no mask; prioritized sampling keeps a validity
mask and a two-level sum tree (leaf masses ``priority**alpha`` times validity, float64, and the sums
of each group of ``fanout`` leaves: the two lowest levels of gpubuf's wide tree; the sums are
recomputed whole, one op, cheaper at this size than finding the touched groups).
"""

import numpy as np
import torch


class History:
    """HistoryBuffer's lockstep append and ``get(n)``: every env steps together and has lived at
    least ``(n - 1) * action_block + 1`` steps."""

    def __init__(self, n_envs: int, max_len: int, entries: dict, action_block: int = 1,
                 block_keys=()):
        """``entries``: ``{key: (entry shape, dtype)}``."""
        self.E, self.max_len, self.ab, self.head = n_envs, max_len, action_block, 0
        self.entries, self.block_keys = entries, set(block_keys)
        self.data = {k: torch.zeros(max_len * n_envs, int(np.prod(s)), dtype=dt)
                     for k, (s, dt) in entries.items()}
        # per key, the (E, *entry) view of each slot
        self.slots = {k: list(self.data[k].view(max_len, n_envs, *entries[k][0]).unbind(0))
                      for k in entries}
        self.rows: dict[tuple, tuple] = {}

    def append(self, info: dict) -> None:
        """One entry per env: ``info[key]`` a numpy array ``(E, *entry)``."""
        h = self.head
        for k, v in info.items():
            self.slots[k][h].copy_(torch.from_numpy(v))
        self.head = (h + 1) % self.max_len

    def _indices(self, n: int) -> tuple:
        """(frame rows (E*n,), block rows (E*(n-1)*ab,)) of the current head."""
        got = self.rows.get((n, self.head))
        if got is None:
            E, ab, ml = self.E, self.ab, self.max_len
            newest, envs = (self.head - 1) % ml, np.arange(E).reshape(E, 1)
            frames = np.arange(n - 1, -1, -1) * ab
            blocks = (np.arange(n - 2, -1, -1).reshape(-1, 1) * ab + np.arange(ab - 1, -1, -1)).ravel()
            got = tuple(torch.from_numpy(((newest - back) % ml * E + envs).ravel()) for back in (frames, blocks))
            self.rows[(n, self.head)] = got
        return got

    def get(self, n: int, out: dict | None = None) -> dict:
        """The last ``n`` frames per env (block keys: the ``n - 1`` action blocks, NaN zeroed), into
        ``out`` when given."""
        frames, blocks = self._indices(n)
        result = {}
        for k, src in self.data.items():
            shape, _ = self.entries[k]
            block = k in self.block_keys
            if out is not None:
                o = out[k]
            elif block:
                o = torch.empty(self.E, n - 1, self.ab * src.shape[1], dtype=src.dtype)
            else:
                o = torch.empty(self.E, n * shape[0], *shape[1:], dtype=src.dtype)
            torch.index_select(src, 0, blocks if block else frames, out=o.view(-1, src.shape[1]))
            if block:
                torch.nan_to_num(o, nan=0.0, out=o)
            result[k] = o
        return result


class Replay:
    """TransitionBuffer's (``prioritized``: PrioritizedTransitionBuffer's) insert of one row per env,
    ``sample`` with the next observation (with or without replacement) and ``update_priorities``."""

    def __init__(self, max_rows: int, n_envs: int, leaves: dict, prioritized: bool = False,
                 alpha: float = 0.6, beta: float = 0.4, eps: float = 1e-6, fanout: int = 32,
                 seed: int = 0):
        """``leaves``: ``{name: (per-env shape, dtype)}``, ``observation`` and ``truncated``
        among them."""
        M, E = max_rows, n_envs
        self.M, self.E, self.L, self.pos, self.count = M, E, M * E, 0, 0
        self.data = {k: torch.zeros((M, E, *s), dtype=dt) for k, (s, dt) in leaves.items()}
        self.flat = {k: t.view(self.L, *t.shape[2:]) for k, t in self.data.items()}
        self.g = torch.Generator().manual_seed(seed)
        self.prioritized, self.alpha, self.beta, self.eps, self.F = prioritized, alpha, beta, eps, fanout
        if prioritized:
            nodes = -(-self.L // fanout)
            self.priority = torch.zeros(M, E)
            self.valid = torch.zeros(M, E, dtype=torch.bool)
            self.mass = torch.zeros(nodes * fanout, dtype=torch.float64)
            self.sums = torch.zeros(nodes, dtype=torch.float64)
            self.groups = self.mass.view(nodes, fanout)
            self.mass_rows = self.mass[:self.L].view(M, E)
            self.max_priority = 1.0

    def insert(self, rows: dict) -> None:
        """One row per env: ``rows[name]`` a numpy array ``(1, E, ...)``."""
        pos = self.pos
        for k, v in rows.items():
            self.data[k][pos:pos + 1].copy_(torch.from_numpy(v))
        if self.prioritized:  # row pos: max priority, no next row yet; row pos-1: valid unless truncated
            prev = (pos - 1) % self.M
            self.priority[pos].fill_(self.max_priority)
            self.valid[pos].fill_(False)
            self.mass_rows[pos].fill_(0.0)
            if self.count:
                torch.logical_not(self.data["truncated"][prev], out=self.valid[prev])
                torch.mul(self.priority[prev].double().pow_(self.alpha), self.valid[prev],
                          out=self.mass_rows[prev])
            torch.sum(self.groups, 1, out=self.sums)
        self.pos, self.count = (pos + 1) % self.M, min(self.count + 1, self.M)

    def _draw(self, u: torch.Tensor) -> torch.Tensor:
        """Leaves picked by uniforms ``u`` (B,) in proportion to their mass: the group by a search of
        the groups' prefix sums, then the leaf by a search of its group's."""
        cs = self.sums.cumsum(0)
        target = u.mul_(cs[-1])
        group = torch.searchsorted(cs, target, right=True).clamp_max_(cs.shape[0] - 1)
        target = target.sub_(cs.sub_(self.sums).index_select(0, group)).unsqueeze_(1)
        kids = self.groups.index_select(0, group).cumsum(1)  # (B, fanout) prefix sums
        j = torch.searchsorted(kids, target, right=True).clamp_max_(self.F - 1)
        return j.view(-1).add_(group, alpha=self.F)

    def _distinct(self, B: int) -> torch.Tensor:
        """``B`` distinct leaves: the first distinct ones of ``2 * B`` draws in order of appearance
        (sequential sampling without replacement when they are enough, as they are in this state)."""
        draws = self._draw(torch.rand(2 * B, dtype=torch.float64, generator=self.g))
        uniq, inv = torch.unique(draws, return_inverse=True)
        first = torch.full_like(uniq, 2 * B).scatter_reduce_(0, inv, torch.arange(2 * B), "amin")
        return uniq[first.argsort()[:B]]

    def sample(self, B: int, with_replacement: bool = True) -> tuple[dict, torch.Tensor]:
        """``(batch, flat starts)``: every leaf and ``next_observation`` (B, ...), and
        ``PER_weights`` when prioritized."""
        if not self.prioritized:
            n = (self.count - 1) * self.E  # starts whose next row is held: one ring range
            base = (self.pos - self.count) % self.M * self.E
            idx = torch.randint(n, (B,), generator=self.g).add_(base).remainder_(self.L)
        elif with_replacement:
            idx = self._draw(torch.rand(B, dtype=torch.float64, generator=self.g))
        else:
            idx = self._distinct(B)
        batch = {k: t.index_select(0, idx) for k, t in self.flat.items()}
        batch["next_observation"] = self.flat["observation"].index_select(
            0, torch.add(idx, self.E).remainder_(self.L))
        if self.prioritized:
            m = self.mass.index_select(0, idx)
            batch["PER_weights"] = m.div_(m.min()).pow_(-self.beta).float()
        return batch, idx

    def update_priorities(self, idx: np.ndarray, td: np.ndarray) -> None:
        """Priorities ``|td| + eps`` (float32; duplicates keep their largest) of flat starts ``idx``
        (int64), then their masses and the group sums."""
        i = torch.from_numpy(idx)
        p = torch.from_numpy(td).abs().add_(self.eps)
        prio = self.priority.view(-1)
        prio.scatter_reduce_(0, i, p, "amax", include_self=False)
        self.max_priority = max(self.max_priority, float(p.max()))
        mass = prio.index_select(0, i).double().pow_(self.alpha).mul_(self.valid.view(-1).index_select(0, i))
        self.mass.index_copy_(0, i, mass)
        torch.sum(self.groups, 1, out=self.sums)
