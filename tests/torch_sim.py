"""A batched torch simulator with same-step resets (as GPU simulators reset), and a check that two replay buffers hold
the same state: what the graph-writer and capturable-source tests compare."""

import torch

E, M = 3, 16  # envs, rows per env of the buffers the tests build


def assert_same_buffers(a, b):
    """Equal state, lengths, sampling masses and valid counts of every kind, and episode marks."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        if k == "rng":
            continue
        va, vb = sa[k], sb[k]
        if isinstance(va, dict):
            assert va.keys() == vb.keys()
            for kk in va:
                same = torch.equal(va[kk], vb[kk]) if isinstance(va[kk], torch.Tensor) else va[kk] == vb[kk]
                assert same, (k, kk)
        elif isinstance(va, torch.Tensor):
            assert torch.equal(va, vb), k
        else:
            assert va == vb, (k, va, vb)
    assert len(a) == len(b)
    flags = a.config.flag_paths[1]
    for nxt in (False, True):
        for bounds in ("allow", "forbid") if flags else ("allow",):
            assert a.num_valid(nxt, bounds) == b.num_valid(nxt, bounds)
            torch.testing.assert_close(a.sampling_mass(nxt, bounds), b.sampling_mass(nxt, bounds), rtol=1e-14, atol=0)
    ma, mb = a.episode_marks(), b.episode_marks()
    assert torch.equal(ma.marks, mb.marks) and torch.equal(ma.held, mb.held)



class TorchSim:
    """A batched point-mass simulator in torch with same-step resets (as GPU simulators reset): state ``x`` (E, 2),
    episode step ``t`` (E,); terminated when ``|x|`` leaves 3, truncated after 9 steps; a reset state depends on the
    env and its episode count (no random numbers). Observations are the state, or an (E, 3, 6, 6) uint8 image."""

    def __init__(self, pixels: bool, device="cpu"):
        self.pixels, self.envs = pixels, torch.arange(E, device=device)
        self.x = torch.stack([self.envs * 0.3, torch.ones(E, device=device)], 1)
        self.t = torch.zeros(E, dtype=torch.int64, device=device)
        self.episodes = torch.zeros(E, dtype=torch.int64, device=device)

    def obs(self) -> torch.Tensor:
        if not self.pixels:
            return self.x.clone()
        level = (self.x.abs().sum(1) * 40).clamp(0, 255).to(torch.uint8)  # (E,)
        grid = torch.arange(3 * 6 * 6, dtype=torch.int64, device=self.x.device).view(1, 3, 6, 6)
        return ((level[:, None, None, None].to(torch.int64) + grid) % 256).to(torch.uint8)

    def step(self, action: torch.Tensor):
        self.x = self.x * 1.1 + action
        self.t = self.t + 1
        reward = -self.x.norm(dim=1)
        terminated = self.x.abs().amax(1) > 3
        truncated = (self.t >= 9) & ~terminated
        done = terminated | truncated
        self.episodes = self.episodes + done.to(torch.int64)
        reset = torch.stack([self.envs * 0.3 - 0.1 * (self.episodes % 4), torch.ones_like(reward)], 1)
        self.x = torch.where(done[:, None], reset, self.x)
        self.t = torch.where(done, torch.zeros_like(self.t), self.t)
        return reward, terminated, truncated


def assert_compiled_matches_eager(compiled, eager, steps: int, each=None) -> None:
    """Run ``steps`` of both steps (each returning ``(loss, drawn starts, ...)``) from the same seeds, with no
    recompile allowed: equal losses and starts; ``each(got)`` after every compiled step."""
    with torch._dynamo.config.patch(error_on_recompile=True):
        for t in range(steps):
            torch.manual_seed(t)
            want = eager()
            torch.manual_seed(t)
            got = compiled()
            torch.testing.assert_close(got[0], want[0])
            assert torch.equal(got[1], want[1])
            if each is not None:
                each(got)

