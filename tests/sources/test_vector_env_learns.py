"""A learner trains from VectorEnvSource's rows: SAC on gymnasium's Pendulum-v1 (4 sync envs, NEXT_STEP), every
transition taken from a vectorized TransitionBuffer with ``with_next_obs=True`` (the final observation of each
time-limited episode is its last transition's next observation, so truncations bootstrap from the real last frame).

Done when the mean return of the last 8 episodes beats -400 within 20k env steps (a random policy scores about -1200).
"""

import numpy as np
import pytest
import torch
from extras import needs
from torch import nn

gym = needs("gymnasium")

from gpubuf import TransitionBuffer  # noqa: E402
from gpubuf.sources.vector_env import VectorEnvSource  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]


def mlp(n_in, n_out, width=128):
    return nn.Sequential(nn.Linear(n_in, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, n_out))


class SAC:
    """Soft actor-critic with twin critics, target networks and a learned temperature, for a 1-D action in
    ``[-scale, scale]``."""

    def __init__(self, obs_dim, scale=2.0, gamma=0.99, tau=0.005, lr=1e-3):
        self.actor, self.q = mlp(obs_dim, 2), nn.ModuleList([mlp(obs_dim + 1, 1), mlp(obs_dim + 1, 1)])
        self.q_target = nn.ModuleList([mlp(obs_dim + 1, 1), mlp(obs_dim + 1, 1)])
        self.q_target.load_state_dict(self.q.state_dict())
        self.log_alpha = torch.zeros((), requires_grad=True)
        self.opt_actor = torch.optim.Adam(self.actor.parameters(), lr=lr)
        self.opt_q = torch.optim.Adam(self.q.parameters(), lr=lr)
        self.opt_alpha = torch.optim.Adam([self.log_alpha], lr=lr)
        self.scale, self.gamma, self.tau = scale, gamma, tau

    def policy(self, obs):
        """``(action, log_prob)`` of a tanh-squashed Gaussian."""
        mean, log_std = self.actor(obs).chunk(2, -1)
        std = log_std.clamp(-5, 2).exp()
        u = mean + std * torch.randn_like(mean)
        a = torch.tanh(u)
        logp = (-0.5 * ((u - mean) / std) ** 2 - std.log() - 0.5 * np.log(2 * np.pi)).sum(-1)
        logp = logp - torch.log(1 - a.pow(2) + 1e-6).sum(-1)
        return a * self.scale, logp

    def q_values(self, nets, obs, act):
        x = torch.cat([obs, act / self.scale], -1)
        return [net(x).squeeze(-1) for net in nets]

    def update(self, b):
        obs, act, nxt = b.observation, b.action, b.next_observation
        alpha = self.log_alpha.exp().detach()
        with torch.no_grad():
            a2, logp2 = self.policy(nxt)
            q2 = torch.min(*self.q_values(self.q_target, nxt, a2)) - alpha * logp2
            target = b.reward + self.gamma * (~b.terminated).float() * q2
        q1, q2 = self.q_values(self.q, obs, act)
        loss_q = ((q1 - target) ** 2).mean() + ((q2 - target) ** 2).mean()
        self.opt_q.zero_grad()
        loss_q.backward()
        self.opt_q.step()
        a, logp = self.policy(obs)
        loss_pi = (alpha * logp - torch.min(*self.q_values(self.q, obs, a))).mean()
        self.opt_actor.zero_grad()
        loss_pi.backward()
        self.opt_actor.step()
        loss_alpha = -(self.log_alpha * (logp.detach() - 1.0).mean())  # target entropy: -action_dim
        self.opt_alpha.zero_grad()
        loss_alpha.backward()
        self.opt_alpha.step()
        with torch.no_grad():
            for p, pt in zip(self.q.parameters(), self.q_target.parameters(), strict=True):
                pt.lerp_(p, self.tau)


def test_sac_on_pendulum_learns_from_vector_env_rows():
    torch.manual_seed(0)
    E, steps, warmup, batch = 4, 5000, 250, 256  # 20k env steps
    env = gym.make_vec("Pendulum-v1", E, vectorization_mode="sync")
    src = VectorEnvSource(env, device="cpu")
    buf = TransitionBuffer(E * steps, batch, src.transition_sample(), device="cpu", seed=0)
    src.transitions = buf
    agent = SAC(3)
    step = src.reset(seed=0)
    returns, running = [], np.zeros(E)
    rng = np.random.default_rng(0)
    for t in range(steps):
        obs = step.info["observation"][:, 0]
        if t < warmup:
            act = rng.uniform(-2, 2, (E, 1)).astype(np.float32)
        else:
            with torch.no_grad():
                act = agent.policy(obs)[0].numpy()
        step = src.step(act)
        _, reward, terminated, truncated, _ = src.last
        running += reward
        for e in np.flatnonzero(terminated | truncated):
            returns.append(running[e])
            running[e] = 0.0
        if t >= warmup:
            for _ in range(2):
                agent.update(buf.sample(with_next_obs=True))
    last = float(np.mean(returns[-8:]))
    print(f"SAC on Pendulum-v1 through VectorEnvSource: last-8 mean return {last:.0f} after {E * steps} env steps")
    assert len(returns) >= 80 and last > -400, f"mean return of the last 8 episodes {last:.0f} ({len(returns)} ended)"
