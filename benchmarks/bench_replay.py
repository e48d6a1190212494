"""Replay benchmarks: gpubuf TransitionBuffer / PrioritizedTransitionBuffer against their peers, same run.

Cases:
- ``per``: obs float32[17], action float32[6], reward, terminated, truncated; a full buffer of N transitions,
  N in {2**17, 2**20, 2**22}; timed: insert 256, sample 256 (with importance weights), update 256 priorities.
  Peers: cpprb PrioritizedReplayBuffer, torchrl PrioritizedReplayBuffer (LazyTensorStorage), flashbax
  prioritised flat buffer, jaxnasium PrioritizedTransitionBuffer.
- ``seq``: 64 envs x 1024 steps of 64x64x3 uint8 frames; timed: sample 32 windows of 16 steps.
  Peers: torchrl SliceSampler on LazyTensorStorage, flashbax trajectory buffer, jaxnasium TransitionBuffer.
- ``floor``: a plain copy of the same output bytes into a preallocated tensor.

Peers are interleaved (blocks of consecutive calls, rotating order) and the median is reported;
``torch.set_num_threads(1)`` (and one XLA CPU thread) unless ``--threads`` says otherwise. A peer that
does not import is reported as missing with the reason. Run with the venv made by ``benchmarks/setup_peers.sh``:

    /work/bench-venv/bin/python benchmarks/bench_replay.py            # writes benchmarks/results/replay_<device>.json
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback

import numpy as np

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--device", default="cpu")
parser.add_argument("--threads", type=int, default=1)
parser.add_argument("--repeats", type=int, default=20, help="blocks of 5 timed calls per implementation")
parser.add_argument("--log2-sizes", default="17,20,22")
parser.add_argument("--batch", type=int, default=256, help="PER insert/sample/update batch")
parser.add_argument("--cases", default="per,seq")
parser.add_argument("--peers", default="cpprb,torchrl,flashbax,jaxnasium")
parser.add_argument("--out", default=None)
args = parser.parse_args()

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import torch  # noqa: E402

from gpubuf import PrioritizedTransitionBuffer, Transition, TransitionBuffer  # noqa: E402

torch.set_num_threads(args.threads)
DEV = torch.device(args.device)
PEERS = set(args.peers.split(",")) if args.peers else set()
missing: dict[str, str] = {}
rows: list[dict] = []


def sync():
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def bench(fns: dict, repeats: int, block: int = 6) -> dict:
    """Median seconds per call of each fn. Every repeat runs each fn for a block of consecutive calls, in a
    rotating order (interleaved within the run); the first call of each block is discarded, so the thread
    pools a previous peer left spinning (XLA's) do not land on the next one's first call."""
    for fn in fns.values():
        fn()
    names = list(fns)
    times = {k: [] for k in fns}
    for r in range(repeats):
        for k in names[r % len(names):] + names[:r % len(names)]:
            fn = fns[k]
            for i in range(block):
                t0 = time.perf_counter()
                fn()
                if i:
                    times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def try_peer(name: str, factory):
    if name.split("-")[0] not in PEERS:
        return None
    try:
        return factory()
    except Exception as err:  # noqa: BLE001  (a peer that fails is reported, not fatal)
        missing[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
        traceback.print_exc(limit=1, file=sys.stderr)
        return None


def jax_block(x):
    import jax

    return jax.block_until_ready(x)


# ------------------------------------------------------------------------------------------ PER case

OBS, ACT, B = 17, 6, args.batch


def per_data(n: int, rng: np.random.Generator) -> dict:
    return {"obs": rng.standard_normal((n, OBS), dtype=np.float32),
            "act": rng.standard_normal((n, ACT), dtype=np.float32), "rew": rng.standard_normal(n, dtype=np.float32),
            "term": np.zeros(n, bool), "trunc": np.zeros(n, bool)}


def gpubuf_per(N: int, fill: dict, batch: dict):
    def tr(d):
        return Transition(observation=d["obs"], action=d["act"], reward=d["rew"], terminated=d["term"],
                          truncated=d["trunc"])

    buf = PrioritizedTransitionBuffer(N, B, tr({k: v[:1] for k, v in batch.items()}), vectorized_env=False,
                                      device=DEV, seed=0)
    chunk = min(N, 2**16)
    for s in range(0, N, chunk):
        buf.insert(tr({k: v[s:s + chunk] for k, v in fill.items()}))
    batch_t = tr(batch)
    state = {}
    rng = torch.Generator(device=DEV).manual_seed(1)
    gen = torch.Generator(device=DEV).manual_seed(2)

    def insert():
        buf.insert(batch_t)
        sync()

    def sample(replace=True):
        out, idx = buf.sample(key=gen, with_replacement=replace)
        state["idx"] = idx
        sync()
        return out

    def update():
        buf.update_priorities(state["idx"], torch.rand(B, generator=rng, device=DEV) * 2)
        sync()

    sample()
    return {"insert": insert, "sample": sample, "sample_norepl": lambda: sample(False), "update": update}


def cpprb_per(N: int, fill: dict, batch: dict):
    import cpprb

    rb = cpprb.PrioritizedReplayBuffer(N, {"obs": {"shape": OBS}, "act": {"shape": ACT}, "rew": {}, "term": {},
                                           "trunc": {}}, alpha=0.6, eps=1e-6)
    chunk = 2**16
    for s in range(0, N, chunk):
        rb.add(**{k: v[s:s + chunk] for k, v in fill.items()})
    state = {}
    rng = np.random.default_rng(1)

    def sample():
        out = rb.sample(B, beta=0.4)
        state["idx"] = out["indexes"]
        return out

    sample()
    return {"insert": lambda: rb.add(**batch), "sample": sample,
            "update": lambda: rb.update_priorities(state["idx"], rng.random(B) * 2 + 1e-6)}


def torchrl_per(N: int, fill: dict, batch: dict):
    import torchrl._torchrl  # noqa: F401  (the compiled segment trees; see setup_peers.sh)
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, PrioritizedReplayBuffer

    rb = PrioritizedReplayBuffer(alpha=0.6, beta=0.4, eps=1e-6, storage=LazyTensorStorage(N), batch_size=B)

    def td(d):
        return TensorDict({k: torch.from_numpy(v) for k, v in d.items()}, batch_size=[len(d["rew"])])

    chunk = 2**16
    for s in range(0, N, chunk):
        rb.extend(td({k: v[s:s + chunk] for k, v in fill.items()}))
    batch_td = td(batch)
    state = {}
    g = torch.Generator().manual_seed(1)

    def sample():
        out, info = rb.sample(return_info=True)
        state["idx"] = info["index"]
        return out

    sample()
    return {"insert": lambda: rb.extend(batch_td), "sample": sample,
            "update": lambda: rb.update_priority(state["idx"], torch.rand(B, generator=g) * 2 + 1e-6)}


def flashbax_per(N: int, fill: dict, batch: dict):
    import flashbax as fbx
    import jax
    import jax.numpy as jnp

    buf = fbx.make_prioritised_flat_buffer(max_length=N, min_length=B, sample_batch_size=B, add_sequences=True,
                                           add_batch_size=None, priority_exponent=0.6)
    state = buf.init({k: jnp.asarray(v[0]) for k, v in batch.items()})
    add, sample_fn, setp = jax.jit(buf.add, donate_argnums=0), jax.jit(buf.sample), jax.jit(buf.set_priorities,
                                                                                             donate_argnums=0)
    chunk = 2**16
    for s in range(0, N, chunk):
        state = add(state, {k: jnp.asarray(v[s:s + chunk]) for k, v in fill.items()})
    batch_j = {k: jnp.asarray(v) for k, v in batch.items()}
    box = {"state": state, "key": jax.random.PRNGKey(0)}

    def insert():
        box["state"] = jax_block(add(box["state"], batch_j))

    def sample():
        box["key"], k = jax.random.split(box["key"])
        out = jax_block(sample_fn(box["state"], k))
        box["idx"] = out.indices
        return out

    def update():
        box["key"], k = jax.random.split(box["key"])
        box["state"] = jax_block(setp(box["state"], box["idx"], jax.random.uniform(k, (B,)) * 2 + 1e-6))

    sample()
    return {"insert": insert, "sample": sample, "update": update}


def jaxnasium_per(N: int, fill: dict, batch: dict):
    import jax
    import jax.numpy as jnp
    from jaxnasium.algorithms.core import PrioritizedTransitionBuffer as JPB
    from jaxnasium.algorithms.core import Transition as JT

    def tr(d):
        return JT(observation=jnp.asarray(d["obs"]), action=jnp.asarray(d["act"]), reward=jnp.asarray(d["rew"]),
                  terminated=jnp.asarray(d["term"]), truncated=jnp.asarray(d["trunc"]))

    buf = JPB(N, B, tr({k: v[:1] for k, v in batch.items()}), vectorized_env=False)
    ins = jax.jit(lambda b, t: b.insert(t))
    smp = jax.jit(lambda b, k: b.sample(k, with_replacement=True))
    upd = jax.jit(lambda b, i, td: b.update_priorities(i, td))
    chunk = 2**16
    for s in range(0, N, chunk):
        buf = ins(buf, tr({k: v[s:s + chunk] for k, v in fill.items()}))
    batch_j = tr(batch)
    box = {"buf": buf, "key": jax.random.PRNGKey(0)}

    def insert():
        box["buf"] = jax_block(ins(box["buf"], batch_j))

    def sample():
        box["key"], k = jax.random.split(box["key"])
        out = jax_block(smp(box["buf"], k))
        box["idx"] = out.PER_index  # the installed jaxnasium carries the indices on the batch
        return out

    def update():
        box["key"], k = jax.random.split(box["key"])
        box["buf"] = jax_block(upd(box["buf"], box["idx"], jax.random.uniform(k, (B,)) * 2))

    sample()
    return {"insert": insert, "sample": sample, "update": update}


def per_case(N: int):
    rng = np.random.default_rng(0)
    fill, batch = per_data(N, rng), per_data(B, rng)
    peers = {"gpubuf": gpubuf_per(N, fill, batch)}
    for name, make in (("cpprb", cpprb_per), ("torchrl", torchrl_per), ("flashbax", flashbax_per),
                       ("jaxnasium", jaxnasium_per)):
        p = try_peer(name, lambda make=make: make(N, fill, batch))
        if p is not None:
            peers[name] = p
    row_bytes = (OBS + ACT + 1) * 4 + 2
    src = torch.zeros(B, row_bytes, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    floor = {"floor": lambda: (dst.copy_(src), sync())}
    for op in ("insert", "sample", "update"):
        fns = {name: p[op] for name, p in peers.items()} | floor
        if op == "sample":
            fns["gpubuf (no replacement)"] = peers["gpubuf"]["sample_norepl"]
        res = bench(fns, args.repeats)
        for name, sec in res.items():
            rows.append({"case": "per", "N": N, "op": f"{op} {B}", "impl": name, "us": sec * 1e6,
                         "MB/s": B * row_bytes / sec / 1e6})
        print(f"per N=2**{int(np.log2(N))} {op}: " + ", ".join(f"{k} {v * 1e6:.0f}us" for k, v in res.items()),
              flush=True)
    del peers


# ------------------------------------------------------------------------------------------ sequence case

ENVS, STEPS, H, W, C, SB, SL = 64, 1024, 64, 64, 3, 32, 16


def gpubuf_seq(frames: np.ndarray):
    def tr(f):
        T = f.shape[0]
        return Transition(observation=f, action=np.zeros((T, ENVS), np.float32), reward=np.zeros((T, ENVS), np.float32),
                          terminated=np.zeros((T, ENVS), bool), truncated=np.zeros((T, ENVS), bool))

    buf = TransitionBuffer(ENVS * STEPS, SB, tr(frames[:1]), n_steps=SL, device=DEV, seed=0)
    for s in range(0, STEPS, 256):
        buf.insert(tr(frames[s:s + 256]))
    gen = torch.Generator(device=DEV).manual_seed(0)
    out = buf.sample(key=gen)

    def sample():
        res = buf.sample(key=gen)
        sync()
        return res

    def sample_into():
        buf.sample(key=gen, out=out)
        sync()

    return sample, sample_into


def torchrl_seq(frames: np.ndarray):
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, ReplayBuffer
    from torchrl.data.replay_buffers import SliceSampler

    n = ENVS * STEPS
    rb = ReplayBuffer(storage=LazyTensorStorage(n), sampler=SliceSampler(num_slices=SB, traj_key="episode"),
                      batch_size=SB * SL)
    env_major = torch.from_numpy(frames).transpose(0, 1).reshape(n, H, W, C)  # each env's steps contiguous
    rb.extend(TensorDict({"obs": env_major, "episode": torch.arange(ENVS).repeat_interleave(STEPS),
                          "reward": torch.zeros(n)}, batch_size=[n]))
    return lambda: rb.sample()


def flashbax_seq(frames: np.ndarray):
    import flashbax as fbx
    import jax
    import jax.numpy as jnp

    buf = fbx.make_trajectory_buffer(add_batch_size=ENVS, sample_batch_size=SB, sample_sequence_length=SL, period=1,
                                     min_length_time_axis=SL, max_length_time_axis=STEPS)
    state = buf.init({"obs": jnp.zeros((H, W, C), jnp.uint8), "reward": jnp.zeros((), jnp.float32)})
    add = jax.jit(buf.add, donate_argnums=0)
    for s in range(0, STEPS, 256):
        f = np.ascontiguousarray(frames[s:s + 256].transpose(1, 0, 2, 3, 4))  # (E, T, ...)
        state = add(state, {"obs": jnp.asarray(f), "reward": jnp.zeros((ENVS, f.shape[1]), jnp.float32)})
    sample_fn = jax.jit(buf.sample)
    box = {"key": jax.random.PRNGKey(0)}

    def sample():
        box["key"], k = jax.random.split(box["key"])
        return jax_block(sample_fn(state, k))

    return sample


def jaxnasium_seq(frames: np.ndarray):
    import jax
    import jax.numpy as jnp
    from jaxnasium.algorithms.core import Transition as JT
    from jaxnasium.algorithms.core import TransitionBuffer as JB

    def tr(f):
        T = f.shape[0]
        z = jnp.zeros((T, ENVS))
        return JT(observation=jnp.asarray(f), action=z, reward=z, terminated=z.astype(bool), truncated=z.astype(bool))

    buf = JB(ENVS * STEPS, SB, tr(frames[:1]), vectorized_env=True, n_steps=SL)
    ins = jax.jit(lambda b, t: b.insert(t))
    for s in range(0, STEPS, 256):
        buf = ins(buf, tr(frames[s:s + 256]))
    smp = jax.jit(lambda b, k: b.sample(k))
    box = {"key": jax.random.PRNGKey(0)}

    def sample():
        box["key"], k = jax.random.split(box["key"])
        return jax_block(smp(buf, k))

    return sample


def seq_case():
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, size=(STEPS, ENVS, H, W, C), dtype=np.uint8)  # time-major (T, E, H, W, C)
    fns = dict(zip(("gpubuf", "gpubuf (out=)"), gpubuf_seq(frames), strict=True))
    for name, make in (("torchrl-SliceSampler", torchrl_seq), ("flashbax", flashbax_seq),
                       ("jaxnasium", jaxnasium_seq)):
        p = try_peer(name, lambda make=make: make(frames))
        if p is not None:
            fns[name] = p
    nbytes = SB * SL * H * W * C
    src = torch.zeros(nbytes, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    fns["floor"] = lambda: (dst.copy_(src), sync())
    res = bench(fns, max(4, args.repeats // 2))
    for name, sec in res.items():
        rows.append({"case": "seq", "N": ENVS * STEPS, "op": f"sample {SB}x{SL} frames", "impl": name,
                     "us": sec * 1e6, "MB/s": nbytes / sec / 1e6})
    print("seq sample: " + ", ".join(f"{k} {v * 1e6:.0f}us" for k, v in res.items()), flush=True)


# ------------------------------------------------------------------------------------------ main


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("cpprb", "torchrl", "tensordict", "flashbax", "jax", "jaxnasium"):
        try:
            from importlib.metadata import version

            out[mod] = version(mod)
        except Exception:  # noqa: BLE001
            out[mod] = None
    return out


def main():
    cases = args.cases.split(",")
    if "per" in cases:
        for lg in map(int, args.log2_sizes.split(",")):
            per_case(2**lg)
    if "seq" in cases:
        seq_case()
    machine = {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
               "device": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu", "threads": args.threads,
               "repeats": args.repeats}
    result = {"machine": machine, "versions": versions(), "missing": missing, "rows": rows}
    out = args.out or os.path.join(os.path.dirname(__file__), "results", f"replay_{DEV.type}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{machine['device']}, {args.threads} thread(s), median of {args.repeats} repeats; wrote {out}\n")
    print("| case | N | op | impl | median us | MB/s |")
    print("|---|---|---|---|---:|---:|")
    for r in rows:
        print(f"| {r['case']} | {r['N']} | {r['op']} | {r['impl']} | {r['us']:.1f} | {r['MB/s']:.0f} |")
    for name, why in missing.items():
        print(f"\nmissing: {name}: {why}")


if __name__ == "__main__":
    main()
