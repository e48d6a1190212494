"""memory_plan: the bytes a buffer allocates, known before it is built, held to the real allocation (``nbytes``)."""

import numpy as np
import pytest
import torch

from gpubuf import PrioritizedTransitionBuffer, Transition, TransitionBuffer, Unit

E = 3


def sample(obs=(5, 7), vectorized=True) -> Transition:
    lead = (1, E) if vectorized else (1,)
    return Transition(observation=np.zeros(lead + obs, np.float32), action=np.zeros(lead + (2,), np.int64),
                      reward=np.zeros(lead, np.float32), terminated=np.zeros(lead, bool),
                      truncated=np.zeros(lead, bool))


def use(buf, kinds: int, marks: bool) -> None:
    """Keep ``kinds`` validity kinds (each its tree and mask) and, with ``marks``, the episode marks."""
    buf.insert(sample())
    for nxt, bounds in [(False, "allow"), (True, "allow"), (False, "forbid"), (True, "forbid")][:kinds]:
        buf.sampling_mass(nxt, bounds)
    if marks:
        buf.episode_marks()


@pytest.mark.parametrize("cls", [TransitionBuffer, PrioritizedTransitionBuffer])
@pytest.mark.parametrize("storage", [None, {"observation": torch.bfloat16, "action": torch.int16}])
@pytest.mark.parametrize(("kinds", "marks"), [(1, False), (2, True), (4, False)])
def test_a_plan_is_what_the_buffer_allocates(cls, storage, kinds, marks):
    for max_size in (E, 31 * E, 1000 * E + 2):
        plan = cls.memory_plan(sample(), max_size=max_size, storage_dtypes=storage, kinds=kinds,
                               episode_marks=marks)
        buf = cls(max_size, 1, sample(), storage_dtypes=storage)
        use(buf, kinds, marks)
        assert plan.nbytes == buf.nbytes
        assert plan.max_size == max_size // E * E and plan.n_envs == E
    row = (35 * (2 if storage else 4) + 2 * (2 if storage else 8) + 4 + 1 + 1)
    assert plan.row_bytes == row
    assert plan.storage_bytes == plan.max_size * row


@pytest.mark.parametrize("cls", [TransitionBuffer, PrioritizedTransitionBuffer])
def test_the_largest_max_size_for_a_budget_fits_it_and_one_more_row_does_not(cls):
    budget = 3_000_000
    plan = cls.memory_plan(sample(), budget=budget, storage_dtypes={"observation": torch.bfloat16})
    assert plan.nbytes <= budget
    more = cls.memory_plan(sample(), max_size=plan.max_size + E, storage_dtypes={"observation": torch.bfloat16})
    assert more.nbytes > budget
    buf = cls(plan.max_size, 1, sample(), storage_dtypes={"observation": torch.bfloat16})
    use(buf, 1, False)
    assert buf.nbytes == plan.nbytes <= budget
    wide = cls.memory_plan(sample(), budget=budget)
    assert wide.max_size < plan.max_size  # bfloat16 observations: more transitions in the same bytes


def test_a_single_env_plan_and_bytes_per_transition():
    plan = TransitionBuffer.memory_plan(sample(vectorized=False), False, max_size=1000)
    assert plan.n_envs == 1 and plan.max_size == 1000
    assert plan.bytes_per_transition == plan.nbytes / 1000
    assert plan.row_bytes < plan.bytes_per_transition < plan.row_bytes + plan.start_bytes + 1


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({}, ValueError, "give exactly one of max_size and budget"),
    ({"max_size": 9, "budget": 10**6}, ValueError, "give exactly one"),
    ({"budget": 0}, ValueError, "budget"),
    ({"budget": 100}, ValueError, "budget: 100 bytes hold not even one row of 3 envs"),
    ({"max_size": 2}, ValueError, "max_size: expected at least one row per env"),
    ({"budget": 10**6, "kinds": 5}, ValueError, "kinds: expected 0 to 4 validity kinds kept"),
    ({"budget": 10**6, "kinds": -1}, ValueError, "kinds"),
    ({"budget": 10**6, "episode_marks": "yes"}, TypeError, "episode_marks"),
    ({"budget": 10**6, "storage_dtypes": {"action": torch.float16}}, ValueError, r"storage_dtypes\['action'\]"),
])
def test_bad_arguments_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        TransitionBuffer.memory_plan(sample(), **kwargs)


def test_a_uniform_buffer_keeps_no_tree_while_its_valid_starts_are_one_range():
    plan = TransitionBuffer.memory_plan(sample(), max_size=30 * E, kinds=0)
    buf = TransitionBuffer(30 * E, 4, sample())
    buf.insert(sample())
    buf.sample(4, Unit.window(), key=0)  # a range of rows: no tree
    assert buf.nbytes == plan.nbytes == plan.storage_bytes
    assert TransitionBuffer.memory_plan(sample(), max_size=30 * E, kinds=1).nbytes > plan.nbytes
