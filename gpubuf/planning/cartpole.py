"""A ready-made model for the CEM solver: CartPole-v1's own equations, for the demo, tests and examples."""

import torch

CARTPOLE = dict(gravity=9.8, masscart=1.0, masspole=0.1, length=0.5, force_mag=10.0, tau=0.02)


def cartpole_dynamics(state: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    """CartPole-v1's Euler step: ``state (N, 4)``, ``action (N, 1)`` (push right when ``> 0``) -> ``(N, 4)``."""
    c = CARTPOLE
    x, x_dot, theta, theta_dot = state.unbind(-1)
    force = torch.where(action[:, 0] > 0, c["force_mag"], -c["force_mag"])
    total_mass, pml = c["masscart"] + c["masspole"], c["masspole"] * c["length"]
    cos, sin = torch.cos(theta), torch.sin(theta)
    temp = (force + pml * theta_dot**2 * sin) / total_mass
    theta_acc = (c["gravity"] * sin - cos * temp) / (c["length"] * (4.0 / 3.0 - c["masspole"] * cos**2 / total_mass))
    x_acc = temp - pml * theta_acc * cos / total_mass
    tau = c["tau"]
    return torch.stack([x + tau * x_dot, x_dot + tau * x_acc, theta + tau * theta_dot, theta_dot + tau * theta_acc], -1)


def cartpole_cost(state: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    """Pole angle and cart offset, squared: ``(N,)`` (at most 0.1 before the episode ends)."""
    return state[:, 2] ** 2 + 0.01 * state[:, 0] ** 2
