"""Sequence replay: sample 32 windows of 16 steps of 64x64x3 uint8 frames from ``envs`` envs x ``steps`` steps.

Peers: torchrl SliceSampler on LazyTensorStorage, flashbax trajectory buffer, jaxnasium TransitionBuffer. Each contender
is a zero-argument callable that samples one batch of windows."""

import numpy as np
import torch

from gpubuf._core.transition import Transition
from gpubuf.apps.benchmarking.peers import Peers
from gpubuf.apps.benchmarking.per import jax_block
from gpubuf.apps.benchmarking.timing import median_us, syncer
from gpubuf.replay.buffer import TransitionBuffer

H, W, C, SB, SL, CHUNK = 64, 64, 3, 32, 16, 256


def gpubuf_seq(frames: np.ndarray, device: torch.device) -> dict:
    """frames: (steps, envs, H, W, C) uint8, time-major."""
    steps, envs = frames.shape[:2]

    def tr(f):
        T = f.shape[0]
        return Transition(observation=f, action=np.zeros((T, envs), np.float32), reward=np.zeros((T, envs), np.float32),
                          terminated=np.zeros((T, envs), bool), truncated=np.zeros((T, envs), bool))

    buf = TransitionBuffer(envs * steps, SB, tr(frames[:1]), n_steps=SL, device=device, seed=0)
    for s in range(0, steps, CHUNK):
        buf.insert(tr(frames[s:s + CHUNK]))
    gen = torch.Generator(device=device).manual_seed(0)
    out = buf.sample(key=gen)
    return {"gpubuf": lambda: buf.sample(key=gen), "gpubuf (out=)": lambda: buf.sample(key=gen, out=out)}


def torchrl_seq(frames: np.ndarray):
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, ReplayBuffer
    from torchrl.data.replay_buffers import SliceSampler

    steps, envs = frames.shape[:2]
    n = envs * steps
    rb = ReplayBuffer(storage=LazyTensorStorage(n), sampler=SliceSampler(num_slices=SB, traj_key="episode"),
                      batch_size=SB * SL)
    # each env's steps contiguous
    env_major = torch.from_numpy(frames).transpose(0, 1).reshape(n, H, W, C)
    rb.extend(TensorDict({"obs": env_major, "episode": torch.arange(envs).repeat_interleave(steps),
                          "reward": torch.zeros(n)}, batch_size=[n]))
    return lambda: rb.sample()


def flashbax_seq(frames: np.ndarray):
    import flashbax as fbx
    import jax
    import jax.numpy as jnp

    steps, envs = frames.shape[:2]
    buf = fbx.make_trajectory_buffer(add_batch_size=envs, sample_batch_size=SB, sample_sequence_length=SL, period=1,
                                     min_length_time_axis=SL, max_length_time_axis=steps)
    state = buf.init({"obs": jnp.zeros((H, W, C), jnp.uint8), "reward": jnp.zeros((), jnp.float32)})
    add = jax.jit(buf.add, donate_argnums=0)
    for s in range(0, steps, CHUNK):
        f = np.ascontiguousarray(frames[s:s + CHUNK].transpose(1, 0, 2, 3, 4))  # (E, T, ...)
        state = add(state, {"obs": jnp.asarray(f), "reward": jnp.zeros((envs, f.shape[1]), jnp.float32)})
    return keyed_sampler(jax.jit(buf.sample), state)


def keyed_sampler(sample_fn, state):
    """A call that draws ``sample_fn(state, key)`` with a fresh JAX key each time and waits for it."""
    import jax

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

    steps, envs = frames.shape[:2]

    def tr(f):
        z = jnp.zeros((f.shape[0], envs))
        return JT(observation=jnp.asarray(f), action=z, reward=z, terminated=z.astype(bool), truncated=z.astype(bool))

    buf = JB(envs * steps, SB, tr(frames[:1]), vectorized_env=True, n_steps=SL)
    ins = jax.jit(lambda b, t: b.insert(t))
    for s in range(0, steps, CHUNK):
        buf = ins(buf, tr(frames[s:s + CHUNK]))
    return keyed_sampler(jax.jit(lambda b, k: b.sample(k)), buf)


PEER_BUILDERS = {"torchrl": torchrl_seq, "flashbax": flashbax_seq, "jaxnasium": jaxnasium_seq}


def run(envs: int, steps: int, device: torch.device, repeats: int, peers: Peers) -> list[dict]:
    """Rows for sampling 32x16-step windows (interleaved, blocks of 5 timed calls) plus the copy floor."""
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, size=(steps, envs, H, W, C), dtype=np.uint8)
    fns = gpubuf_seq(frames, device) | peers.build_all(PEER_BUILDERS, frames)
    nbytes = SB * SL * H * W * C
    src = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    fns["copy floor"] = lambda: dst.copy_(src)
    med = median_us(fns, repeats, 5, syncer(device))
    return [{"suite": "replay", "case": f"seq {envs} envs x {steps} steps", "op": f"sample {SB}x{SL} frames",
             "impl": name, "us": us, "bytes": nbytes} for name, us in med.items()]
