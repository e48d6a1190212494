"""Memory-mapped replay: 64x64x3 uint8 frames in files on disk, sampled as 32 windows of 16 frames and as
256 single frames; gpubuf's ``storage_dir`` against torchrl's ``LazyMemmapStorage`` in the same run.

Both write the same frames (64 envs), env-major on disk: gpubuf's ``storage_dir`` files hold each env's
steps adjacent (``(E, M, *shape)``), torchrl's ``SliceSampler`` reads env-major trajectories; then sampling
alternates between them. ``--log2-frames`` sets the size; each copy takes ``2**n * 12288`` bytes of disk
(2**21 frames: 25.8 GB per copy; the four copies must exceed RAM for a disk-bound run). Run it in the
peers' venv (``bash benchmarks/setup_peers.sh``):

    .venv-peers/bin/python benchmarks/bench_memmap.py --log2-frames 21 --dir /var/tmp/gpubuf-memmap
"""

import argparse
import json
import os
import platform
import shutil
import statistics
from pathlib import Path

import numpy as np
import torch

from gpubuf import Transition, TransitionBuffer
from gpubuf.apps.benchmarking.timing import interleaved, wall_clock

ENVS, H, W, C, SB, SL, B1 = 64, 64, 64, 3, 32, 16, 256


def frames_at(t0: int, T: int, envs=slice(None)) -> np.ndarray:
    """(T, envs, H, W, C) uint8 frames filled with (step * ENVS + env) % 251: cheap to generate."""
    e = np.arange(ENVS)[envs]
    f = np.empty((T, len(e), H, W, C), np.uint8)
    f.reshape(T * len(e), -1)[:] = ((np.arange(t0, t0 + T)[:, None] * ENVS + e) % 251).astype(np.uint8).reshape(-1, 1)
    return f


