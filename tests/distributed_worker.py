"""The rank side of tests/replay/test_distributed.py: every scenario runs here, in one gloo process group on CPU, and
each rank saves what it saw (``rank<i>.pt``) for the test process to check.

Four processes run every scenario twice: once over the whole group (4 shards), then over two disjoint
subgroups of 2 (ranks 0-1 and 2-3) at the same time, which also exercises the ``group`` argument.

Data: shard ``r`` writes ``8 + 5 r`` rows per env (shard 3 wraps around); observation ``[v, -v]`` with
``v = r * 1e6 + t * E + e`` (``t``: the shard's step counter, ``e``: the env), so every window says which
shard, step and env it came from. Shard 1 truncates env 0 at step 4.

``GPUBUF_TEST_DIST_DEVICE=cuda`` puts every shard on the GPU (benchmarks/device_check.sh runs it so); the
results are saved as CPU tensors either way.
"""

import os
import warnings
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from gpubuf import PrioritizedTransitionBuffer, Transition, TransitionBuffer, Unit
from gpubuf.replay.sharded.buffer import ShardedBuffer

E, M, N_STEPS = 3, 20, 3
DEVICE = os.environ.get("GPUBUF_TEST_DIST_DEVICE", "cpu")  # "cuda": every shard on the GPU (gloo stages via host)
S = E * M  # start slots per shard
BIG = 1_000_000


def rows(rank: int, t0: int, T: int) -> Transition:
    t = np.arange(t0, t0 + T)[:, None]
    v = rank * BIG + t * E + np.arange(E)[None, :]
    trunc = np.zeros((T, E), dtype=bool)
    if rank == 1 and t0 <= 4 < t0 + T:
        trunc[4 - t0, 0] = True
    return Transition(observation=np.stack([v, -v], -1).astype(np.float64),
                      action=(t % 100 + np.zeros((1, E), dtype=np.int64)).astype(np.int16),
                      reward=v.astype(np.float32), terminated=np.zeros((T, E), dtype=bool), truncated=trunc,
                      info={"step": np.repeat(t, E, 1).astype(np.int32)})


def filled(cls, rank: int, seed: int, **kw):
    buf = cls(S, 4, rows(rank, 0, 1), n_steps=N_STEPS, device=DEVICE, seed=seed, **kw)
    total, t0 = 8 + 5 * rank, 0
    while t0 < total:
        T = min(12, total - t0)
        buf.insert(rows(rank, t0, T))
        t0 += T
    return buf


def caught(fn) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as err:  # recorded for the test process to check
        return type(err).__name__, str(err)
    return None


def windows(batch: Transition) -> dict:
    out = {"obs": batch.observation.clone(), "step": batch.info["step"].clone(), "action": batch.action.clone(),
           "reward": batch.reward.clone(), "terminated": batch.terminated.clone(), "truncated": batch.truncated.clone()}
    if batch.next_observation is not None:
        out["next_obs"] = batch.next_observation.clone()
    if batch.is_first is not None:
        out["is_first"], out["mask"] = batch.is_first.clone(), batch.mask.clone()
    return out


