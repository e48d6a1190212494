"""Bytes per stored transition, and transitions per 80 GiB, of gpubuf and its peers for two configurations.

    python benchmarks/bench_memory.py [--out benchmarks/results/memory_cpu.json]

- ``state``: a humanoid at Isaac Lab scale as FlashSAC trains it (1024 envs, 10,000,000 transitions, n-step 3,
  uniform replay): observation 123 float32 and action 37 float32 (Isaac Lab's G1 flat-terrain velocity task);
- ``pixels``: Atari-style 84x84 uint8 frames, frame stack 4, n-step 3, a discrete (int64) action.

Each contender is built at a small size on the CPU and its allocation measured (``nbytes`` of every array it
allocated, divided by the transitions it holds), except where it does not install from PyPI: those rows say
"formula" and count the arrays its source allocates per transition. gpubuf's bytes include its sampling structures
(``memory_plan``: the prefix-sum tree and mask of the one validity kind sampled, the episode marks n-step returns
read), checked against the real allocation (``buffer.nbytes``). Memory, unlike time, does not depend on a quiet
machine."""

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch

from gpubuf import Transition, TransitionBuffer, Unit

GIB80 = 80 * 2**30
SMALL = 4096  # transitions each contender is built with
CONFIGS = {"state": {"obs": (123,), "obs_dtype": np.float32, "act": (37,), "act_dtype": np.float32, "stack": 1},
           "pixels": {"obs": (84, 84), "obs_dtype": np.uint8, "act": (), "act_dtype": np.int64, "stack": 4}}


def gpubuf_row(cfg: dict, storage_dtypes=None) -> float:
    """gpubuf: single frames stored once (stacks and next observations built at sample time), n-step 3 returns."""
    E = 8
    sample = Transition(observation=np.zeros((1, E, *cfg["obs"]), cfg["obs_dtype"]),
                        action=np.zeros((1, E, *cfg["act"]), cfg["act_dtype"]), reward=np.zeros((1, E), np.float32),
                        terminated=np.zeros((1, E), bool), truncated=np.zeros((1, E), bool))
    plan = TransitionBuffer.memory_plan(sample, max_size=SMALL, storage_dtypes=storage_dtypes, episode_marks=True)
    buf = TransitionBuffer(SMALL, 4, sample, storage_dtypes=storage_dtypes, device="cpu")
    buf.insert(Transition(**{k: np.repeat(getattr(sample, k), 4, 0) for k in
                             ("observation", "action", "reward", "terminated", "truncated")}))
    frames = None if cfg["stack"] == 1 else cfg["stack"]
    buf.sample(4, Unit.n_step(3, 0.99, frames=frames), key=0)
    buf.sampling_mass(True)  # its kind's tree: a uniform buffer builds it once an episode end splits the valid starts
    assert buf.nbytes == plan.nbytes, (buf.nbytes, plan.nbytes)
    return plan.bytes_per_transition


def sb3_row(cfg: dict, optimize: bool) -> float:
    """stable-baselines3's ``ReplayBuffer`` (observations of the stacked frames, and next observations unless
    ``optimize_memory_usage``)."""
    import gymnasium as gym
    from stable_baselines3.common.buffers import ReplayBuffer

    shape = cfg["obs"] if cfg["stack"] == 1 else (cfg["stack"], *cfg["obs"])
    hi = 255 if cfg["obs_dtype"] == np.uint8 else 1
    obs = gym.spaces.Box(0, hi, shape, cfg["obs_dtype"])
    act = gym.spaces.Discrete(6) if cfg["act"] == () else gym.spaces.Box(-1, 1, cfg["act"], np.float32)
    rb = ReplayBuffer(SMALL, obs, act, device="cpu", optimize_memory_usage=optimize, handle_timeout_termination=False)
    arrays = [v for v in vars(rb).values() if isinstance(v, np.ndarray)]
    return sum(a.nbytes for a in arrays) / SMALL


