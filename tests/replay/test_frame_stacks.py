"""Frame stacks and n-step returns built at sample time from single stored frames, on both backends,
against a pure-Python model of the rows held.

Every frame encodes where it came from: ``observation["id"] = (env, step, episode)`` (int64 words) and
``observation["pix"]`` five bytes of ``step % 251`` (byte words), so a sampled stack shows which rows it
read. Episodes end at random (terminated, truncated, or, in ``is_last`` mode, an env source's ``is_last``
row after the episode's last transition), inserts wrap the ring, and the model walks the held rows.
"""

import numpy as np
import pytest
import torch
from extras import needs

from gpubuf import PrioritizedTransitionBuffer, Transition, TransitionBuffer

E, M = 3, 16


class Rows:
    """A stream of index-valued rows for ``E`` envs, ending episodes at random."""

    def __init__(self, seed: int, is_last: bool):
        self.rng, self.is_last = np.random.default_rng(seed), is_last
        self.step, self.episode = 0, np.zeros(E, np.int64)
        self.pending = np.zeros(E, bool)  # is_last mode: the next row holds the episode's last observation

    def next(self, T: int) -> Transition:
        obs = np.zeros((T, E, 3), np.int64)
        pix = np.zeros((T, E, 5), np.uint8)
        reward = (self.rng.integers(-8, 9, (T, E)) / 4).astype(np.float32)
        term, trunc, last = (np.zeros((T, E), bool) for _ in range(3))
        for t in range(T):
            obs[t, :, 0], obs[t, :, 1], obs[t, :, 2] = np.arange(E), self.step, self.episode
            pix[t] = self.step % 251
            if self.is_last:
                last[t] = trunc[t] = self.pending
                reward[t][self.pending] = 0
                ending = ~self.pending & (self.rng.random(E) < 0.2)
                term[t] = ending & (self.rng.random(E) < 0.5)  # else a time limit: no flag on this row
                self.episode += self.pending
                self.pending = ending
            else:
                end = self.rng.random(E) < 0.2
                term[t] = end & (self.rng.random(E) < 0.5)
                trunc[t] = end & ~term[t] | (end & (self.rng.random(E) < 0.2))  # sometimes both
                self.episode += end
            self.step += 1
        info = {"is_last": last} if self.is_last else {}
        return Transition(observation={"id": obs, "pix": pix}, action=obs[..., 1].copy(), reward=reward,
                          terminated=term, truncated=trunc, info=info)


def example(is_last: bool) -> Transition:
    """A one-row ``data_sample`` (from a stream of its own)."""
    return Rows(0, is_last).next(1)


def held_rows(buf) -> dict:
    """Per env, the held rows oldest first: ``{name: (count, E, ...) array}`` from the buffer's state."""
    state = buf.state_dict()
    order = [(state["pos"] - state["count"] + i) % buf.max_rows for i in range(state["count"])]
    flat = {k: v.cpu().numpy()[order] for k, v in state["data"].items()}
    return flat


def model_stack(rows: dict, env: int, t: int, k: int, stride: int, is_last: bool) -> list[int]:
    """Held-row positions (0 = oldest held) of the k-frame stack ending at held row ``t``."""
    first = t
    while first > 0:
        prev = first - 1
        ended = rows["info['is_last']"][prev, env] if is_last else \
            rows["terminated"][prev, env] or rows["truncated"][prev, env]
        if ended:
            break
        first = prev
    return [max(t - (k - 1 - q) * stride, first) for q in range(k)]


def model_return(rows: dict, env: int, t: int, n: int, gamma: float, is_last: bool):
    """(return, discount, bootstrap held row, terminated, cut) of the n-step return from held row ``t``."""
    newest = len(rows["reward"]) - 1
    total, m, ended = 0.0, 0, False
    for i in range(n):
        s = t + i
        stop = (rows["truncated"][s, env] or (is_last and rows["info['is_last']"][s, env])) \
            and not rows["terminated"][s, env]  # a terminal transition needs no next observation
        if (i >= 1 and stop) or s >= newest:
            break
        total += gamma ** i * float(rows["reward"][s, env])
        m += 1
        if rows["terminated"][s, env]:
            ended = True
            break
    return total, 0.0 if ended else gamma ** m, t + m, ended, not ended and m < n


