"""Dropping a buffer, sampler, writer or source frees what it holds at once, with Python's cyclic collector off.

No object of the library sits in a reference cycle (back-pointers are weak, cached closures hold no ``self``), so
the last reference gone frees the storage tensors (a GPU buffer's memory comes back before the next one is built)
and releases a ``storage_dir``'s lock: the directory re-opens by path in this process and in a fresh one. Every
case runs with ``gc`` disabled: a weak reference to each storage tensor must die the moment the object is dropped.
Each object is used first (inserts, samples, priority updates, deferred ones, writers' commits, ...), since the
caches those calls build are where cycles hid.
"""

import collections
import gc
import importlib.util
import os
import subprocess
import sys
import textwrap
import weakref

import numpy as np
import pytest
import torch
from fixtures import make_transition

from gpubuf import HistoryBuffer, PlanConfig, Planner, PrioritizedTransitionBuffer, RateLimiter, TransitionBuffer
from gpubuf.replay.sampling.selectors import Fifo, Lifo, Mixture, Online, Recency

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

E = 2


@pytest.fixture
def no_gc():
    """The cyclic collector off for the test: only reference counts free anything."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def cycles() -> str:
    """What the cyclic collector finds now (the members of the cycles that kept something alive), for a failure."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        kinds = collections.Counter(type(o).__qualname__ for o in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    return ", ".join(f"{k} x{n}" for k, n in kinds.most_common(25))


def watch(*objects) -> list:
    """Weak references to ``objects`` and to every storage tensor (and sampler tensor) of the buffers among them."""
    held = []
    for o in objects:
        held.append(o)
        if hasattr(o, "storage") and hasattr(o.storage, "tensors"):
            held += [*o.storage.tensors(), *o.sampler.tensors()]
    return [weakref.ref(o) for o in held]


def assert_freed(refs: list) -> None:
    alive = [type(r()).__name__ for r in refs if r() is not None]
    assert not alive, f"still alive after the drop: {alive}; reference cycles: {cycles()}"


def buffer(cls, device, path=None, vec=True, tier="device", n_steps=1, **kw):
    n = E if vec else 1
    if tier == "host":
        kw["storage_device"] = "cpu"
    if tier == "dir":
        kw["storage_dir"] = path
    return cls(n * 32, 4, make_transition(0, 1, n, vectorized=vec), vectorized_env=vec, n_steps=n_steps,
               device=device, seed=0, **kw)


def use(buf) -> None:
    """The calls that build a buffer's caches: inserts, samples of every kind, priority updates (deferred too)."""
    vec, n = buf.vectorized_env, buf.n_envs if buf.vectorized_env else 1
    buf.insert(make_transition(0, 12, n, vectorized=vec, trunc_steps=(5,)))
    buf.sample()
    buf.sample(batch_size=4, with_next_obs=True)
    if buf.selector is None or not buf.selector.replacement_only:
        buf.sample(batch_size=4, with_replacement=False)
    if buf.n_steps > 1:
        buf.sample(boundaries="mask")
    elif vec:
        buf.sample(frame_stack=2, n_step_return=(2, 0.9))
    if buf.selector is not None and buf.selector.queue:
        buf.num_unserved()
    if buf.sampler.prioritized:
        _, idx = buf.sample(return_indices=True)
        buf.update_priorities(idx, torch.ones(idx.shape))
        buf.update_priorities(idx, torch.ones(idx.shape, device=idx.device), deferred=True)
        buf.check_updates()
        assert buf.max_priority >= 1.0
    buf.state_dict()
    assert len(buf) and buf.nbytes


PER = PrioritizedTransitionBuffer
BUFFERS = {  # name -> buffer() arguments
    "uniform": (TransitionBuffer, {}),
    "uniform not vectorized": (TransitionBuffer, {"vec": False}),
    "uniform host": (TransitionBuffer, {"tier": "host"}),
    "uniform storage_dir": (TransitionBuffer, {"tier": "dir"}),
    "uniform windows": (TransitionBuffer, {"n_steps": 3}),
    "prioritized": (PER, {}),
    "prioritized not vectorized": (PER, {"vec": False}),
    "prioritized host": (PER, {"tier": "host"}),
    "prioritized storage_dir": (PER, {"tier": "dir"}),
    "prioritized storage_dir not vectorized": (PER, {"tier": "dir", "vec": False}),
    "prioritized windows storage_dir": (PER, {"tier": "dir", "n_steps": 3}),
    "Recency": (TransitionBuffer, {"selector": Recency}),
    "Mixture": (PER, {"selector": lambda: Mixture(uniform=0.5, prioritized=0.25, recency=0.25)}),
    "Online": (TransitionBuffer, {"selector": Online}),
    "Online(Recency) storage_dir": (PER, {"selector": lambda: Online(Recency()), "tier": "dir"}),
    "Online(Mixture)": (PER, {"selector": lambda: Online(Mixture(uniform=1, recency=1))}),
    "Fifo": (TransitionBuffer, {"selector": Fifo}),
    "Lifo storage_dir": (PER, {"selector": Lifo, "tier": "dir"}),
    "rate limiter": (TransitionBuffer, {"rate_limiter": lambda: RateLimiter(1.0, 4, -1000.0, 1000.0)}),
    "rate limiter storage_dir not vectorized": (PER, {"rate_limiter": lambda: RateLimiter(1.0, 4, -1000.0, 1000.0),
                                                      "tier": "dir", "vec": False}),
}


