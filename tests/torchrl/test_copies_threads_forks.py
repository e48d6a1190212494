"""gpubuf.torchrl's samplers and storage in a torchrl buffer that is deep-copied, pickled, used from two threads at
once, or read in a forked child: copies draw what the original draws, threads leave it consistent, a child reads
the parent's rows."""

import copy
import os
import pickle
import threading

import numpy as np
import pytest
import torch
from extras import needs

torchrl = needs("torchrl.data")
from tensordict import TensorDict  # noqa: E402
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer  # noqa: E402

from gpubuf.torchrl import PrioritizedSampler, PrioritizedSliceSampler, ReplayStorage, SliceSampler  # noqa: E402

N = 60
KINDS = {
    "prioritized": lambda: (LazyTensorStorage(N), PrioritizedSampler(N, 0.7, 0.5)),
    "slices": lambda: (LazyTensorStorage(N), SliceSampler(slice_len=4, traj_key="episode")),
    "prioritized slices": lambda: (LazyTensorStorage(N), PrioritizedSliceSampler(N, 0.7, 0.5, slice_len=4,
                                                                                  traj_key="episode")),
    "storage": lambda: (ReplayStorage(N), None),
}


def rows(start: int, n: int) -> TensorDict:
    r = torch.arange(start, start + n)
    return TensorDict({"obs": r.float(), "episode": r // 7}, batch_size=[n])


def buffer(kind: str) -> TensorDictReplayBuffer:
    storage, sampler = KINDS[kind]()
    rb = TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=8)
    rb.extend(rows(0, 45))
    if kind.startswith("prioritized"):
        rb.update_priority(torch.arange(45), torch.linspace(0.1, 3.0, 45))
    return rb


def draw(rb, seed: int) -> torch.Tensor:
    np.random.seed(seed)
    torch.manual_seed(seed)
    return rb.sample()["obs"]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_deep_copy_and_a_pickled_copy_draw_what_the_original_draws_and_write_apart(kind):
    rb = buffer(kind)
    for other in (copy.deepcopy(rb), pickle.loads(pickle.dumps(rb))):
        assert torch.equal(draw(other, 1), draw(rb, 1))
        other.extend(rows(100, 30))  # the copy's writes stay in the copy
        assert len(rb) == 45 and len(other) == N
        assert torch.equal(draw(rb, 2), draw(buffer(kind), 2))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_two_threads_extending_sampling_and_updating_at_once_leave_it_consistent(kind):
    rb, errors = buffer(kind), []

    def work(offset: int):
        try:
            for i in range(40):
                rb.extend(rows(7000 * offset + 7 * i, 7))  # one whole episode per extend
                s = rb.sample()
                if kind.startswith("prioritized"):
                    rb.update_priority(s["index"].view(-1), torch.rand(s.shape[0]) + 0.1)
        except Exception as err:  # noqa: BLE001 (reported below)
            errors.append(err)

    threads = [threading.Thread(target=work, args=(k,)) for k in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(rb) == N
    if kind.startswith("prioritized"):
        tree = rb.sampler._sum_tree  # noqa: SLF001
        assert float(tree.tree.total()) == pytest.approx(float(tree.leaves.sum()), rel=1e-9)
    assert set(rb.sample()["obs"].long().tolist()) <= set(rb.storage[:]["obs"].long().tolist())


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_forked_child_draws_what_the_parent_draws(kind):
    rb = buffer(kind)
    want = draw(rb, 3)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        os.write(write, pickle.dumps(draw(rb, 3)))
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        got = pickle.loads(f.read())
    assert os.waitpid(pid, 0)[1] == 0
    assert torch.equal(got, want)