def check_batch(buf, batch, idx, k, stride, n_ret, gamma, is_last, with_next_obs=False):
    rows = held_rows(buf)
    env, _, step = (a.cpu().numpy() for a in buf.locate(idx))
    oldest = buf.ring.total - buf.ring.count  # absolute step of held row 0
    ids = batch.observation["id"].cpu().numpy()
    n = buf.n_steps
    for b in range(len(idx)):
        t0 = step[b] - oldest
        for j in range(n):
            t = t0 + j
            got = ids[b, j] if n > 1 else ids[b]
            want = model_stack(rows, env[b], t, k, stride, is_last)
            np.testing.assert_array_equal(got[:, 1] - oldest, want, err_msg=f"stack of env {env[b]} step {t}")
            assert (got[:, 0] == env[b]).all()
            assert (got[:, 2] == rows["observation['id']"][t, env[b], 2]).all(), "a frame of another episode"
            pix = (batch.observation["pix"][b, j] if n > 1 else batch.observation["pix"][b]).cpu().numpy()
            np.testing.assert_array_equal(pix, np.repeat((got[:, 1] % 251)[:, None], 5, 1).astype(np.uint8))
            if with_next_obs:
                nxt = batch.next_observation["id"][b, j] if n > 1 else batch.next_observation["id"][b]
                want = model_stack(rows, env[b], t + 1, k, stride, is_last)
                np.testing.assert_array_equal(nxt[:, 1].cpu().numpy() - oldest, want)
        if n_ret is not None:
            ret, disc, boot, ended, cut = model_return(rows, env[b], t0, n_ret, gamma, is_last)
            assert batch.reward[b].item() == pytest.approx(ret, rel=1e-6, abs=1e-6)
            assert batch.discount[b].item() == pytest.approx(disc, rel=1e-6)
            assert batch.terminated[b].item() == ended and batch.truncated[b].item() == cut
            want = model_stack(rows, env[b], boot, k, stride, is_last)
            np.testing.assert_array_equal(batch.next_observation["id"][b][:, 1].cpu().numpy() - oldest, want)
            assert batch.action[b].item() == step[b]


@pytest.mark.parametrize("is_last", [False, True], ids=["flags", "is_last"])
def test_stacks_and_returns_match_the_model_through_wraps(backend, device, is_last):
    src = Rows(1, is_last)
    buf = TransitionBuffer(E * M, 24, example(is_last), device=device, seed=3)
    for T in (7, 5, 9, 11, 6, 13):  # 51 rows: the ring wraps three times, at varying seams
        buf.insert(src.next(T))
        if buf.ring.count < 2:
            continue
        batch, idx = buf.sample(frame_stack=4, frame_stride=2, n_step_return=(3, 0.9), return_indices=True)
        assert batch.observation["id"].shape == (24, 4, 3) and batch.next_observation["pix"].shape == (24, 4, 5)
        assert batch.reward.dtype == torch.float32 and batch.discount.dtype == torch.float32
        check_batch(buf, batch, idx, 4, 2, 3, 0.9, is_last)


def test_windows_of_stacks_with_next_observations(backend, device):
    src = Rows(2, False)
    buf = TransitionBuffer(E * M, 16, example(False), n_steps=3, device=device, seed=0)
    for T in (9, 14, 12):
        buf.insert(src.next(T))
        batch, idx = buf.sample(frame_stack=3, frame_stride=1, with_next_obs=True, boundaries="mask",
                                return_indices=True)
        assert batch.observation["id"].shape == (16, 3, 3, 3) and batch.mask.shape == (16, 3)
        check_batch(buf, batch, idx, 3, 1, None, 0.0, False, with_next_obs=True)


