"""Offline to online, end to end: a D4RL-style CartPole dataset collected by a noisy heuristic policy through a
VectorEnvSource, written by gpubuf (``export.to_hdf5``) and loaded back (``datasets.load_episodes``), trains a DQN
offline; the DQN is then fine-tuned online with OfflineToOnline batches (half offline, half from its own rows).

Done when the greedy policy's mean return over 10 episodes beats the dataset's own episodes and reaches 150 (a random
policy scores about 22) within 6k online env steps."""

import numpy as np
import pytest
import torch
from extras import needs
from torch import nn

gym = needs("gymnasium")
needs("h5py")

from gpubuf import OfflineToOnline, TransitionBuffer, Unit, datasets, export  # noqa: E402
from gpubuf.sources.vector_env import VectorEnvSource  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")]
E = 4


def heuristic(obs: np.ndarray, rng: np.random.Generator, noise: float) -> np.ndarray:
    """Push toward the pole's fall, a random action with probability ``noise``: a 'medium' behaviour policy."""
    act = (obs[:, 2] + 0.5 * obs[:, 3] > 0).astype(np.int64)
    return np.where(rng.random(len(obs)) < noise, rng.integers(0, 2, len(obs)), act)


def collect(path, steps: int) -> float:
    """Write a CartPole dataset of ``steps`` vector steps to the HDF5 file ``path``; its mean episode return."""
    src = VectorEnvSource(gym.make_vec("CartPole-v1", E, vectorization_mode="sync"), device="cpu")
    buf = TransitionBuffer(E * (steps + 2), 8, src.transition_sample(), device="cpu")
    src.transitions = buf
    src.reset(seed=1)
    rng = np.random.default_rng(1)
    for _ in range(steps):
        src.step(heuristic(src.last[0], rng, 0.75))
    eps = list(export.episodes(buf, first_is_reset=True))
    export.to_hdf5(buf, path, first_is_reset=True)
    return float(np.mean([e["rewards"].sum() for e in eps]))


class DQN:
    def __init__(self, gamma=0.99, lr=1e-3):
        self.q = nn.Sequential(nn.Linear(4, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 2))
        self.target = nn.Sequential(nn.Linear(4, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 2))
        self.target.load_state_dict(self.q.state_dict())
        self.opt, self.gamma, self.updates = torch.optim.Adam(self.q.parameters(), lr=lr), gamma, 0

    def act(self, obs: np.ndarray, eps: float, rng: np.random.Generator) -> np.ndarray:
        with torch.no_grad():
            greedy = self.q(torch.as_tensor(obs, dtype=torch.float32)).argmax(1).numpy()
        return np.where(rng.random(len(obs)) < eps, rng.integers(0, 2, len(obs)), greedy)

    def update(self, b) -> None:
        with torch.no_grad():  # double DQN target
            a2 = self.q(b.next_observation).argmax(1, keepdim=True)
            bootstrap = self.target(b.next_observation).gather(1, a2)[:, 0]
            target = b.reward + self.gamma * (~b.terminated).float() * bootstrap
        q = self.q(b.observation).gather(1, b.action.long().view(-1, 1))[:, 0]
        loss = nn.functional.smooth_l1_loss(q, target)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.updates += 1
        if self.updates % 250 == 0:
            self.target.load_state_dict(self.q.state_dict())


def evaluate(agent: DQN, episodes: int = 10) -> float:
    env, total = gym.make("CartPole-v1"), []
    for i in range(episodes):
        obs, _ = env.reset(seed=100 + i)
        done, ret = False, 0.0
        while not done:
            obs, r, te, tr, _ = env.step(int(agent.act(obs[None], 0.0, np.random.default_rng(0))[0]))
            ret, done = ret + r, te or tr
        total.append(ret)
    return float(np.mean(total))


def test_a_dqn_trained_offline_then_fine_tuned_online_beats_its_dataset(tmp_path):
    torch.manual_seed(0)
    data_return = collect(tmp_path / "cartpole-medium.h5", 2500)
    sample = VectorEnvSource(gym.make_vec("CartPole-v1", 1, vectorization_mode="sync"), device="cpu")
    offline = TransitionBuffer(20000, 128, sample.transition_sample(), device="cpu", seed=0)
    n = datasets.load_episodes(offline, datasets.from_hdf5(tmp_path / "cartpole-medium.h5"))
    assert n > 50 and len(offline) > 9000
    src = VectorEnvSource(gym.make_vec("CartPole-v1", E, vectorization_mode="sync"), device="cpu")
    online = TransitionBuffer(E * 6000, 128, src.transition_sample(), device="cpu", seed=1)
    src.transitions = online
    agent, rng = DQN(), np.random.default_rng(0)
    pretrain = OfflineToOnline(offline, online, 1.0)
    for _ in range(1500):
        agent.update(pretrain.sample(128, Unit.transition()))
    offline_only = evaluate(agent)
    mixed = OfflineToOnline(offline, online, 0.5)
    src.reset(seed=2)
    best = offline_only
    for t in range(1500):  # 6k env steps
        src.step(agent.act(src.last[0], max(0.02, 0.3 * (1 - t / 750)), rng))
        if online.num_valid(True):
            agent.update(mixed.sample(128, Unit.transition()))
        if t % 250 == 249:
            best = max(best, evaluate(agent))
    print(f"dataset mean return {data_return:.0f}; offline DQN {offline_only:.0f}; best after fine-tuning {best:.0f}")
    assert best > data_return and best >= 150, (data_return, offline_only, best)
