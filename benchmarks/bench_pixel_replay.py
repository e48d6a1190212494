"""Pixel replay that stores each frame once: bytes held per step and the time to sample frame-stacked n-step batches.

84x84 gray uint8 frames, stacks of k = 4 (stride 1), n = 3 step returns with gamma 0.99, one env (E = 1), capacity
2**17 and 2**20 steps, batches of 32 and 256, on the CPU with one thread. Each buffer is filled to capacity with one
synthetic stream: episodes of 100-1000 steps, each ended by a termination (the last one cut short), random rewards
and actions; frame ``t`` is a random pool frame with ``t`` stamped in its first four bytes, so every sampled stack
names the steps it holds and is checked against stacks built by hand from the stream (all peers; gpubuf must match).

- gpubuf: ``TransitionBuffer.sample(unit=Unit.n_step(3, 0.99, frames=4))``; one frame per step stored.
- cpprb: ``ReplayBuffer(stack_compress="obs", Nstep=...)`` fed the full (84, 84, 4) stack per step (cpprb wants the
  stack axis last); it keeps one frame per step. With ``Nstep`` cpprb switches ``next_of`` off, so it returns no
  bootstrap stack at all (``done`` masks it).
- cpprb+next: the same with an explicit ``next_obs`` stack, stack-compressed too (two frames per step).
- torchrl: ``ReplayBuffer`` over ``LazyTensorStorage`` holding single frames, ``MultiStepTransform`` applied at
  write (it stores the n-step reward and the frame n steps on as ``("next", "pixels")``), sampling with the
  ``SliceSampler`` and transform of ``CatFrames.make_rb_transform_and_sampler`` (slices of 4 within an episode).

Bytes per step: gpubuf ``nbytes``, torchrl its storage's tensors, cpprb the process RSS growth over construction and
fill (its arrays are not reachable from Python); RSS growth of every peer is kept in the JSON too. Peers whose
frames would not fit in the memory available (less a margin) are left out of a capacity, with a printed reason.
Sample times: medians over interleaved rounds (per round every peer and batch in rotated order, one untimed call
then one timed). torchrl needs its own venv (torchrl 0.14 pins tensordict < 0.15):

    python benchmarks/bench_pixel_replay.py --caps 17 20    # -> results/pixel_replay_cpu.json and a markdown table
"""

import argparse
import datetime
import gc
import json
import os
import platform
from pathlib import Path

import numpy as np
import torch

from gpubuf import Transition, TransitionBuffer, Unit
from gpubuf.apps.benchmarking.timing import cpu_name, median_us, versions

K, N, GAMMA, SIDE, BATCHES = 4, 3, 0.99, 84, (32, 256)
CHUNK, POOL, CHECK = 2**14, 4096, 2048  # steps per insert (whole episodes), random frames, rows checked per peer
FRAMES_HELD = {"gpubuf": 1, "cpprb": 1, "cpprb+next": 2, "torchrl": 2}  # frames stored per step: the memory plan
MARGIN = 4 * 2**30  # bytes left free for the fill's temporaries and the other users of the machine