def test_returns_without_stacks_and_prioritized_weights(backend, device):
    src = Rows(3, True)
    buf = PrioritizedTransitionBuffer(E * M, 20, example(True), device=device, seed=1)
    buf.insert(src.next(12)).insert(src.next(11))
    batch, idx = buf.sample(n_step_return=(5, 0.5), with_replacement=True)
    assert batch.observation["id"].shape == (20, 3) and batch.next_observation["id"].shape == (20, 3)
    assert batch.PER_weights.shape == (20,)
    rows, oldest = held_rows(buf), buf.ring.total - buf.ring.count
    env, _, step = (a.cpu().numpy() for a in buf.locate(idx))
    for b in range(20):
        ret, disc, boot, ended, cut = model_return(rows, env[b], step[b] - oldest, 5, 0.5, True)
        assert batch.reward[b].item() == pytest.approx(ret, abs=1e-6)
        assert batch.discount[b].item() == pytest.approx(disc)
        assert batch.next_observation["id"][b, 1].item() - oldest == boot
    buf.update_priorities(idx, torch.rand(20, device=device))  # indices are the starts, as without stacks


def test_stacks_from_a_storage_dir_and_after_reopen(tmp_path, host_backend):
    src = Rows(4, False)
    sample = example(False)
    with TransitionBuffer(E * M, 12, sample, device="cpu", storage_dir=tmp_path / "d", seed=0) as buf:
        buf.insert(src.next(10)).insert(src.next(10))
        batch, idx = buf.sample(frame_stack=3, frame_stride=3, n_step_return=(2, 0.8), return_indices=True)
        check_batch(buf, batch, idx, 3, 3, 2, 0.8, False)
        buf.insert(src.next(5))  # the marks follow inserts
        batch, idx = buf.sample(frame_stack=3, frame_stride=3, n_step_return=(2, 0.8), return_indices=True)
        check_batch(buf, batch, idx, 3, 3, 2, 0.8, False)
    again = TransitionBuffer(E * M, 12, sample, device="cpu", storage_dir=tmp_path / "d", seed=0)
    batch, idx = again.sample(frame_stack=3, frame_stride=3, n_step_return=(2, 0.8), return_indices=True)
    check_batch(again, batch, idx, 3, 3, 2, 0.8, False)
    again.close()


def test_host_storage_of_a_device_buffer(backend, device):
    src = Rows(5, True)
    buf = TransitionBuffer(E * M, 12, example(True), device=device, storage_device="cpu", seed=0)
    buf.insert(src.next(15)).insert(src.next(15))
    batch, idx = buf.sample(frame_stack=2, frame_stride=4, n_step_return=(4, 0.99), return_indices=True)
    assert batch.observation["id"].device.type == torch.device(device).type
    check_batch(buf, batch, idx, 2, 4, 4, 0.99, True)


def test_marks_follow_a_load(backend, device):
    src = Rows(6, False)
    buf = TransitionBuffer(E * M, 12, example(False), device=device, seed=0)
    buf.insert(src.next(11)).insert(src.next(10))
    buf.sample(frame_stack=4, n_step_return=(3, 0.9))  # the marks exist from here on
    other = TransitionBuffer(E * M, 12, example(False), device=device, seed=0)
    other.insert(Rows(60, False).next(9))  # a stream of its own: a load numbers its rows from 0
    buf.load_state_dict(other.state_dict())
    batch, idx = buf.sample(frame_stack=4, n_step_return=(3, 0.9), return_indices=True)
    check_batch(buf, batch, idx, 4, 1, 3, 0.9, False)