def build(name, device, path):
    """The buffer ``name`` (fresh selectors and limiters), and the function re-opening its directory by path."""
    cls, kw = BUFFERS[name]
    kw = {k: (v() if callable(v) and k in ("selector", "rate_limiter") else v) for k, v in kw.items()}
    return buffer(cls, device, path, **kw)


def reopens(name, device, path) -> None:
    """The directory of a dropped buffer ``name`` opens again by path (its lock was released)."""
    if BUFFERS[name][1].get("tier") == "dir":
        again = build(name, device, path)
        assert len(again) > 0
        again.close()


@pytest.mark.parametrize("name", list(BUFFERS))
def test_a_buffer_dropped_after_sampling_frees_its_storage_and_directory_at_once(name, backend, device, tmp_path,
                                                                                no_gc):
    buf = build(name, device, tmp_path / "d")
    use(buf)
    refs = watch(buf)
    del buf
    assert_freed(refs)
    reopens(name, device, tmp_path / "d")


@pytest.mark.parametrize("name", ["uniform", "prioritized storage_dir", "Recency", "Mixture"])
@pytest.mark.parametrize("minibatches", [1, 2])
def test_a_graph_sampler_dropped_with_its_buffer_frees_both(name, minibatches, backend, device, tmp_path, no_gc):
    buf = build(name, device, tmp_path / "d")
    buf.insert(make_transition(0, 12, E))
    gs = buf.graph_sampler(4, minibatches=minibatches)
    out, idx = gs.sample()
    if gs.prioritized:
        gs.update_priorities(idx, torch.ones(idx.shape, device=idx.device))
        gs.check_updates()
    refs = watch(buf, gs)
    del buf  # the sampler holds its buffer
    assert refs[0]() is not None
    del gs, out, idx
    assert_freed(refs)
    reopens(name, device, tmp_path / "d")


def learner_step(gs):
    def step():
        out, idx = gs.sample()
        td = out.observation.float().reshape(idx.shape[0], -1).mean(-1) - 1.0
        if gs.prioritized:
            gs.update_priorities(idx, td.detach())
        return (td**2).mean()

    return step


@pytest.mark.parametrize("name", ["uniform", "prioritized", "Recency"])
def test_a_compiled_learner_step_dropped_with_its_buffer_frees_it(name, device, tmp_path, no_gc):
    """The device's own backend (traced through the ops' torch.library registrations: on a GPU the Triton kernels;
    Triton's interpreter on the host is not traced)."""
    buf = build(name, device, tmp_path / "d")
    buf.insert(make_transition(0, 12, E))
    gs = buf.graph_sampler(4)
    step = torch.compile(learner_step(gs), backend="eager", fullgraph=True)
    step()
    step()
    refs = watch(buf, gs)
    del buf, gs, step
    assert_freed(refs)


@pytest.mark.parametrize("name", ["uniform", "prioritized storage_dir", "rate limiter",
                                  "rate limiter storage_dir not vectorized"])
def test_a_buffer_with_writers_dropped_frees_its_storage(name, backend, device, tmp_path, no_gc):
    buf = build(name, device, tmp_path / "d")
    vec = buf.vectorized_env
    writer, kept = buf.writer(rows=8), buf.writer(rows=8) if not vec else None
    writer.insert(make_transition(0, 8, E if vec else 1, vectorized=vec))
    buf.collect()
    buf.sample()
    buf.can_sample()
    writer.close()
    buf.collect()
    refs = watch(buf)
    del buf  # a writer the owner still holds (as an actor would) keeps no buffer alive
    assert_freed(refs)
    reopens(name, device, tmp_path / "d")
    del writer, kept