def torchrl_row(cfg: dict) -> float:
    """torchrl's ``LazyTensorStorage`` of its usual transition ``TensorDict`` (observation, action, and under
    ``"next"`` the observation, reward, done, terminated, truncated)."""
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage

    shape = cfg["obs"] if cfg["stack"] == 1 else (cfg["stack"], *cfg["obs"])
    obs_dtype = torch.from_numpy(np.zeros(1, cfg["obs_dtype"])).dtype
    act_dtype = torch.from_numpy(np.zeros(1, cfg["act_dtype"])).dtype
    row = TensorDict({"observation": torch.zeros(1, *shape, dtype=obs_dtype),
                      "action": torch.zeros(1, *cfg["act"], dtype=act_dtype),
                      ("next", "observation"): torch.zeros(1, *shape, dtype=obs_dtype),
                      ("next", "reward"): torch.zeros(1, 1), ("next", "done"): torch.zeros(1, 1, dtype=torch.bool),
                      ("next", "terminated"): torch.zeros(1, 1, dtype=torch.bool),
                      ("next", "truncated"): torch.zeros(1, 1, dtype=torch.bool)}, batch_size=[1])
    storage = LazyTensorStorage(SMALL)
    storage.set(0, row[0])
    return sum(t.numel() * t.element_size() for t in storage._storage.values(True, True)) / SMALL  # noqa: SLF001


def fasttd3_formula(cfg: dict) -> float:
    """FastTD3's ``SimpleReplayBuffer`` (fast_td3/fast_td3_utils.py; not on PyPI): observations and next observations
    float32, actions float32, rewards float32, dones and truncations int64, per env and slot."""
    obs, act = math.prod(cfg["obs"]), math.prod(cfg["act"])
    return 2 * 4 * obs + 4 * act + 4 + 8 + 8


def rsl_rl_formula(cfg: dict) -> float:
    """rsl_rl's ``ReplayStorage`` (the v6 off-policy storage; PyPI's rsl-rl-lib 5.5.1 has none): one tensor per stored
    item in the item's dtype; its SAC stores observation and next observation float32, action, reward float32 and a
    done flag (counted as one byte)."""
    obs, act = math.prod(cfg["obs"]), math.prod(cfg["act"])
    return 2 * 4 * obs + 4 * act + 4 + 1


def rows() -> list[dict]:
    out = []
    for name, cfg in CONFIGS.items():
        contenders = {"gpubuf (float32)" if cfg["obs_dtype"] == np.float32 else "gpubuf": ("measured", gpubuf_row(cfg))}
        if cfg["obs_dtype"] == np.float32:
            contenders["gpubuf (bfloat16 observations)"] = ("measured",
                                                            gpubuf_row(cfg, {"observation": torch.bfloat16}))
        contenders["torchrl LazyTensorStorage"] = ("measured", torchrl_row(cfg))
        contenders["SB3 ReplayBuffer"] = ("measured", sb3_row(cfg, False))
        contenders["SB3 ReplayBuffer (optimize_memory_usage)"] = ("measured", sb3_row(cfg, True))
        if cfg["stack"] == 1:
            contenders["FastTD3 SimpleReplayBuffer"] = ("formula", fasttd3_formula(cfg))
            contenders["rsl_rl ReplayStorage"] = ("formula", rsl_rl_formula(cfg))
        for impl, (how, b) in contenders.items():
            out.append({"config": name, "impl": impl, "how": how, "bytes_per_transition": round(b, 1),
                        "transitions_per_80GiB": int(GIB80 // b), "GiB_for_10M": round(10_000_000 * b / 2**30, 2)})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "memory_cpu.json")
    args = p.parse_args()
    result = rows()
    args.out.write_text(json.dumps(result, indent=1))
    print("| config | impl | how | bytes / transition | transitions per 80 GiB | GiB for 10M |")
    print("|---|---|---|---:|---:|---:|")
    for r in result:
        print(f"| {r['config']} | {r['impl']} | {r['how']} | {r['bytes_per_transition']:.1f} | "
              f"{r['transitions_per_80GiB']:,} | {r['GiB_for_10M']:.2f} |")


if __name__ == "__main__":
    main()