def test_graph_sampler_refills_stacks_and_returns(backend, device):
    src = Rows(7, True)
    buf = PrioritizedTransitionBuffer(E * M, 10, example(True), device=device, seed=0)
    buf.insert(src.next(12))
    graph = buf.graph_sampler(frame_stack=3, frame_stride=2, n_step_return=(3, 0.7))
    for T in (0, 6, 15):  # later inserts: the same tensors hold the buffer as it is now
        if T:
            buf.insert(src.next(T))
        out, idx = graph.sample()
        check_batch(buf, out, idx, 3, 2, 3, 0.7, True)
    assert out.observation["id"] is graph.sample()[0].observation["id"]


def test_bytes_per_step_are_one_frame_plus_the_scalars(device):
    frame = np.zeros((1, 2, 84, 84), np.uint8)
    sample = Transition(observation=frame, action=np.zeros((1, 2), np.int64), reward=np.zeros((1, 2), np.float32),
                        terminated=np.zeros((1, 2), bool), truncated=np.zeros((1, 2), bool))
    buf = TransitionBuffer(2 * 64, 4, sample, device=device)
    stored = sum(t.numel() * t.element_size() for t in buf.storage.tensors())
    assert stored == 2 * 64 * (84 * 84 + 8 + 4 + 1 + 1)


@pytest.mark.parametrize("kwargs, match", [
    ({"frame_stack": 0}, "frame_stack: expected an int in"),
    ({"frame_stack": True}, "frame_stack: expected an int in"),
    ({"frame_stack": 2.0}, "frame_stack: expected an int in"),
    ({"frame_stack": 9, "frame_stride": 2}, "frame_stack: a stack of 9 frames at stride 2 spans 17 rows"),
    ({"frame_stack": 2, "frame_stride": 0}, "frame_stride: expected an int in"),
    ({"frame_stride": 2}, "frame_stride: needs frame_stack"),
    ({"n_step_return": 3}, r"n_step_return: expected \(n, gamma\)"),
    ({"n_step_return": (0, 0.9)}, r"n_step_return\[0\]: expected an int in"),
    ({"n_step_return": (3, 1.5)}, r"n_step_return\[1\]: expected a discount gamma in \[0, 1\]"),
    ({"n_step_return": (3, float("nan"))}, r"n_step_return\[1\]"),
    ({"n_step_return": (3, "0.9")}, r"n_step_return\[1\]"),
    ({"frame_stack": 2, "out": Transition(None, None, None, None, None)}, "out: not offered"),
])
def test_bad_arguments_raise_and_draw_nothing(kwargs, match):
    src = Rows(8, False)
    buf = TransitionBuffer(E * M, 4, example(False), device="cpu", seed=0)
    buf.insert(src.next(10))
    rng = buf.generator.get_state()
    with pytest.raises(ValueError, match=match):
        buf.sample(**kwargs)
    assert torch.equal(buf.generator.get_state(), rng)


def test_buffers_that_cannot_stack_or_return_say_why():
    src = Rows(9, False)
    one = src.next(1)
    windows = TransitionBuffer(E * M, 4, one, n_steps=2, device="cpu")
    with pytest.raises(ValueError, match="n_step_return: returns are per transition"):
        windows.sample(n_step_return=(3, 0.9))
    stored = Transition(observation=one.observation["id"], action=one.action, reward=one.reward,
                        terminated=one.terminated, truncated=one.truncated, next_observation=one.observation["id"])
    with pytest.raises(ValueError, match="stores next_observation"):
        TransitionBuffer(E * M, 4, stored, device="cpu").sample(frame_stack=2)
    vector_reward = Transition(observation=one.observation["id"], action=one.action, reward=np.zeros((1, E, 2)),
                               terminated=one.terminated, truncated=one.truncated)
    with pytest.raises(ValueError, match="needs one scalar reward per row"):
        TransitionBuffer(E * M, 4, vector_reward, device="cpu").sample(n_step_return=(2, 0.9))