def scenarios(group, tmp: str) -> dict:
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    res: dict = {"rank": rank, "W": W}
    uni = ShardedBuffer(filled(TransitionBuffer, rank, seed=10 + rank), group)
    per = ShardedBuffer(filled(PrioritizedTransitionBuffer, rank, seed=20 + rank, alpha=0.7, beta=0.5), group)
    res["num_valid"] = (uni.num_valid(False), uni.num_valid(True), per.num_valid(False))
    res["local_valid"] = (uni.local.num_valid(False), uni.local.num_valid(True))
    res["mass_uniform"] = (uni.local.sampling_mass(False), uni.local.sampling_mass(True))

    # uniform, with replacement: the same int key on every rank (mixed with the rank)
    res["uni_wr"] = windows(uni.sample(key=1000, batch_size=300))
    res["uni_wr_next"] = windows(uni.sample(key=1001, batch_size=200, with_next_obs=True))
    # uniform, without replacement: every valid start once
    res["uni_all"] = windows(uni.sample(key=1002, with_replacement=False, batch_size=res["num_valid"][0]))

    # priority updates routed to their owners, from every rank, duplicates included
    g = np.random.default_rng(rank)
    idx = g.integers(0, W * S, size=40)
    idx[:3] = idx[3]  # a duplicate within one call
    td = g.normal(size=40).astype(np.float32) * 3
    res["prio_before"] = per.local.sampler.priority.clone()
    per.update_priorities(idx, td)
    res["updates"] = (idx, td)
    res["prio_after"] = per.local.sampler.priority.clone()
    res["max_priority"] = per.max_priority
    res["mass_per"] = per.local.sampling_mass(False)

    batch, gidx = per.sample(key=7, with_replacement=True, batch_size=400)
    res["per_wr"] = dict(windows(batch), idx=gidx, w=batch.PER_weights)
    batch, gidx = per.sample(key=8, with_replacement=True, batch_size=50, with_next_obs=True)
    res["per_wr_next"] = dict(windows(batch), idx=gidx, w=batch.PER_weights)
    pairs = [per.sample(key=100 + i, batch_size=2)[1] for i in range(100)]  # default: without replacement
    res["per_pairs"] = torch.stack(pairs)
    batch, gidx = per.sample(key=9, batch_size=res["num_valid"][2])
    res["per_all"] = dict(windows(batch), idx=gidx, w=batch.PER_weights)
    batch, gidx = per.sample(key=None, batch_size=4)  # the shard's own generator
    res["per_none"] = dict(windows(batch), idx=gidx)

    # bad arguments: every rank raises, and the group still works afterwards
    last = W - 1
    res["bad_batch"] = caught(lambda: uni.sample(batch_size=0 if rank == 1 else 5))
    res["bad_key"] = caught(lambda: per.sample(key="seed" if rank == last else 1, batch_size=3))
    res["bad_next_obs"] = caught(lambda: uni.sample(with_next_obs=rank == 0))
    res["bad_replacement"] = caught(lambda: uni.sample(with_replacement=rank != 0))
    res["too_many"] = caught(lambda: per.sample(batch_size=10**6 if rank == 0 else 2))
    res["bad_index"] = caught(lambda: per.update_priorities([W * S if rank == 0 else 0], [1.0]))
    res["bad_td"] = caught(lambda: per.update_priorities([0, 1], [1.0] if rank == last else [1.0, 2.0]))
    res["nan_td"] = caught(lambda: per.update_priorities([0], [float("nan") if rank == last else 1.0]))
    res["uniform_update"] = caught(lambda: uni.update_priorities([0], [1.0]))
    res["no_placeholder"] = caught(lambda: per.save(os.path.join(tmp, "shard.ckpt")))
    res["after_bad"] = (uni.num_valid(), per.max_priority, res["max_priority"])
    res["empty_update"] = caught(lambda: per.update_priorities([], []))

    # the buffers' shared sample signature: what a sharded sample does not offer is refused by name
    refused = {"out": uni.sample(key=1, batch_size=2), "return_indices": True, "frame_stack": 2, "frame_stride": 2,
               "n_step_return": (3, 0.99)}
    res["refused"] = {arg: caught(lambda arg=arg, v=v: uni.sample(batch_size=2, **{arg: v}))
                      for arg, v in refused.items()}
    alone = per.sample(key=14, batch_size=2, return_indices=False)
    res["per_batch_alone"] = (type(alone).__name__, tuple(alone.PER_weights.shape))
    res["refused_one_rank"] = caught(lambda: per.sample(batch_size=2, frame_stack=4 if rank == last else None))
    # the new call: a Batch with global indices and weights when prioritized, neither when uniform
    got = per.sample(key=15, batch_size=2, unit=Unit.transition())
    res["per_batch"] = (type(got).__name__, tuple(got.indices.shape), tuple(got.weights.shape), got.generations,
                        got.next_observation is not None)
    got = uni.sample(key=16, batch_size=2)
    res["uni_batch"] = (type(got).__name__, got.indices, got.weights, tuple(got.observation.shape))
    res["refused_unit"] = caught(lambda: uni.sample(batch_size=2, unit=Unit.frames(2)))
    res["defaults_given"] = (len(per.sample(key=12, batch_size=2, return_indices=True, frame_stride=1)),
                             uni.sample(key=13, batch_size=2, return_indices=False, out=None).observation.shape[0])

    # episode boundaries, as the local buffers draw them
    res["num_valid_forbid"] = (uni.num_valid(True, "forbid"), uni.local.num_valid(True, "forbid"))
    res["uni_mask"] = windows(uni.sample(key=1003, batch_size=200, boundaries="mask"))
    res["uni_forbid"] = windows(uni.sample(key=1004, batch_size=200, with_next_obs=True, boundaries="forbid"))
    batch, gidx = per.sample(key=11, batch_size=res["num_valid_forbid"][0], boundaries="forbid", with_next_obs=True)
    res["per_forbid_all"] = dict(windows(batch), idx=gidx)
    res["bad_boundaries"] = caught(lambda: uni.sample(boundaries="never" if rank == last else "mask"))
    res["split_boundaries"] = caught(lambda: uni.sample(boundaries="mask" if rank == 0 else "forbid"))

    # configurations that disagree
    res["bad_n_steps"] = caught(lambda: ShardedBuffer(TransitionBuffer(
        S, 4, rows(rank, 0, 1), n_steps=2 if rank == last else N_STEPS, device=DEVICE), group))
    res["bad_alpha"] = caught(lambda: ShardedBuffer(PrioritizedTransitionBuffer(
        S, 4, rows(rank, 0, 1), alpha=0.5 if rank == last else 0.7, device=DEVICE), group))
    res["bad_local"] = caught(lambda: ShardedBuffer(object() if rank == 0 else uni.local, group))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ShardedBuffer(TransitionBuffer(S, 4, rows(rank, 0, 1), device=DEVICE, seed=5), group)
    res["same_seed_warning"] = [str(w.message) for w in seen]

    # save / load per rank
    path = os.path.join(tmp, "shard{rank}.ckpt")
    per.save(path)
    fresh = ShardedBuffer(PrioritizedTransitionBuffer(S, 4, rows(rank, 0, 1), n_steps=N_STEPS, alpha=0.7,
                                                      device=DEVICE, seed=rank), group)
    fresh.load(path)
    res["reloaded"] = (bool(torch.equal(fresh.local.sampler.priority, per.local.sampler.priority)),
                       bool(torch.equal(fresh.local.state_dict()["data"]["observation"],
                                        per.local.state_dict()["data"]["observation"])),
                       fresh.max_priority == per.max_priority)
    res["missing_file"] = caught(lambda: fresh.load(os.path.join(tmp, "nothing{rank}.ckpt") if rank == 0 else path))
    return res


