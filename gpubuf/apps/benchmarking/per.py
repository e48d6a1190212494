"""Prioritized replay: insert, sample (importance weights) and update ``batch`` transitions on a full buffer.

A transition: obs float32[17], action float32[6], reward float32, terminated, truncated. Peers: cpprb
PrioritizedReplayBuffer, rlox PrioritizedReplayBuffer (a Rust core; one ``push`` per transition, its API),
torchrl PrioritizedReplayBuffer (LazyTensorStorage), flashbax prioritised flat buffer, jaxnasium
PrioritizedTransitionBuffer. Each contender is a dict op -> zero-argument callable."""

import itertools

import numpy as np
import torch

from gpubuf._core.transition import Transition
from gpubuf.apps.benchmarking.peers import Peers
from gpubuf.apps.benchmarking.timing import median_us, syncer
from gpubuf.replay.prioritized import PrioritizedTransitionBuffer
from gpubuf.replay.sampling.units import Unit

OBS, ACT, CHUNK = 17, 6, 2**16
ROW_BYTES = (OBS + ACT + 1) * 4 + 2


def data(n: int, rng: np.random.Generator) -> dict:
    """n transitions: obs (n, 17), act (n, 6), rew (n,), term (n,), trunc (n,)."""
    return {"obs": rng.standard_normal((n, OBS), dtype=np.float32),
            "act": rng.standard_normal((n, ACT), dtype=np.float32), "rew": rng.standard_normal(n, dtype=np.float32),
            "term": np.zeros(n, bool), "trunc": np.zeros(n, bool)}


def chunks(d: dict):
    """The transitions of d in slices of at most CHUNK."""
    n = len(d["rew"])
    for s in range(0, n, CHUNK):
        yield {k: v[s:s + CHUNK] for k, v in d.items()}


def prepared_priorities(n: int, convert=np.asarray):
    """A zero-argument callable giving the next of 16 priority arrays ``(n,)`` in [1e-6, 2), each passed through
    ``convert`` (to the contender's array type) before the clock starts: an update call times the update alone, the
    same way for every contender."""
    arrays = [convert(a) for a in np.random.default_rng(3).random((16, n)) * 2 + 1e-6]
    return itertools.cycle(arrays).__next__


def jax_block(x):
    import jax

    return jax.block_until_ready(x)


def jax_contender(state, insert_fn, sample_fn, update_fn, batch, n: int, index_of) -> dict:
    """insert / sample / update of a functional JAX buffer: each call replaces ``state`` and blocks until ready.

    ``insert_fn(state, batch)``, ``sample_fn(state, key)``, ``update_fn(state, indices, priorities)`` are jitted;
    ``batch`` holds ``n`` transitions; ``index_of(sample)`` -> the sampled indices the next update re-prioritises."""
    import jax

    box = {"state": state, "key": jax.random.PRNGKey(0)}

    def insert():
        box["state"] = jax_block(insert_fn(box["state"], batch))

    def sample():
        box["key"], k = jax.random.split(box["key"])
        out = jax_block(sample_fn(box["state"], k))
        box["idx"] = index_of(out)
        return out

    priorities = prepared_priorities(n, jax.numpy.asarray)

    def update():
        box["state"] = jax_block(update_fn(box["state"], box["idx"], priorities()))

    sample()
    return {"insert": insert, "sample": sample, "update": update}


def gpubuf_per(fill: dict, batch: dict, device: torch.device) -> dict:
    def tr(d):
        return Transition(observation=d["obs"], action=d["act"], reward=d["rew"], terminated=d["term"],
                          truncated=d["trunc"])

    B = len(batch["rew"])
    buf = PrioritizedTransitionBuffer(len(fill["rew"]), B, tr({k: v[:1] for k, v in batch.items()}),
                                      vectorized_env=False, device=device, seed=0)
    for c in chunks(fill):
        buf.insert(tr(c))
    batch_t = tr(batch)
    state = {}
    priorities = prepared_priorities(B, lambda a: torch.as_tensor(a, dtype=torch.float32, device=device))
    gen = torch.Generator(device=device).manual_seed(2)

    def sample(replace=True):
        out = buf.sample(key=gen, with_replacement=replace, unit=Unit.window())
        state["idx"] = out.indices
        return out

    sample()
    return {"insert": lambda: buf.insert(batch_t), "sample": sample, "sample_norepl": lambda: sample(False),
            "update": lambda: buf.update_priorities(state["idx"], priorities())}


def cpprb_per(fill: dict, batch: dict) -> dict:
    import cpprb

    B = len(batch["rew"])
    rb = cpprb.PrioritizedReplayBuffer(len(fill["rew"]),
                                       {"obs": {"shape": OBS}, "act": {"shape": ACT}, "rew": {},
                                                          "term": {}, "trunc": {}}, alpha=0.6,
                                                          eps=1e-6)
    for c in chunks(fill):
        rb.add(**c)
    state = {}
    priorities = prepared_priorities(B)

    def sample():
        out = rb.sample(B, beta=0.4)
        state["idx"] = out["indexes"]
        return out

    sample()
    return {"insert": lambda: rb.add(**batch), "sample": sample,
            "update": lambda: rb.update_priorities(state["idx"], priorities())}


