"""HistoryBuffer ``append`` and ``get(3)`` vs a per-env deque baseline vs the copy floor.

Per step and env: pixels (1, 64, 64, 3) uint8 and action (1, 2) float32; action_block 5, max_len 11."""

import collections
import itertools

import numpy as np
import torch

from gpubuf.apps.benchmarking.peers import Peers
from gpubuf.apps.benchmarking.timing import median_us, syncer
from gpubuf.history.buffer import HistoryBuffer

N, AB, MAX_LEN = 3, 5, 11
PIX, ACT = (1, 64, 64, 3), (1, 2)


class DequeHistory:
    """stable-worldmodel's HistoryBuffer semantics: a Python deque of per-env slices (views) per env."""

    def __init__(self, n_envs: int, max_len: int, action_block: int, block_keys):
        self.n_envs, self.ab, self.block_keys = n_envs, action_block, tuple(block_keys)
        self.buffers = [collections.deque(maxlen=max_len) for _ in range(n_envs)]

    def append(self, info: dict):
        """info: key -> (n_envs, 1, ...) array."""
        for i in range(self.n_envs):
            self.buffers[i].append({k: v[i] for k, v in info.items()})

    def get(self, n: int) -> dict:
        """Frame keys -> (n_envs, n, ...); block keys -> (n_envs, n - 1, action_block * size)."""
        out = {k: [] for k in self.buffers[0][0]}
        for buf in self.buffers:
            entries = list(buf)
            idx = list(range(len(entries) - 1, -1, -self.ab))[:n][::-1]
            k = len(idx)
            for key in out:
                if key in self.block_keys:
                    if n == 1:
                        continue
                    blocks = [np.zeros(self.ab * entries[0][key].size, entries[0][key].dtype)] * (n - k)
                    for a, b in zip(idx[:-1], idx[1:], strict=True):
                        blocks.append(np.concatenate([entries[p][key].ravel() for p in range(a + 1, b + 1)]))
                    out[key].append(np.nan_to_num(np.stack(blocks), nan=0.0))
                else:
                    frames = [entries[idx[0]][key]] * (n - k) + [entries[p][key] for p in idx]
                    out[key].append(np.concatenate(frames, axis=0))
        return {k: torch.from_numpy(np.stack(v)) for k, v in out.items() if v}


def slot_ring_copy(src: torch.Tensor, slots: int):
    """The copy floor of an append: ``src`` copied into the next of ``slots`` blocks of its size, as a history writes
    the next slot of its ring. Every call lands in memory the last ``slots - 1`` calls did not touch, like the
    buffer's own writes: a copy into one destination stays in the CPU's cache at these sizes and is no floor of a
    ring's write."""
    ring = torch.zeros(slots, *src.shape, dtype=src.dtype, device=src.device)  # allocated as the storage is
    turn = itertools.count()
    return lambda: ring[next(turn) % slots].copy_(src)


def run(n_envs: int, device: torch.device, repeats: int, peers: Peers) -> list[dict]:
    """Rows for ops ``get(3)`` (gpubuf, gpubuf with ``out=``, deque, floor) and ``append`` at ``n_envs``."""
    rng = np.random.default_rng(0)
    info = {"pixels": rng.integers(0, 255, (n_envs, *PIX), dtype=np.uint8),
            "action": rng.standard_normal((n_envs, *ACT)).astype(np.float32)}
    host_info = info
    if device.type == "cuda":  # a GPU simulator hands device tensors
        info = {k: torch.from_numpy(v).to(device) for k, v in info.items()}
    buf = HistoryBuffer(n_envs, MAX_LEN, AB, ("action",), device=device)
    for _ in range(MAX_LEN):
        buf.append(info)
    out = buf.get(N)
    nbytes = {"get": sum(t.numel() * t.element_size() for t in out.values()),
              "append": sum(v.nbytes for v in host_info.values())}
    floors = {op: [torch.empty(b, dtype=torch.uint8, device=device) for _ in range(2)] for op, b in nbytes.items()}
    cases = {"get": {"gpubuf": lambda: buf.get(N), "gpubuf (out=)": lambda: buf.get(N, out=out)},
             "append": {"gpubuf": lambda: buf.append(info)}}

    def make_deque():
        deque = DequeHistory(n_envs, MAX_LEN, AB, ("action",))
        for _ in range(MAX_LEN):
            deque.append(host_info)
        return deque

    deque = peers.build("deque", make_deque)
    if deque is not None:
        cases["get"]["deque"] = lambda: deque.get(N)
        cases["append"]["deque"] = lambda: deque.append(host_info)
    (get_src, get_dst), (app_src, app_dst) = floors["get"], floors["append"]
    cases["get"]["copy floor"] = lambda: get_dst.copy_(get_src)
    cases["append"]["copy floor"] = slot_ring_copy(app_src, MAX_LEN)
    cases["append"]["copy floor, one destination"] = lambda: app_dst.copy_(app_src)  # for information
    # one interleaved run over every contender of both ops, as the recorded table was measured
    fns = {(op, impl): fn for op, impls in cases.items() for impl, fn in impls.items()}
    med = median_us(fns, repeats, 1, syncer(device))
    names = {"get": f"get({N})", "append": "append"}
    return [{"suite": "history", "case": f"{n_envs} envs", "op": names[op], "impl": impl,
             "us": med[op, impl], "bytes": nbytes[op]} for op, impl in fns]