def few_starts(group) -> dict:
    """Three starts per shard, one of them dominant: batches of 4 without replacement need several rounds."""
    rank = dist.get_rank(group)
    obs = np.float64(rank * BIG) + np.arange(3.0)[:, None]
    local = PrioritizedTransitionBuffer(3, 3, Transition(obs, None, None, None, None), vectorized_env=False,
                                        alpha=1.0, device=DEVICE, seed=rank)
    sharded = ShardedBuffer(local.insert(Transition(obs, None, None, None, None)), group)
    sharded.update_priorities(rank * 3 + np.arange(3), [60.0, 1.0, 2.0] if rank == 0 else [rank, 2.0, 3.0])
    draws = [sharded.sample(key=5000 + i, batch_size=4)[1] for i in range(200)]
    return {"mass": local.sampling_mass(), "draws": torch.stack(draws)}


def edge_cases(group, tmp: str) -> dict:
    """Leaf orders that differ between shards, one-window batches of unaligned rows, a load failing on one rank."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    res = {}

    def data(T):  # info keys in another order on odd ranks; a 3-byte observation puts every later leaf unaligned
        a, b = np.full((T, E), 1.5, np.float32), np.full((T, E), 7, np.int32)
        return Transition(observation=np.full((T, E, 3), rank, np.uint8), action=np.ones((T, E), np.float32),
                          reward=np.ones((T, E), np.float64), terminated=np.zeros((T, E), bool),
                          truncated=np.zeros((T, E), bool), info={"a": a, "b": b} if rank % 2 else {"b": b, "a": a})

    uni = ShardedBuffer(TransitionBuffer(E * 8, 4, data(1), device=DEVICE, seed=rank).insert(data(8)), group)
    per = ShardedBuffer(PrioritizedTransitionBuffer(E * 8, 4, data(1), device=DEVICE, seed=rank).insert(data(8)),
                        group)
    batch = uni.sample(key=1, batch_size=64)
    res["info_order"] = (list(batch.info), batch.observation[:, 0].unique(), batch.info["a"].unique(),
                         batch.info["b"].unique())
    res["one_window"] = [uni.sample(key=2, batch_size=1), per.sample(key=3, batch_size=1, with_replacement=True),
                         per.sample(key=4, batch_size=1, with_replacement=False)]

    # a collective load that fails on the last rank: max_priority stays the same everywhere
    path = os.path.join(tmp, "edge{rank}.ckpt")
    per.local.update_priorities([0], [10.0 * (rank + 1)])
    if rank == W - 1:
        PrioritizedTransitionBuffer(E * 8 + E, 4, data(1), device=DEVICE).save(path.format(rank=rank))
    else:
        per.local.save(path.format(rank=rank))
    fresh = ShardedBuffer(PrioritizedTransitionBuffer(E * 8, 4, data(1), device=DEVICE, seed=rank), group)
    res["failed_load"] = caught(lambda: fresh.load(path))
    res["max_after_failed_load"] = fresh.max_priority
    return res


LAST_T = 10


def last_rows(group) -> dict:
    """Shards of EnvPoolSource-style rows (an ``info["is_last"]`` leaf, with ``truncated`` on the same rows):
    shard ``r`` marks env ``r % E`` at steps 3 and 7. Such rows never start a window; mask windows reset after."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    t = np.arange(LAST_T)[:, None]
    v = rank * BIG + t * E + np.arange(E)[None, :]
    last = (t % 4 == 3) & (np.arange(E)[None, :] == rank % E)
    tr = Transition(observation=np.stack([v, -v], -1).astype(np.float64), action=None, reward=None,
                    terminated=np.zeros_like(last), truncated=last, info={"is_last": last})
    uni = ShardedBuffer(TransitionBuffer(S, 4, tr, n_steps=N_STEPS, device=DEVICE, seed=rank).insert(tr), group)
    per = ShardedBuffer(PrioritizedTransitionBuffer(S, 4, tr, n_steps=N_STEPS, device=DEVICE, seed=rank).insert(tr),
                        group)
    n_ok = W * ((LAST_T - N_STEPS + 1) * E - 2)  # every shard: two starts hold a last row
    out = {}
    for name, buf, kw in (("uni", uni, {}), ("uni_all", uni, {"with_replacement": False, "batch_size": n_ok}),
                          ("per", per, {"with_replacement": True}), ("per_all", per, {"batch_size": n_ok})):
        res = buf.sample(key=40 + len(out), boundaries="mask", **({"batch_size": 120} | kw))
        batch = res[0] if isinstance(res, tuple) else res
        out[name] = {"obs": batch.observation[..., 0].clone(), "is_first": batch.is_first.clone(),
                     "mask": batch.mask.clone(), "is_last": batch.info["is_last"].clone()}
    out["too_many"] = caught(lambda: uni.sample(batch_size=n_ok + 1, with_replacement=False, boundaries="mask"))
    return out


def main(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Entry point of each spawned process."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        results = {}
        for name, group in (("world", None), ("pair", pairs[rank // 2])):
            tmp = os.path.join(out_dir, f"{name}{rank // 2 if group is not None else ''}")
            os.makedirs(tmp, exist_ok=True)
            results[name] = scenarios(group, tmp)
            results[name]["few"] = few_starts(group)
            results[name]["edge"] = edge_cases(group, tmp)
            results[name]["last"] = last_rows(group)
        cpu = torch.utils._pytree.tree_map(lambda x: x.cpu() if isinstance(x, torch.Tensor) else x, results)
        torch.save(cpu, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:  # an exception reaches the test process with its traceback (torch.multiprocessing)
        dist.destroy_process_group()
