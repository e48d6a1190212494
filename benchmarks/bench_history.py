"""HistoryBuffer vs a per-env deque baseline vs the copy floor: ``append`` and ``get(3)``.

Per step: pixels (1, 64, 64, 3) uint8 and action (1, 2) float32 per env; action_block 5, max_len 11.
Contenders run interleaved (rotating order) in one process, one thread; each cell is a median.

    python benchmarks/bench_history.py                       # CPU, n_envs 16 256 1024
    python benchmarks/bench_history.py --device cuda --n-envs 1024 4096
"""

import argparse
import collections
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from gpubuf import HistoryBuffer

N, AB, MAX_LEN = 3, 5, 11
PIX, ACT = (1, 64, 64, 3), (1, 2)


class DequeHistory:
    """stable-worldmodel's HistoryBuffer semantics: a Python deque of per-env slices per env."""

    def __init__(self, n_envs, max_len, action_block, block_keys):
        self.n_envs, self.ab, self.block_keys = n_envs, action_block, tuple(block_keys)
        self.buffers = [collections.deque(maxlen=max_len) for _ in range(n_envs)]

    def append(self, info):
        for i in range(self.n_envs):
            self.buffers[i].append({k: v[i] for k, v in info.items()})

    def get(self, n):
        out = {k: [] for k in self.buffers[0][0]}
        for buf in self.buffers:
            entries = list(buf)
            L = len(entries)
            idx = list(range(L - 1, -1, -self.ab))[:n][::-1]
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


def timer(device):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def run(fn, inner):
        sync()
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        return (time.perf_counter() - t0) / inner * 1e6

    return run


def bench(n_envs, device, repeats, with_deque):
    rng = np.random.default_rng(0)
    info = {"pixels": rng.integers(0, 255, (n_envs, *PIX), dtype=np.uint8),
            "action": rng.standard_normal((n_envs, *ACT)).astype(np.float32)}
    if device.type == "cuda":  # a GPU simulator hands device tensors
        info = {k: torch.from_numpy(v).to(device) for k, v in info.items()}
    buf = HistoryBuffer(n_envs, MAX_LEN, AB, ("action",), device=device)
    for _ in range(MAX_LEN):
        buf.append(info)
    deque = DequeHistory(n_envs, MAX_LEN, AB, ("action",))
    for _ in range(MAX_LEN):
        deque.append(info if device.type == "cpu" else {k: v.cpu().numpy() for k, v in info.items()})
    out = buf.get(N)
    get_bytes = sum(t.numel() * t.element_size() for t in out.values())
    app_bytes = sum(v.nbytes for v in info.values())
    get_src = torch.empty(get_bytes, dtype=torch.uint8, device=device)
    get_dst = torch.empty_like(get_src)
    app_src = torch.empty(app_bytes, dtype=torch.uint8, device=device)
    app_dst = torch.empty_like(app_src)
    inner = 20 if device.type == "cuda" else 1
    run = timer(device)
    cases = {
        ("get", "gpubuf"): lambda: buf.get(N),
        ("get_out", "gpubuf"): lambda: buf.get(N, out=out),
        ("get", "floor"): lambda: get_dst.copy_(get_src),
        ("append", "gpubuf"): lambda: buf.append(info),
        ("append", "floor"): lambda: app_dst.copy_(app_src),
    }
    if with_deque:
        cases[("get", "deque")] = lambda: deque.get(N)
        cases[("append", "deque")] = lambda: deque.append(info)
    times = {c: [] for c in cases}
    order = list(cases)
    for c in order:  # warm-up (Triton compile, caches)
        run(cases[c], 1)
    for r in range(repeats):
        for c in order[r % len(order):] + order[: r % len(order)]:
            times[c].append(run(cases[c], inner))
    med = {c: statistics.median(v) for c, v in times.items()}
    rows = []
    names = {"get": "get(3)", "get_out": "get(3, out=)", "append": "append"}
    for op, nbytes in (("get", get_bytes), ("get_out", get_bytes), ("append", app_bytes)):
        base = "append" if op == "append" else "get"
        g, f = med[(op, "gpubuf")], med[(base, "floor")]
        d = med.get((base, "deque"))
        rows.append({
            "n_envs": n_envs, "op": names[op], "bytes": nbytes,
            "gpubuf_us": g, "deque_us": d, "floor_us": f,
            "gpubuf_over_floor": g / f, "deque_over_gpubuf": d / g if d else None,
            "gpubuf_GBps": nbytes / g / 1e3, "floor_GBps": nbytes / f / 1e3,
        })
    return rows


def table(rows):
    lines = ["| n_envs | op | gpubuf us | deque us | copy floor us | gpubuf / floor | deque / gpubuf | gpubuf GB/s |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        d = f"{r['deque_us']:.0f}" if r["deque_us"] else "-"
        dg = f"{r['deque_over_gpubuf']:.1f}x" if r["deque_over_gpubuf"] else "-"
        lines.append(f"| {r['n_envs']} | {r['op']} | {r['gpubuf_us']:.0f} | {d} | {r['floor_us']:.0f} | "
                     f"{r['gpubuf_over_floor']:.2f}x | {dg} | {r['gpubuf_GBps']:.1f} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--n-envs", type=int, nargs="+", default=[16, 256, 1024])
    p.add_argument("--repeats", type=int, default=31)
    p.add_argument("--no-deque", action="store_true", help="skip the (slow) deque baseline")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/history_<device>.json)")
    args = p.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    rows = [r for n in args.n_envs for r in bench(n, device, args.repeats, not args.no_deque)]
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or platform.machine()
    meta = {"device": str(device), "device_name": name, "torch": torch.__version__, "threads": 1,
            "repeats": args.repeats, "n": N, "action_block": AB, "max_len": MAX_LEN, "pixels": PIX, "action": ACT}
    out = Path(args.out or Path(__file__).parent / "results" / f"history_{device.type}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"HistoryBuffer on {device} ({name}), torch {torch.__version__}, 1 thread, median of {args.repeats}")
    print(table(rows))


if __name__ == "__main__":
    main()