def rlox_per(fill: dict, batch: dict) -> dict:
    import rlox

    B = len(batch["rew"])
    rb = rlox.PrioritizedReplayBuffer(len(fill["rew"]), OBS, ACT, alpha=0.6, beta=0.4)

    def push(d):  # its API takes one transition per call
        push_one = rb.push
        for o, a, r, te, tr in zip(d["obs"], d["act"], d["rew"].tolist(), d["term"].tolist(), d["trunc"].tolist(),
                                   strict=True):
            push_one(o, a, r, te, tr)

    push(fill)
    state, seeds = {}, itertools.count(1)
    priorities = prepared_priorities(B)

    def sample():
        out = rb.sample(B, next(seeds))
        state["idx"] = out["indices"]
        return out

    sample()
    return {"insert": lambda: push(batch), "sample": sample,
            "update": lambda: rb.update_priorities(state["idx"], priorities())}


def torchrl_per(fill: dict, batch: dict) -> dict:
    # the compiled segment trees; benchmarks/setup_peers.sh rebuilds them
    import torchrl._torchrl  # noqa: F401
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, PrioritizedReplayBuffer

    B = len(batch["rew"])
    rb = PrioritizedReplayBuffer(alpha=0.6, beta=0.4, eps=1e-6, storage=LazyTensorStorage(len(fill["rew"])),
                                 batch_size=B)

    def td(d):
        return TensorDict({k: torch.from_numpy(v) for k, v in d.items()}, batch_size=[len(d["rew"])])

    for c in chunks(fill):
        rb.extend(td(c))
    batch_td = td(batch)
    state = {}
    priorities = prepared_priorities(B, lambda a: torch.as_tensor(a, dtype=torch.float32))

    def sample():
        out, info = rb.sample(return_info=True)
        state["idx"] = info["index"]
        return out

    sample()
    return {"insert": lambda: rb.extend(batch_td), "sample": sample,
            "update": lambda: rb.update_priority(state["idx"], priorities())}


def flashbax_per(fill: dict, batch: dict) -> dict:
    import flashbax as fbx
    import jax
    import jax.numpy as jnp

    B = len(batch["rew"])
    buf = fbx.make_prioritised_flat_buffer(max_length=len(fill["rew"]), min_length=B, sample_batch_size=B,
                                           add_sequences=True, add_batch_size=None, priority_exponent=0.6)
    state = buf.init({k: jnp.asarray(v[0]) for k, v in batch.items()})
    add, sample_fn = jax.jit(buf.add, donate_argnums=0), jax.jit(buf.sample)
    set_priorities = jax.jit(buf.set_priorities, donate_argnums=0)
    for c in chunks(fill):
        state = add(state, {k: jnp.asarray(v) for k, v in c.items()})
    return jax_contender(state, add, sample_fn, set_priorities, {k: jnp.asarray(v) for k, v in batch.items()}, B,
                         lambda out: out.indices)


def jaxnasium_per(fill: dict, batch: dict) -> dict:
    import jax
    import jax.numpy as jnp
    from jaxnasium.algorithms.core import PrioritizedTransitionBuffer as JPB
    from jaxnasium.algorithms.core import Transition as JT

    def tr(d):
        return JT(observation=jnp.asarray(d["obs"]), action=jnp.asarray(d["act"]), reward=jnp.asarray(d["rew"]),
                  terminated=jnp.asarray(d["term"]), truncated=jnp.asarray(d["trunc"]))

    B = len(batch["rew"])
    buf = JPB(len(fill["rew"]), B, tr({k: v[:1] for k, v in batch.items()}), vectorized_env=False)
    ins = jax.jit(lambda b, t: b.insert(t))
    smp = jax.jit(lambda b, k: b.sample(k, with_replacement=True))
    upd = jax.jit(lambda b, i, td: b.update_priorities(i, td))
    for c in chunks(fill):
        buf = ins(buf, tr(c))
    # indices ride on the batch
    return jax_contender(buf, ins, smp, upd, tr(batch), B, lambda out: out.PER_index)


PEER_BUILDERS = {"cpprb": cpprb_per, "rlox": rlox_per, "torchrl": torchrl_per, "flashbax": flashbax_per,
                 "jaxnasium": jaxnasium_per}


def run(log2_capacity: int, batch: int, device: torch.device, repeats: int, peers: Peers) -> list[dict]:
    """Rows for insert / sample / update of ``batch`` transitions on a full buffer of ``2**log2_capacity``.

    Each op interleaves every contender (blocks of 5 timed calls) plus the copy floor of its output bytes."""
    rng = np.random.default_rng(0)
    fill, batch_d = data(2**log2_capacity, rng), data(batch, rng)
    contenders = {"gpubuf": gpubuf_per(fill, batch_d, device)} | peers.build_all(PEER_BUILDERS, fill, batch_d)
    src = torch.zeros(batch, ROW_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    rows = []
    for op in ("insert", "sample", "update"):
        fns = {name: c[op] for name, c in contenders.items()}
        if op == "sample":
            fns = {"gpubuf": fns.pop("gpubuf"), "gpubuf (no replacement)": contenders["gpubuf"]["sample_norepl"]} | fns
        fns["copy floor"] = lambda: dst.copy_(src)
        med = median_us(fns, repeats, 5, syncer(device))
        rows += [{"suite": "replay", "case": f"PER N=2**{log2_capacity}", "op": f"{op} {batch}",
                  "impl": name, "us": us, "bytes": batch * ROW_BYTES} for name, us in med.items()]
    return rows