def test_an_envpool_source_s_rows_stack_and_return_by_its_is_last_convention(backend, device):
    envpool = needs("envpool")
    from gpubuf.sources.envpool import EnvPoolSource

    env = envpool.make("CartPole-v1", env_type="gymnasium", num_envs=4, seed=0, max_episode_steps=12)
    src = EnvPoolSource(env, device=device)
    buf = TransitionBuffer(4 * 24, 16, src.transition_sample(), device=device, seed=0)
    src.transitions = buf
    src.reset()
    rng = np.random.default_rng(0)
    for _ in range(50):  # episodes end by termination and by the 12-step limit; the ring wraps
        src.step(rng.integers(0, 2, 4))
    rows = held_rows(buf)
    assert rows["terminated"].any() and rows["info['is_last']"].any()
    batch, idx = buf.sample(frame_stack=4, frame_stride=1, n_step_return=(3, 0.9), return_indices=True)
    env_, _, step = (a.cpu().numpy() for a in buf.locate(idx))
    oldest = buf.ring.total - buf.ring.count
    for b in range(16):
        t = step[b] - oldest
        frames = rows["observation"][model_stack(rows, env_[b], t, 4, 1, True), env_[b]]
        np.testing.assert_array_equal(batch.observation[b].cpu().numpy(), frames)
        ret, disc, boot, ended, cut = model_return(rows, env_[b], t, 3, 0.9, True)
        assert batch.reward[b].item() == pytest.approx(ret) and batch.discount[b].item() == pytest.approx(disc)
        frames = rows["observation"][model_stack(rows, env_[b], boot, 4, 1, True), env_[b]]
        np.testing.assert_array_equal(batch.next_observation[b].cpu().numpy(), frames)


@pytest.mark.cuda
def test_a_cuda_graph_replays_stacks_and_returns_after_inserts_without_syncs():
    from test_graph_sampler import captured

    src = Rows(10, True)
    buf = PrioritizedTransitionBuffer(E * M, 16, example(True), device="cuda", seed=0)
    buf.insert(src.next(12))
    graph, out, idx = captured(buf.graph_sampler(frame_stack=4, frame_stride=2, n_step_return=(3, 0.9)))
    for T in (5, 9, 14):
        torch.cuda.set_sync_debug_mode("error")  # inserts keep the marks current on the device, no sync
        try:
            buf.insert(src.next(T))
            graph.replay()
            buf.sample(with_replacement=True, frame_stack=4, frame_stride=2, n_step_return=(3, 0.9))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        check_batch(buf, out, idx, 4, 2, 3, 0.9, True)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_cpu_paths_and_the_kernels_match_the_twins_on_random_marks(seed, device):
    """Random marks, held rows, starts and odd sizes; storage rows hold their own index (value = row), so any
    wrong row shows. The ops the buffers call on host tensors (time-major and env-major) and, on the device,
    the Triton kernels give exactly the twins' results."""
    from conftest import INTERPRET

    from gpubuf.kernels import stacks as kernels
    from gpubuf.ops import backend_table
    from gpubuf.ops import stacks as ops_stacks

    g = torch.Generator().manual_seed(seed)
    E, M, D, B, n, k, stride, N = 3, 11, 5, 13, 2, 3, 2, 4
    marks = torch.randint(0, 8, (M * E,), generator=g, dtype=torch.uint8)
    held = torch.tensor([int(torch.randint(0, M, (1,), generator=g)), int(torch.randint(2, M + 1, (1,), generator=g))])
    starts = torch.randint(0, M * E, (B,), generator=g)
    storage = torch.arange(M * E, dtype=torch.int64).unsqueeze(1).repeat(1, D)  # row r holds r
    env_major = storage.view(M, E, D).transpose(0, 1).contiguous().view(M * E, D)  # the same rows, env-major
    reward = torch.randn(M * E, generator=g)
    gamma = torch.tensor([0.9], dtype=torch.float64)

    def stacked(fn, src, dev, **kw):
        out = torch.zeros(B, n, k, D, dtype=torch.int64, device=dev)
        fn([(src.to(dev), out, 1)], starts.to(dev), marks.to(dev), held.to(dev), n, k, stride, E, M, **kw)
        return out.cpu()

    def returns(fn, dev, rewards=reward, **kw):
        outs = (torch.zeros(B, device=dev), torch.zeros(B, device=dev), torch.zeros(B, dtype=torch.int64, device=dev),
                torch.zeros(B, dtype=torch.bool, device=dev), torch.zeros(B, dtype=torch.bool, device=dev))
        fn(starts.to(dev), rewards.to(dev), marks.to(dev), held.to(dev), outs, gamma.to(dev), N, E, M, **kw)
        return [t.cpu() for t in outs]

    def kernel_returns(starts, reward, marks, held, outs, gamma, n, E, M):
        ret, disc, boot, term, cut = outs
        kernels.returns(starts, reward, marks, held, (ret, disc, boot, term.view(torch.uint8), cut.view(torch.uint8)),
                        gamma, n, E, M)

    def stack_host(*args, env_major=False):
        backend_table(torch.device("cpu"), "torch", env_major).frame_stack(*args)

    def return_host(*args, env_major=False):
        backend_table(torch.device("cpu"), "torch", env_major).n_step_return(*args)

    want = stacked(ops_stacks.stack_twin, storage, "cpu")
    assert torch.equal(stacked(stack_host, storage, "cpu"), want)
    # env-major row env * M + step holds its time-major index step * E + env: the same values come back
    assert torch.equal(stacked(stack_host, env_major, "cpu", env_major=True), want)
    assert torch.equal(stacked(ops_stacks.stack_twin, env_major, "cpu", env_major=True), want)
    want_r = returns(ops_stacks.return_twin, "cpu")
    reward_env_major = reward.view(M, E).t().contiguous().view(-1)
    for got in (returns(return_host, "cpu"),
                returns(return_host, "cpu", reward_env_major, env_major=True),
                returns(ops_stacks.return_twin, "cpu", reward_env_major, env_major=True)):
        for a, b in zip(got, want_r, strict=True):
            torch.testing.assert_close(a, b)
    if device == "cuda" or INTERPRET:
        assert torch.equal(stacked(kernels.stack, storage, device), want)
        for a, b in zip(returns(kernel_returns, device), want_r, strict=True):
            torch.testing.assert_close(a, b)