def test_a_history_buffer_and_a_planner_dropped_free_their_tensors(backend, device, no_gc):
    hist = HistoryBuffer(E, 8, 2, ("action",), device=device)
    for t in range(5):
        hist.append({"observation": torch.full((E, 3), float(t)), "action": torch.zeros(E, 1)})
    hist.get(3)
    hist.get(2, env_ids=[1])
    hist.reset([0])
    planner = Planner(PlanConfig(horizon=3, receding_horizon=2, history_len=2),
                      lambda history, env_ids: torch.zeros(len(env_ids), 3, 1), n_envs=E, action_dim=1, device=device)
    for t in range(4):
        planner.act({"observation": torch.full((E, 1, 2), float(t)), "action": torch.zeros(E, 1, 1)})
    refs = watch(hist, planner, *hist._schema.data.values())  # noqa: SLF001 (the history's storage)
    del hist, planner
    assert_freed(refs)


def _torch_sim_rows(src, final_obs: bool, steps: int = 10):
    """Steps of a small batched torch simulator whose envs reset inside the step that ends them."""
    g = torch.Generator().manual_seed(0)
    state, t = torch.zeros(E, 2), torch.zeros(E, dtype=torch.int64)
    src.reset(state.clone())
    for _ in range(steps):
        act = torch.rand(E, 1, generator=g) * 2 - 1
        after = state + torch.cat([act, act], 1) * 0.3
        t += 1
        terminated, truncated = after[:, 0].abs() > 1, t >= 4
        ended = terminated | truncated
        state = after.clone()
        state[ended], t[ended] = 0.0, 0
        src.step(act, state.clone(), -after[:, 0].abs(), terminated, truncated & ~terminated,
                 final_obs=after if final_obs else None)


def _imports(kind: str) -> None:
    """The source's modules, imported before anything is built: a first import leaves cyclic garbage that holds the
    frames it ran under (and their locals) until the collector runs."""
    pytest.importorskip("gymnasium")
    if kind == "EnvPoolSource":
        pytest.importorskip("envpool")
    import gpubuf.sources.tensors
    import gpubuf.sources.vector_env  # noqa: F401


def _source(kind: str, device, history):
    import gymnasium as gym

    if kind.startswith("TensorSource"):
        from gpubuf.sources.tensors import TensorSource

        box = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
        return TensorSource(E, box, gym.spaces.Box(-1.0, 1.0, (1,), np.float32), final_obs="final" in kind,
                            device=device, history=history)
    if kind == "EnvPoolSource":
        import envpool

        from gpubuf import EnvPoolSource

        env = envpool.make("CartPole-v1", env_type="gymnasium", num_envs=E, batch_size=E, seed=0)
        return EnvPoolSource(env, device=device, history=history)
    from gymnasium.vector import AutoresetMode

    from gpubuf.sources.vector_env import VectorEnvSource

    mode = AutoresetMode.SAME_STEP if "same" in kind else AutoresetMode.NEXT_STEP
    env = gym.make_vec("CartPole-v1", E, vectorization_mode="sync", vector_kwargs={"autoreset_mode": mode})
    return VectorEnvSource(env, device=device, history=history)


SOURCES = ["TensorSource final_obs", "TensorSource", "VectorEnvSource next-step", "VectorEnvSource same-step",
           "EnvPoolSource"]


@pytest.mark.parametrize("kind", SOURCES)
@pytest.mark.parametrize("tier", ["device", "dir"])
def test_a_source_dropped_frees_the_buffers_it_wrote(kind, tier, backend, device, tmp_path, no_gc):
    _imports(kind)
    history = HistoryBuffer(E, 8, 1, device=device)
    src = _source(kind, device, history)
    vec = "final_obs" not in kind
    kw = {"storage_dir": tmp_path / "d"} if tier == "dir" else {}
    buf = PER(64, 4, src.transition_sample(vec), vectorized_env=vec, device=device, seed=0, **kw)
    src.transitions = buf
    if kind.startswith("TensorSource"):
        _torch_sim_rows(src, "final_obs" in kind)
    else:
        src.reset()
        for _ in range(12):
            src.step(np.arange(E) % 2)
    buf.sample()
    history.get(2)
    refs = watch(src, buf, history)
    del buf, history  # the source holds both
    del src
    assert_freed(refs)
    if tier == "dir":
        PER(64, 4, _source(kind, device, None).transition_sample(vec), vectorized_env=vec, device=device,
            storage_dir=tmp_path / "d").close()


