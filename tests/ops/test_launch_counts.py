"""Kernel launches per buffer op on the Triton path, counted through the kernels' pre-run hooks (the
interpreter runs them as a GPU would launch them). The counts are the ones the README documents."""

import numpy as np
import pytest
import torch
from fixtures import make_transition

from gpubuf import HistoryBuffer, PrioritizedTransitionBuffer, TransitionBuffer
from gpubuf.kernels import history, prefix_tree, sequence, stacks

KERNELS = {"append": history._append_kernel, "gather_frames": history._gather_frames_kernel,
           "pack_blocks": history._pack_blocks_kernel, "gather": sequence._gather_kernel,
           "sample": prefix_tree._sample_kernel, "update": prefix_tree._update_kernel,
           "stack": stacks._stack_kernel, "returns": stacks._return_kernel}


@pytest.fixture
def launches(monkeypatch):
    """A dict of kernel name -> launches since the last ``clear()``."""
    monkeypatch.setenv("GPUBUF_BACKEND", "triton")
    counts: dict[str, int] = {}
    hooks = {}
    for name, fn in KERNELS.items():
        if not hasattr(fn, "add_pre_run_hook"):
            pytest.skip("this Triton has no pre-run hooks")
        hooks[name] = lambda *a, _name=name, **k: counts.__setitem__(_name, counts.get(_name, 0) + 1)
        fn.add_pre_run_hook(hooks[name])
    yield counts
    for name, fn in KERNELS.items():
        fn.pre_run_hooks.remove(hooks[name])


def test_history_launches_one_kernel_per_word_type(launches, device):
    buf = HistoryBuffer(3, 6, 2, ("action",), device=device)
    step = {"pixels": np.zeros((3, 1, 4, 4, 3), np.uint8),  # 48 bytes: int64 words
            "observation": np.zeros((3, 1, 4), np.float32),  # 16 bytes: int64 words
            "reward": np.zeros(3, np.float32),  # 4 bytes: int32 words
            "action": np.zeros((3, 1, 2), np.float32)}  # 8 bytes: int64 words (a block key)
    buf.append(step)
    launches.clear()
    buf.append(step)
    assert launches == {"append": 2}  # int64 keys (pixels, observation, action) and int32 (reward)
    launches.clear()
    buf.get(3)
    assert launches == {"gather_frames": 2, "pack_blocks": 1}  # frames per word type, one per block key


@pytest.mark.parametrize("prioritized, truncated", [(False, False), (False, True), (True, False)])
def test_replay_sample_launches_the_descent_and_one_gather_per_word_type(prioritized, truncated, launches, device):
    cls = PrioritizedTransitionBuffer if prioritized else TransitionBuffer
    buf = cls(2**10 * 3, 8, make_transition(0, 1, 3), n_steps=2, device=device, seed=0)
    buf.insert(make_transition(0, 40, 3, trunc_steps=(20,) if truncated else ()))
    buf.sample(with_replacement=True, with_next_obs=True)  # the tree is built on first use
    launches.clear()
    buf.sample(with_replacement=True, with_next_obs=True)
    # leaves: observation/action/reward float32 (8, 4, 4 bytes: int64, int32, int32 words), terminated and
    # truncated bool (1 byte: uint8), info.step int64; next_observation joins the int64 group. A uniform
    # buffer descends its tree only when truncations make validity more than one ring range of rows.
    descent = {"sample": 1} if prioritized or truncated else {}
    assert launches == {**descent, "gather": 3}


def test_stacked_n_step_sample_launches_one_copy_per_word_type_per_part(launches, device):
    buf = PrioritizedTransitionBuffer(2**10 * 3, 8, make_transition(0, 1, 3), device=device, seed=0)
    buf.insert(make_transition(0, 40, 3))
    buf.sample(with_replacement=True, frame_stack=4, n_step_return=(3, 0.99))  # marks and tree built
    launches.clear()
    buf.sample(with_replacement=True, frame_stack=4, n_step_return=(3, 0.99))
    # plain leaves: action float32 (int32 words), info.step int64; observation float32 x 2 (int64 words):
    # one stack launch for the observations, one for the bootstrap observations, one for the returns
    assert launches == {"sample": 1, "gather": 2, "stack": 2, "returns": 1}


def test_priority_update_launches_one_kernel(launches, device):
    buf = PrioritizedTransitionBuffer(2**10 * 3, 8, make_transition(0, 1, 3), n_steps=2, device=device, seed=0)
    buf.insert(make_transition(0, 40, 3))
    buf.sample()
    launches.clear()
    buf.update_priorities(torch.arange(5), torch.ones(5))
    # 3072 starts, fanout 32: 3 levels (3072 leaves, 96 -> 128 nodes, one top node of 32), all in one launch
    assert launches == {"update": 1}


def test_a_large_priority_update_launches_once_per_level(launches, device):
    buf = PrioritizedTransitionBuffer(2**10 * 3, 8, make_transition(0, 1, 3), n_steps=2, device=device, seed=0)
    buf.insert(make_transition(0, 40, 3))
    buf.sample()
    launches.clear()
    n = prefix_tree.MANY_PROGRAMS_FROM
    buf.update_priorities(torch.arange(n) % 120, torch.ones(n))
    # from MANY_PROGRAMS_FROM leaves on: the leaves, then each of the 2 parent levels, each over many programs
    assert launches == {"update": 3}