def test_a_row_both_terminated_and_truncated_ends_the_return_as_a_termination(backend, device):
    T = 12
    step = np.arange(T)[:, None]
    ends = (step == 5)  # row 5: the episode terminates on its time-limit step
    rows = Transition(observation=np.repeat(step, 2, 1)[..., None].astype(np.int64), action=np.repeat(step, 2, 1),
                      reward=np.ones((T, 2), np.float32), terminated=np.repeat(ends, 2, 1),
                      truncated=np.repeat(ends, 2, 1))
    buf = TransitionBuffer(2 * 16, 8, rows, device=device, seed=0)
    buf.insert(rows)
    batch, idx = buf.sample(batch_size=64, n_step_return=(3, 0.5), return_indices=True, key=0)
    start = buf.locate(idx)[2].cpu().numpy()
    for b in np.flatnonzero((start >= 3) & (start <= 4)):  # returns reaching row 5 take its reward
        assert batch.terminated[b] and batch.discount[b] == 0
        assert batch.reward[b].item() == pytest.approx(sum(0.5 ** i for i in range(6 - start[b])))
    assert ((start >= 3) & (start <= 4)).any()


def test_returns_need_a_terminated_leaf():
    one = Rows(11, False).next(1)
    no_term = Transition(observation=one.observation["id"], action=one.action, reward=one.reward, terminated=None,
                         truncated=one.truncated)
    buf = TransitionBuffer(E * M, 4, no_term, device="cpu")
    buf.insert(no_term)
    with pytest.raises(ValueError, match="n_step_return: needs a terminated leaf"):
        buf.sample(n_step_return=(3, 0.9))