class Stream:
    """``steps`` steps of one env and the stacks and n-step returns they should sample as."""

    def __init__(self, steps: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        ends = np.cumsum(rng.integers(100, 1001, steps // 100 + 1))
        ends = ends[ends < steps]
        self.steps, self.starts = steps, np.concatenate([[0], ends])
        self.terminated = np.zeros(steps, bool)
        self.terminated[ends - 1] = True
        lengths = np.diff(np.append(self.starts, steps))
        self.episode = np.repeat(np.arange(len(lengths)), lengths)
        self.episode_start = self.starts[self.episode]
        self.reward = rng.standard_normal(steps).astype(np.float32)
        self.action = rng.integers(0, 18, steps)
        self.pool = rng.integers(0, 256, (POOL, SIDE, SIDE), dtype=np.uint8)
        self.chunks = self._chunks()

    def _chunks(self) -> list[tuple[int, int]]:
        bounds = [0]
        for s in self.starts[1:]:
            if s - bounds[-1] >= CHUNK:
                bounds.append(int(s))
        return list(zip(bounds, [*bounds[1:], self.steps], strict=True))

    def episodes(self, a: int, b: int) -> list[tuple[int, int]]:
        """The episodes of chunk ``[a, b)`` as ``(start, end)``."""
        inside = [int(s) for s in self.starts if a <= s < b]
        return list(zip(inside, [*inside[1:], b], strict=True))

    def frames(self, a: int, b: int) -> np.ndarray:
        t = np.arange(a, b)
        out = self.pool[(t * 7919) % POOL]
        out.reshape(len(t), -1)[:, :4] = t.astype("<u4").view(np.uint8).reshape(-1, 4)
        return out

    def stack(self, t: int) -> np.ndarray:
        steps = np.maximum(t - np.arange(K - 1, -1, -1), self.episode_start[t])
        return np.stack([self.frames(s, s + 1)[0] for s in steps])

    def n_step(self, t: int) -> tuple[float, float, int]:
        """(return, discount, bootstrap step) from ``t``: up to N rewards, cut by a termination or the newest step."""
        total, m = 0.0, 0
        for i in range(N):
            if t + i >= self.steps - 1:
                break
            total += GAMMA**i * float(self.reward[t + i])
            m += 1
            if self.terminated[t + i]:
                return total, 0.0, t + m
        return total, GAMMA**m, t + m


def stamps(stacks: np.ndarray) -> np.ndarray:
    """The step stamped in the newest frame of each (B, K, SIDE, SIDE) stack."""
    return np.ascontiguousarray(stacks[:, -1].reshape(len(stacks), -1)[:, :4]).view("<u4")[:, 0].astype(np.int64)


def rss() -> int:
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))


# ---------------------------------------------------------------------------------------------- peers
# Each builder fills a buffer of capacity ``cap`` from ``stream`` and returns
# (sample(B) -> raw batch, view(raw) -> (obs, next obs or None, return, discount) as numpy, bytes it reports or None).


def gpubuf_peer(stream: Stream, cap: int):
    def rows(a, b):
        return Transition(observation=stream.frames(a, b)[:, None], action=stream.action[a:b, None],
                          reward=stream.reward[a:b, None], terminated=stream.terminated[a:b, None],
                          truncated=np.zeros((b - a, 1), bool))

    buf = TransitionBuffer(cap, BATCHES[0], rows(0, 1), device="cpu", seed=0)
    for a, b in stream.chunks:
        buf.insert(rows(a, b))
    unit = Unit.n_step(N, GAMMA, frames=K)
    buf.sample(unit=unit)  # builds the episode marks that nbytes counts

    def view(s):
        return s.observation.numpy(), s.next_observation.numpy(), s.reward.numpy(), s.discount.numpy()

    return lambda B: buf.sample(batch_size=B, unit=unit), view, buf.nbytes


def windows(frames: np.ndarray) -> np.ndarray:
    """(L + 1, SIDE, SIDE, K) stacks of an episode's L frames, padded with its first frame, the last frame repeated
    once more (the terminal observation gpubuf does not store)."""
    padded = np.concatenate([frames[:1].repeat(K - 1, 0), frames, frames[-1:]])
    return np.lib.stride_tricks.sliding_window_view(padded, K, axis=0)


def cpprb_peer(stream: Stream, cap: int, with_next: bool):
    import cpprb

    stacked = {"shape": (SIDE, SIDE, K), "dtype": np.uint8}
    env = {"obs": stacked, "act": {"dtype": np.int64}, "rew": {"dtype": np.float32}, "done": {"dtype": np.float32}}
    if with_next:
        env["next_obs"] = dict(stacked)
    rb = cpprb.ReplayBuffer(cap, env, stack_compress=["obs", "next_obs"] if with_next else "obs",
                            Nstep={"size": N, "gamma": GAMMA, "rew": "rew", "next": "next_obs"})
    for a, b in stream.chunks:
        frames = stream.frames(a, b)
        for s, e in stream.episodes(a, b):
            w = windows(frames[s - a:e - a])
            # a copy: cpprb's Nstep adds the n-step sums into a float32 reward array it is given
            rb.add(obs=w[:-1], next_obs=w[1:], act=stream.action[s:e], rew=stream.reward[s:e].copy(),
                   done=stream.terminated[s:e])
            if stream.terminated[e - 1]:
                rb.on_episode_end()

    def view(s):
        nxt = np.moveaxis(s["next_obs"], -1, 1) if with_next else None
        return np.moveaxis(s["obs"], -1, 1), nxt, s["rew"][:, 0], GAMMA**N * (1 - s["done"][:, 0])

    return rb.sample, view, None


def tensor_bytes(state) -> int:
    """Bytes of the tensors in a nested state dict."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    return sum(tensor_bytes(v) for v in state.values()) if isinstance(state, dict) else 0


def torchrl_peer(stream: Stream, cap: int):
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, ReplayBuffer
    from torchrl.envs.transforms import CatFrames, MultiStepTransform

    cat = CatFrames(N=K, dim=-3, in_keys=["pixels"], out_keys=["stack"], reset_key="_reset")
    transform, sampler = cat.make_rb_transform_and_sampler(batch_size=BATCHES[0], traj_key="episode")
    storage = LazyTensorStorage(cap)
    rb = ReplayBuffer(storage=storage, sampler=sampler, transform=transform, batch_size=BATCHES[0])
    multistep = MultiStepTransform(N, GAMMA)
    for a, b in stream.chunks:
        t = np.arange(a, b)
        after = np.where(stream.terminated[t] | (t == b - 1), t, t + 1)  # the step after, the terminal one repeated
        frames, done = torch.from_numpy(stream.frames(a, b)), torch.from_numpy(stream.terminated[a:b, None])
        td = TensorDict({"pixels": frames[:, None], "action": torch.from_numpy(stream.action[a:b]),
                         "episode": torch.from_numpy(stream.episode[a:b]),
                         "next": {"pixels": frames[after - a, None], "done": done, "terminated": done.clone(),
                                  "reward": torch.from_numpy(stream.reward[a:b, None].copy()),
                                  "truncated": torch.zeros_like(done)}},
                        batch_size=[b - a])
        rb.extend(multistep.inv(td))

    def view(s):
        discount = s["gamma"] * ~s["next", "done"][:, 0]
        return (s["stack"].numpy(), s["next", "stack"].numpy(), s["next", "reward"][:, 0].numpy(),
                discount.numpy())

    return lambda B: rb.sample(batch_size=B), view, tensor_bytes(storage.state_dict())


BUILDERS = {"gpubuf": gpubuf_peer, "cpprb": lambda s, c: cpprb_peer(s, c, False),
            "cpprb+next": lambda s, c: cpprb_peer(s, c, True), "torchrl": torchrl_peer}


def importable(peer: str) -> str | None:
    """None when the peer's package imports, else the reason it is left out."""
    module = {"cpprb": "cpprb", "cpprb+next": "cpprb", "torchrl": "torchrl"}.get(peer)
    try:
        if module:
            __import__(module)
    except ImportError as err:
        return f"not importable ({err})"
    return None


# ---------------------------------------------------------------------------------------------- checks


def mismatches(stream: Stream, batch) -> dict:
    """Rows of a sampled batch that differ from the stream: stacks, n-step returns, discounts and (where both
    bootstrap) next stacks."""
    obs, nxt, ret, disc = batch
    bad = {"rows": len(obs), "obs": 0, "return": 0, "discount": 0, "next_obs": 0}
    for b, t in enumerate(stamps(obs)):
        want_ret, want_disc, boot = stream.n_step(t)
        bad["obs"] += not np.array_equal(obs[b], stream.stack(t))
        bad["return"] += abs(float(ret[b]) - want_ret) > 1e-4
        bad["discount"] += abs(float(disc[b]) - want_disc) > 1e-6
        if nxt is not None and want_disc and disc[b]:
            bad["next_obs"] += not np.array_equal(nxt[b], stream.stack(boot))
    return bad


# ---------------------------------------------------------------------------------------------- run


def run_capacity(cap: int, peers: list[str], repeats: int) -> list[dict]:
    stream = Stream(cap)
    room, fns, rows = available() - MARGIN, {}, []
    for peer in peers:
        need = FRAMES_HELD[peer] * SIDE * SIDE * cap
        reason = importable(peer) or (f"needs ~{need / 2**30:.1f} GiB, {max(room, 0) / 2**30:.1f} GiB left"
                                      if need > room else None)
        if reason:
            print(f"2**{cap.bit_length() - 1}: {peer} left out: {reason}")
            continue
        before = rss()
        sample, view, nbytes = BUILDERS[peer](stream, cap)
        grown = rss() - before
        room -= max(grown, need)
        bad = mismatches(stream, view(sample(CHECK)))
        if peer == "gpubuf":
            assert not any(bad[k] for k in ("obs", "return", "discount", "next_obs")), bad
        rows.append({"peer": peer, "capacity": cap, "bytes_per_step": (nbytes or grown) / cap,
                     "bytes_from": "rss growth" if nbytes is None else "reported", "rss_bytes_per_step": grown / cap,
                     "check": bad})
        for B in BATCHES:
            fns[(peer, B)] = lambda sample=sample, B=B: sample(B)
        print(f"2**{cap.bit_length() - 1}: {peer} filled, {rows[-1]['bytes_per_step']:.0f} B/step, check {bad}")
    med = median_us(fns, repeats)
    for r in rows:
        for B in BATCHES:
            r[f"ms_b{B}"] = med[(r["peer"], B)] / 1e3
            r[f"ratio_b{B}"] = med[(r["peer"], B)] / med[("gpubuf", B)]
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--caps", type=int, nargs="+", default=[17, 20], help="log2 capacities, one at a time")
    p.add_argument("--repeats", type=int, default=30, help="interleaved rounds (torchrl takes seconds a round)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "pixel_replay_cpu.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    load = [os.getloadavg()]
    rows = []
    for log2 in args.caps:
        rows += run_capacity(2**log2, list(FRAMES_HELD), args.repeats)
        gc.collect()  # every buffer of this capacity is gone before the next
        load.append(os.getloadavg())
    meta = {"cpu": cpu_name(), "processor": platform.processor(), "platform": platform.platform(),
            "cpus": os.cpu_count(), "threads": torch.get_num_threads(), "repeats": args.repeats,
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "loadavg_1_5_15": load,
            "frame": [SIDE, SIDE], "frame_stack": K, "n_step": N, "gamma": GAMMA, "envs": 1,
            **versions(["torch", "numpy", "cpprb", "torchrl", "tensordict"])}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"\nPixel replay, 84x84 uint8, k={K}, n={N}; CPU, 1 thread, median of {args.repeats} rounds\n")
    print("| peer | capacity | bytes/step | batch 32 ms | batch 256 ms | vs gpubuf (32 / 256) |\n"
          "|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['peer']} | 2**{r['capacity'].bit_length() - 1} | {r['bytes_per_step']:.0f} | {r['ms_b32']:.2f} "
              f"| {r['ms_b256']:.2f} | {r['ratio_b32']:.2f}x / {r['ratio_b256']:.2f}x |")


if __name__ == "__main__":
    main()
