"""gpubuf.torchrl.PrioritizedSliceSampler inside torchrl's replay buffers: the same call sequences as torchrl's own
``PrioritizedSliceSampler`` (its class with numpy trees in place of its compiled ones: ``tests/torchrl_reference.py``)
give the same rows, weights and ``info``; the rows that cannot start a slice are torchrl's."""

import numpy as np
import pytest
import torch
from extras import needs

torchrl = needs("torchrl.data")
from tensordict import TensorDict  # noqa: E402
from test_slice_sampler import assert_same_sample, extended_steps  # noqa: E402
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer  # noqa: E402
from torchrl_reference import ReferenceSliceSampler  # noqa: E402

from gpubuf.torchrl import PrioritizedSliceSampler  # noqa: E402
from gpubuf.torchrl.prioritized_slices import rows_without_a_slice  # noqa: E402

CONFIGS = {
    "traj_key": dict(slice_len=4, traj_key="episode"),
    "end_key": dict(slice_len=3, end_key=("next", "done")),
    "num_slices": dict(num_slices=3),
    "not_strict": dict(slice_len=5, traj_key="episode", strict_length=False),
    "span_right": dict(slice_len=4, traj_key="episode", span=(False, True)),
    "cached": dict(slice_len=4, traj_key="episode", cache_values=True),
    "float64_within": dict(slice_len=4, traj_key="episode", dtype=torch.float64, max_priority_within_buffer=True),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_call_sequence_of_a_prioritized_slice_buffer_matches_torchrls_sampler(name):
    rbs = [TensorDictReplayBuffer(storage=LazyTensorStorage(61), sampler=cls(61, 0.7, 0.5, **CONFIGS[name]),
                                  batch_size=12)
           for cls in (PrioritizedSliceSampler, ReferenceSliceSampler)]
    g = torch.Generator().manual_seed(len(name))
    for step in extended_steps(rbs, g):
        out = []
        for rb in rbs:
            np.random.seed(step)  # the starts: torchrl's host sampler draws with np.random
            torch.manual_seed(step)
            try:
                out.append(rb.sample())
            except (RuntimeError, IndexError) as e:  # the same error from both
                out.append(f"{type(e).__name__}: {e}")
        if isinstance(out[0], str) or isinstance(out[1], str):
            assert out[0] == out[1]
            continue
        a, b = out
        assert torch.allclose(a["priority_weight"], b["priority_weight"], rtol=1e-6)
        assert_same_sample(a.exclude("priority_weight"), b.exclude("priority_weight"))
        prio = torch.rand(a.shape[0], generator=g) * 3
        for rb, s in zip(rbs, (a, b), strict=True):
            rb.update_priority(s["index"].view(-1), prio)


def test_the_rows_that_cannot_start_a_slice_are_torchrls():
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        lengths = torch.randint(1, 9, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g)
        T = int(lengths.sum())
        storage = LazyTensorStorage(T + 3)
        storage.set(torch.arange(T), TensorDict({"x": torch.zeros(T)}, batch_size=[T]))
        for seq in (1, 2, 3, 5, 12):
            for strict in (True, False):
                torchrls = ReferenceSliceSampler(T + 3, 0.5, 0.5, slice_len=2, strict_length=strict)
                want = torchrls._preceding_stop_idx(storage, lengths, seq, torch.zeros(1, 1, dtype=torch.long))  # noqa: SLF001
                got = rows_without_a_slice(lengths.numpy(), seq - 1, strict)
                assert torch.equal(want, torch.from_numpy(got)), (lengths.tolist(), seq, strict)
