"""A tiny pure-Python model of the HistoryBuffer contract (README, docstrings): per-env lists, no tensors."""

import numpy as np


class HistoryModel:
    def __init__(self, n_envs, max_len, action_block=1, block_keys=()):
        self.max_len, self.ab, self.block_keys = max_len, action_block, tuple(block_keys)
        self.envs = [[] for _ in range(n_envs)]
        self.keys = None

    def append(self, info, env_ids=None):
        ids = range(len(self.envs)) if env_ids is None else [i % len(self.envs) for i in env_ids]
        if self.keys is None:
            self.keys = list(info)
        for j, e in enumerate(ids):
            self.envs[e].append({k: np.asarray(v)[j] for k, v in info.items()})
            del self.envs[e][: -self.max_len]

    def reset(self, env_ids=None):
        for e in range(len(self.envs)) if env_ids is None else env_ids:
            self.envs[e] = []

    def num_strided(self, env_ids=None):
        ids = range(len(self.envs)) if env_ids is None else env_ids
        return [(len(self.envs[e]) - 1) // self.ab + 1 if self.envs[e] else 0 for e in ids]

    def get(self, n, env_ids=None):
        ids = list(range(len(self.envs))) if env_ids is None else [i % len(self.envs) for i in env_ids]
        if n <= 0 or self.keys is None or any(not self.envs[e] for e in ids):
            return None
        out = {}
        for key in self.keys:
            if key in self.block_keys and n == 1:
                continue
            rows = [self._row(self.envs[e], key, n) for e in ids]
            out[key] = np.stack(rows) if rows else None
        return out

    def _row(self, entries, key, n):
        L, ab = len(entries), self.ab
        k = min(n, (L - 1) // ab + 1)
        pos = [L - 1 - (k - 1 - j) * ab for j in range(k)]
        if key in self.block_keys:
            D = np.asarray(entries[0][key]).size
            blocks = [np.zeros(ab * D, dtype=np.asarray(entries[0][key]).dtype)] * (n - k)
            for i in range(k - 1):
                block = [np.ravel(entries[p][key]) for p in range(pos[i] + 1, pos[i + 1] + 1)]
                blocks.append(np.concatenate(block))
            return np.nan_to_num(np.stack(blocks), nan=0.0)
        frames = [entries[pos[0]][key]] * (n - k) + [entries[p][key] for p in pos]
        if np.ndim(frames[0]) == 0:
            return np.array(frames)
        return np.concatenate(frames, axis=0)
