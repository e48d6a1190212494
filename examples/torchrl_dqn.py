"""A torchrl DQN script on CartPole-v1 whose prioritized replay is gpubuf's: the sampler argument is the one change.

Everything else is torchrl's: ``GymEnv`` with a ``StepCounter``, a ``QValueActor`` with ``EGreedyModule`` exploration,
a ``Collector``, a double ``DQNLoss`` with a ``SoftUpdate`` target and a ``TensorDictReplayBuffer`` over a
``LazyTensorStorage``. The learner updates the priorities with ``update_tensordict_priority`` after each step.

Run: ``python examples/torchrl_dqn.py [--frames 30000] [--seed 0]``; it prints a line per 2,000 frames and ends with
``best mean return of 10 episodes: R`` (a random policy scores about 22; CartPole-v1 caps a return at 500).
"""

import argparse
import time

import torch
from tensordict.nn import TensorDictSequential
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
from torchrl.envs import GymEnv, StepCounter, TransformedEnv
from torchrl.modules import MLP, EGreedyModule, QValueActor
from torchrl.objectives import DQNLoss, SoftUpdate

from gpubuf.torchrl import PrioritizedSampler  # torchrl.data.PrioritizedSampler before the switch


def train(frames: int = 30_000, seed: int = 0, log=print) -> float:
    """Trains for ``frames`` env steps; returns the best mean return of 10 consecutive finished episodes."""
    torch.manual_seed(seed)
    env = TransformedEnv(GymEnv("CartPole-v1"), StepCounter())
    env.set_seed(seed)
    actor = QValueActor(MLP(in_features=4, out_features=2, num_cells=[128, 128]), in_keys=["observation"],
                        spec=env.action_spec)
    explore = EGreedyModule(env.action_spec, eps_init=1.0, eps_end=0.05, annealing_num_steps=10_000)
    loss = DQNLoss(actor, action_space=env.action_spec, delay_value=True, double_dqn=True)
    loss.make_value_estimator(gamma=0.99)
    target = SoftUpdate(loss, eps=0.99)
    optim = torch.optim.Adam(loss.parameters(), lr=1e-3)
    replay = TensorDictReplayBuffer(storage=LazyTensorStorage(50_000),
                                    sampler=PrioritizedSampler(50_000, alpha=0.6, beta=0.4),
                                    batch_size=128, priority_key="td_error")
    collector = Collector(env, TensorDictSequential(actor, explore), frames_per_batch=100, total_frames=frames,
                          init_random_frames=1_000)
    returns, best, start = [], 0.0, time.perf_counter()
    for i, data in enumerate(collector):
        replay.extend(data.reshape(-1))
        explore.step(data.numel())
        done = data["next", "done"].squeeze(-1)
        returns += data["next", "step_count"][done].squeeze(-1).tolist()
        if len(returns) >= 10:
            best = max(best, sum(returns[-10:]) / 10)
        if len(replay) >= 1_000:
            for _ in range(25):
                batch = replay.sample()
                loss_value = loss(batch)["loss"]
                optim.zero_grad()
                loss_value.backward()
                optim.step()
                target.step()
                replay.update_tensordict_priority(batch)
        if (i + 1) % 20 == 0:
            log(f"frames {(i + 1) * 100:6d}  mean return of the last 10 episodes "
                f"{sum(returns[-10:]) / max(1, len(returns[-10:])):6.1f}  {time.perf_counter() - start:6.1f} s")
    collector.shutdown()
    return best


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=30_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"best mean return of 10 episodes: {train(args.frames, args.seed):.1f}")