def read_bytes() -> int:
    """Bytes this process has had read from storage so far (Linux ``/proc/self/io``; page faults included)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))


def disk_clock():
    """A :mod:`gpubuf.apps.benchmarking.timing` clock whose samples are (microseconds, bytes read from disk)."""
    wall = wall_clock()

    def start():
        r, stop_wall = read_bytes(), wall()
        return lambda: (stop_wall(), read_bytes() - r)

    return start


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--log2-frames", type=int, default=20)
    p.add_argument("--dir", default="/var/tmp/gpubuf-memmap")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", default=None)
    p.add_argument("--gpubuf-only", action="store_true", help="skip torchrl (e.g. to compare two gpubuf versions)")
    args = p.parse_args()
    torch.set_num_threads(1)
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    N = 2**args.log2_frames
    steps = N // ENVS
    chunk = 64  # steps per insert (64 x 64 frames = 50 MB)

    def tr(f):
        T = f.shape[0]
        return Transition(observation=f, action=np.zeros((T, ENVS), np.float32), reward=np.zeros((T, ENVS), np.float32),
                          terminated=np.zeros((T, ENVS), bool), truncated=np.zeros((T, ENVS), bool))

    clock = wall_clock()
    stop_fill = clock()
    g = TransitionBuffer(N, SB, tr(frames_at(0, 1)), n_steps=SL, device="cpu", seed=0, storage_dir=root / "gpubuf")
    g1 = TransitionBuffer(N, B1, tr(frames_at(0, 1)), n_steps=1, device="cpu", seed=0,
                          storage_dir=root / "gpubuf-single")
    inserts = []  # seconds per insert of `chunk` steps x ENVS frames, into both buffers
    for s in range(0, steps, chunk):
        rows = tr(frames_at(s, min(chunk, steps - s)))
        stop = clock()
        g.insert(rows)
        g1.insert(rows)
        inserts.append(stop() / 1e6)
    g.flush(), g1.flush()
    fill = {"gpubuf (2 buffers)": stop_fill() / 1e6}
    again, filling = tr(frames_at(steps, chunk)), len(inserts)
    for _ in range(max(4, args.repeats // 3)):  # into a full ring: every insert overwrites held rows
        stop = clock()
        g.insert(again)
        g1.insert(again)
        inserts.append(stop() / 1e6)
    if args.gpubuf_only:
        rb = rb1 = None
    else:
        rb, rb1 = fill_torchrl(root, N, steps, fill)

    fns = {("32x16 windows", "gpubuf"): lambda: g.sample(),
           ("32x16 windows", "torchrl LazyMemmapStorage + SliceSampler"): lambda: rb.sample(),
           ("256 frames", "gpubuf"): lambda: g1.sample(),
           ("256 frames", "torchrl LazyMemmapStorage + RandomSampler"): lambda: rb1.sample()}
    if args.gpubuf_only:
        fns = {k: fn for k, fn in fns.items() if k[1] == "gpubuf"}
    # 3 interleaved rounds (after one untimed call of each) of repeats // 3 timed calls of each
    times = interleaved(fns, 3, disk_clock(), max(1, args.repeats // 3), skip=0)
    rows = []
    for (c, impl), v in times.items():
        sec = statistics.median(us for us, _ in v) / 1e6
        frames = SB * SL if c.startswith("32") else B1
        rows.append({"case": c, "impl": impl, "us": sec * 1e6, "MB/s": frames * H * W * C / sec / 1e6,
                     "disk MB read": statistics.median(b for _, b in v) / 1e6})
    disk = shutil.disk_usage(root)
    print(f"memmap sampling, {N} frames of {H}x{W}x{C} per buffer on disk ({N * H * W * C / 1e9:.1f} GB each), "
          f"{os.cpu_count()} CPUs, 1 thread; fill seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in fill.items()))
    print("| case | impl | median us | MB/s | disk MB read |\n|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['case']} | {r['impl']} | {r['us']:.0f} | {r['MB/s']:.0f} | {r['disk MB read']:.1f} |")
    insert_us = {"filling": statistics.median(inserts[:filling]) * 1e6,
                 "full ring": statistics.median(inserts[filling:]) * 1e6}
    print(f"gpubuf insert of {chunk} steps x {ENVS} envs into both buffers, median us: "
          + ", ".join(f"{k} {v:.0f}" for k, v in insert_us.items()))
    result = {"frames": N, "frame_bytes": H * W * C, "fill_s": fill, "rows": rows, "disk_free_after": disk.free,
              "insert_us": insert_us,
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count()}, "torch": torch.__version__}
    out = args.out or os.path.join(os.path.dirname(__file__), "results", "memmap_cpu.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    shutil.rmtree(root, ignore_errors=True)


def fill_torchrl(root: Path, N: int, steps: int, fill: dict):
    """torchrl's two memory-mapped buffers holding the same frames (its fill time added to ``fill``)."""
    from tensordict import TensorDict
    from torchrl.data import LazyMemmapStorage, ReplayBuffer
    from torchrl.data.replay_buffers import RandomSampler, SliceSampler

    stop_fill = wall_clock()()
    storage = LazyMemmapStorage(N, scratch_dir=str(root / "torchrl"))
    rb = ReplayBuffer(storage=storage, sampler=SliceSampler(num_slices=SB, traj_key="episode"), batch_size=SB * SL)
    storage1 = LazyMemmapStorage(N, scratch_dir=str(root / "torchrl-single"))
    rb1 = ReplayBuffer(storage=storage1, sampler=RandomSampler(), batch_size=B1)
    for e in range(ENVS):  # env-major: each env's trajectory contiguous (what SliceSampler reads)
        for s in range(0, steps, 1024):
            T = min(1024, steps - s)
            f = torch.from_numpy(frames_at(s, T, [e])[:, 0])
            td = TensorDict({"obs": f, "episode": torch.full((T,), e), "reward": torch.zeros(T)}, batch_size=[T])
            rb.extend(td)
            rb1.extend(td)
    fill["torchrl (2 buffers)"] = stop_fill() / 1e6
    return rb, rb1


if __name__ == "__main__":
    main()