@pytest.fixture
def one_rank_group(tmp_path):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("torch.distributed unavailable or in use")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("name", ["uniform storage_dir", "prioritized"])
def test_a_sharded_buffer_dropped_frees_its_shard(name, one_rank_group, backend, device, tmp_path, no_gc):
    from gpubuf import ShardedBuffer

    sharded = ShardedBuffer(build(name, device, tmp_path / "d"))
    sharded.insert(make_transition(0, 12, E))
    sharded.sample()
    if sharded.local.sampler.prioritized:
        _, idx = sharded.sample(return_indices=True)
        sharded.update_priorities(idx, torch.ones(idx.shape))
    sharded.num_valid()
    refs = watch(sharded, sharded.local)
    del sharded
    assert_freed(refs)
    reopens(name, device, tmp_path / "d")


TORCHRL_SAMPLERS = ["random", "prioritized", "slices", "prioritized slices"]


def _torchrl_imports() -> None:  # before anything is built (see _imports)
    pytest.importorskip("torchrl")
    import gpubuf.torchrl  # noqa: F401


def _torchrl_buffer(sampler: str, tier: str, device, path):
    from tensordict import TensorDict
    from torchrl.data import TensorDictReplayBuffer

    from gpubuf.torchrl import PrioritizedSampler, PrioritizedSliceSampler, ReplayStorage, SliceSampler

    made = {"random": lambda: None, "prioritized": lambda: PrioritizedSampler(60, 0.7, 0.5),
            "slices": lambda: SliceSampler(slice_len=4, traj_key="episode"),
            "prioritized slices": lambda: PrioritizedSliceSampler(60, 0.7, 0.5, slice_len=4, traj_key="episode")}
    kw = {"storage_dir": path} if tier == "dir" else {"storage_device": "cpu"} if tier == "host" else {}
    storage = ReplayStorage(60, device=device, **kw)
    s = made[sampler]()
    rb = TensorDictReplayBuffer(storage=storage, batch_size=8, **({} if s is None else {"sampler": s}))
    r = torch.arange(45)
    rb.extend(TensorDict({"obs": r.float(), "episode": r // 7}, batch_size=[45]))
    if sampler.startswith("prioritized"):
        rb.update_priority(torch.arange(45), torch.linspace(0.1, 3.0, 45))
    rb.sample()
    rb.sample()
    return rb, storage, s


@pytest.mark.parametrize("sampler", TORCHRL_SAMPLERS)
@pytest.mark.parametrize("tier", ["device", "host", "dir"])
def test_a_torchrl_buffer_on_a_replay_storage_dropped_frees_it(sampler, tier, backend, device, tmp_path, no_gc):
    _torchrl_imports()
    rb, storage, s = _torchrl_buffer(sampler, tier, device, tmp_path / "d")
    rows = storage._storage.values(True, True)  # noqa: SLF001 (the storage's own tensors)
    refs = watch(rb, storage, *rows, *([] if s is None else [s]))
    del rows
    del rb, storage, s  # torchrl's storage lists the buffers on it: held weakly by ReplayStorage
    assert_freed(refs)
    if tier == "dir":
        from gpubuf.torchrl import ReplayStorage

        again = ReplayStorage(60, storage_dir=tmp_path / "d")
        assert len(again) == 45
        again.close()


REOPEN = """
import sys, numpy as np
sys.path.insert(0, {tests!r})
from fixtures import make_transition
from gpubuf import PrioritizedTransitionBuffer, TransitionBuffer
for cls, path in [(TransitionBuffer, {uniform!r}), (PrioritizedTransitionBuffer, {per!r})]:
    buf = cls(2 * 32, 4, make_transition(0, 1, 2), storage_dir=path)
    assert len(buf) == 24, len(buf)
    buf.close()
{torchrl}
print("reopened")
"""
TORCHRL_REOPEN = """
from gpubuf.torchrl import ReplayStorage
storage = ReplayStorage(60, storage_dir={path!r})
assert len(storage) == 45
storage.close()
"""


def test_directories_of_dropped_buffers_reopen_in_a_fresh_process_while_this_one_lives(device, tmp_path, no_gc):
    paths = {"uniform": str(tmp_path / "uniform"), "per": str(tmp_path / "per")}
    for name, path in (("uniform storage_dir", paths["uniform"]), ("prioritized storage_dir", paths["per"])):
        buf = build(name, device, path)
        use(buf)
        del buf
    torchrl = ""
    if importlib.util.find_spec("torchrl") is not None:
        _torchrl_imports()
        rb = _torchrl_buffer("prioritized slices", "dir", device, tmp_path / "rl")
        del rb
        torchrl = TORCHRL_REOPEN.format(path=str(tmp_path / "rl"))
    code = REOPEN.format(tests=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), torchrl=torchrl, **paths)
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "reopened" in run.stdout, run.stderr[-3000:]
