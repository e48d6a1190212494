"""Boolean flags take bools only (``True``/``False``, numpy's too): a string, a number or ``None`` raises ``TypeError``
naming the flag, the expected type and what came, and changes nothing, where its truthiness would pick a branch
silently (``deferred="no"`` ran the deferred path; ``with_next_obs="False"`` sampled next observations)."""

import numpy as np
import pytest
import torch
from fixtures import make_transition

from gpubuf import PrioritizedTransitionBuffer, TransitionBuffer
from gpubuf.replay.sampling.selectors import Fifo

E = 2
WRONG = ["no", "False", "True", 1.0, 0, 1, None, torch.tensor(True)]


def filled(cls=PrioritizedTransitionBuffer, **kw):
    buf = cls(E * 32, 4, make_transition(0, 1, E), device="cpu", seed=0, **kw)
    return buf.insert(make_transition(0, 12, E))


def message(name: str, value) -> str:
    return rf"^{name}: expected a bool, got .* \({type(value).__name__}\)$"


@pytest.mark.parametrize("value", WRONG, ids=repr)
def test_deferred_takes_a_bool_only_and_nothing_is_written(value):
    buf = filled()
    before, top = buf.sampling_mass(), buf.max_priority
    with pytest.raises(TypeError, match=message("deferred", value)):
        buf.update_priorities(torch.tensor([0, 1]), torch.tensor([5.0, 6.0]), deferred=value)
    assert torch.equal(buf.sampling_mass(), before) and buf.max_priority == top
    buf.check_updates()  # nothing deferred was queued either


CALLS = {  # flag -> a call passing it
    "sample with_next_obs": ("with_next_obs", lambda buf, v: buf.sample(with_next_obs=v)),
    "sample with_replacement": ("with_replacement", lambda buf, v: buf.sample(with_replacement=v)),
    "sample return_indices": ("return_indices", lambda buf, v: buf.sample(return_indices=v)),
    "sample return_generations": ("return_generations", lambda buf, v: buf.sample(return_generations=v)),
    "num_valid": ("with_next_obs", lambda buf, v: buf.num_valid(v)),
    "sampling_mass": ("with_next_obs", lambda buf, v: buf.sampling_mass(with_next_obs=v)),
    "graph_sampler": ("with_next_obs", lambda buf, v: buf.graph_sampler(4, with_next_obs=v)),
    "num_unserved": ("with_next_obs", lambda buf, v: filled(TransitionBuffer, selector=Fifo()).num_unserved(v)),
    "vectorized_env": ("vectorized_env", lambda buf, v: TransitionBuffer(E * 32, 4, make_transition(0, 1, E),
                                                                         vectorized_env=v)),
}


@pytest.mark.parametrize("value", ["no", "False", 1.0, 0], ids=repr)
@pytest.mark.parametrize("call", list(CALLS))
def test_every_flag_of_the_family_takes_a_bool_only(call, value):
    buf = filled()
    state = buf.generator.get_state()
    name, run = CALLS[call]
    with pytest.raises(TypeError, match=message(name, value)):
        run(buf, value)
    assert torch.equal(buf.generator.get_state(), state)  # nothing drawn


def test_none_still_means_the_default_and_numpy_bools_are_bools():
    buf = filled()
    assert buf.sample(with_replacement=None, return_indices=None)[1].shape == (4,)  # prioritized: indices by default
    batch, idx = buf.sample(with_next_obs=np.True_, with_replacement=np.False_, return_indices=True)
    assert batch.next_observation is not None and len(set(idx.tolist())) == 4
    buf.update_priorities(idx, torch.ones(4), deferred=np.True_)
    buf.check_updates()
    assert buf.num_valid(np.False_) == 12 * E


def test_a_source_transition_sample_takes_a_bool_only():
    gym = pytest.importorskip("gymnasium")
    from gpubuf.sources.tensors import TensorSource

    src = TensorSource(E, gym.spaces.Box(-1.0, 1.0, (2,), np.float32), gym.spaces.Discrete(2), final_obs=True,
                       device="cpu")
    with pytest.raises(TypeError, match=message("vectorized", "False")):
        src.transition_sample("False")
    assert src.transition_sample(np.False_).observation.shape == (1, 2)
