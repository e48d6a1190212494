"""``sample(batch_size, unit, *, key, with_replacement, boundaries, out)``: one call returning a ``Batch`` (its rows,
indices, weights and generations) for every unit, and 0.2.0's forms still returning what they returned, with a
``DeprecationWarning`` that names the new spelling."""

import copy
import pickle
import warnings

import pytest
import torch
from fixtures import make_transition

from gpubuf import Batch, PrioritizedTransitionBuffer, Transition, TransitionBuffer, Unit

E, M, B = 3, 16, 6
UNITS = {"window": Unit.window(), "transition": Unit.transition(), "frames": Unit.frames(2, 2),
         "frames+next": Unit.frames(3, next_obs=True), "n-step": Unit.n_step(3, 0.9),
         "n-step+frames": Unit.n_step(2, 0.5, frames=2, stride=3)}


def build(cls, device="cpu", n_steps=1, T=2 * M - 3):
    sample = make_transition(0, 1, E)
    buf = cls(E * M, B, sample, n_steps=n_steps, device=device, seed=0)
    buf.insert(make_transition(0, M, E, trunc_steps=(5,)))
    buf.insert(make_transition(M, T - M, E, trunc_steps=(20,)))
    return buf


def leaves(batch) -> dict:
    return {k: v for k, v in dict(batch).items() if isinstance(v, torch.Tensor)}


def same_leaves(a, b) -> bool:
    x, y = leaves(a), leaves(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def plain_copy(batch) -> Transition:
    """A plain Transition of copies of ``batch``'s fields."""
    return Transition(**copy.deepcopy(dict(batch)))


def quiet(call):
    """``call()``, asserting it warns nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return call()


def deprecated(call, *spelling, category=DeprecationWarning):
    """``call()``, asserting one ``category`` warning from this file naming 0.3.0 and each of ``spelling``."""
    with pytest.warns(category) as seen:
        got = call()
    assert len(seen) == 1 and seen[0].filename == __file__, [(w.filename, str(w.message)) for w in seen]
    message = str(seen[0].message)
    assert "0.3.0" in message and all(s in message for s in spelling), message
    return got


# ---- Unit


def test_units_are_checked_frozen_hashable_values_that_read_as_their_constructor():
    assert Unit.window() == Unit() and hash(Unit.frames(4, 2)) == hash(Unit.frames(4, 2))
    assert len({Unit.window(), Unit.transition(), Unit.frames(4), Unit.frames(4, 2), Unit.n_step(3, 0.99)}) == 5
    assert Unit.n_step(3, 1) == Unit.n_step(3, 1.0) and Unit.n_step(3, 0.5).next_obs
    for unit in UNITS.values():
        assert eval(repr(unit), {"Unit": Unit}) == unit  # noqa: S307 (the repr is the constructor call)
    with pytest.raises(dataclasses_frozen()):
        Unit.window().next_obs = True
    # each constructor names its own arguments; the fields' names where the fields are given
    for build_unit, name in [(lambda: Unit.frames(0), "k"), (lambda: Unit.frames(2, 0), "stride"),
                             (lambda: Unit.frames(2.0), "k"), (lambda: Unit(frame_stride=2), "frame_stride"),
                             (lambda: Unit.n_step(0, 0.9), "n"), (lambda: Unit.n_step(3, 1.5), "gamma"),
                             (lambda: Unit.n_step(3, float("nan")), "gamma"),
                             (lambda: Unit.n_step(3, 0.9, frames=0), "frames"),
                             (lambda: Unit.n_step(3, 0.9, stride=2), "stride"),
                             (lambda: Unit(n_step_return=(0, 0.9)), r"n_step_return\[0\]"),
                             (lambda: Unit(n_step_return=3), "n_step_return")]:
        with pytest.raises(ValueError, match=f"^{name}: "):
            build_unit()
    with pytest.raises(TypeError, match="^next_obs: "):
        Unit.frames(2, next_obs=1)


def dataclasses_frozen():
    import dataclasses

    return dataclasses.FrozenInstanceError


# ---- the new call


@pytest.mark.parametrize("cls", [TransitionBuffer, PrioritizedTransitionBuffer])
@pytest.mark.parametrize("unit", list(UNITS))
def test_a_sample_is_a_batch_of_the_rows_at_its_indices(cls, unit, backend, device):
    buf = build(cls, device)
    batch = quiet(lambda: buf.sample(unit=UNITS[unit], key=7))
    assert type(batch) is Batch and isinstance(batch, Transition)
    idx = batch.indices
    assert idx.shape == (B,) and idx.dtype == torch.int64 and idx.device == buf.device
    env, _, step = buf.locate(idx)
    assert torch.equal(batch.action, (step * E + env).to(torch.float32))  # every unit keeps the start row's action
    kind = UNITS[unit].next_obs
    if cls is TransitionBuffer:
        assert batch.weights is None
    else:
        mass = buf.sampling_mass(kind).to(device)[idx]
        want = (mass / mass.min()).pow(-buf.beta).to(torch.float32)
        assert batch.weights is batch.PER_weights and torch.allclose(batch.weights, want)
    old = deprecated(lambda: buf.sample(key=7, return_generations=True, **old_keywords(UNITS[unit])),
                     "batch.generations")
    assert same_leaves(old[0], batch) and torch.equal(old[1], idx) and torch.equal(old[2], batch.generations)


def old_keywords(unit: Unit) -> dict:
    """0.2.0's keywords for ``unit``."""
    kw = {"with_next_obs": unit.next_obs and unit.n_step_return is None}
    if unit.frame_stack is not None:
        kw.update(frame_stack=unit.frame_stack, frame_stride=unit.frame_stride)
    if unit.n_step_return is not None:
        kw["n_step_return"] = unit.n_step_return
    return kw


@pytest.mark.parametrize("with_replacement", [True, False])
def test_prioritized_draws_with_and_without_replacement(with_replacement, backend, device):
    buf = build(PrioritizedTransitionBuffer, device, n_steps=3)
    batch = quiet(lambda: buf.sample(batch_size=12, unit=Unit.window(), with_replacement=with_replacement, key=1))
    assert batch.observation.shape[:2] == (12, 3) and batch.weights.shape == (12,)
    if not with_replacement:
        assert batch.indices.unique().numel() == 12
    env, _, step = buf.locate(batch.indices)
    assert torch.equal(batch.observation[:, 0, 0], (step * E + env).to(torch.float32))


def test_generations_read_later_are_those_of_the_draw():
    buf = build(PrioritizedTransitionBuffer)
    batch = buf.sample(unit=Unit.window(), key=3)
    _, idx, gens = deprecated(lambda: buf.sample(unit=Unit.window(), key=3, return_generations=True),
                              "batch.generations")
    assert torch.equal(batch.indices, idx)
    buf.insert(make_transition(2 * M, M // 2, E))  # the ring wraps: half of the rows are new
    assert torch.equal(batch.generations, gens)
    assert batch.generations is not batch.generations  # computed on each read, nothing kept
    buf.update_priorities(batch.indices, torch.ones(B), generations=batch.generations)
    _, row, _ = buf.locate(batch.indices)
    overwritten = int(((row - (2 * M - 3) % M) % M < M // 2).sum())
    assert buf.stale_updates == overwritten


def test_a_batch_passed_as_out_comes_back_filled_with_its_indices():
    buf = build(TransitionBuffer, n_steps=3)
    out = quiet(lambda: buf.sample(key=0))
    got = quiet(lambda: buf.sample(key=1, out=out))
    fresh = buf.sample(key=1)
    assert got is out and same_leaves(got, fresh) and torch.equal(got.indices, fresh.indices)
    plain = plain_copy(fresh)
    batch = quiet(lambda: buf.sample(key=1, unit=Unit.window(), out=plain))  # named unit: a Batch of out's tensors
    assert type(batch) is Batch and batch is not plain and batch.observation is plain.observation
    assert same_leaves(batch, fresh) and type(plain) is Transition


def test_a_batch_reads_as_a_transition_and_travels():
    buf = build(PrioritizedTransitionBuffer)
    batch = quiet(lambda: buf.sample(unit=Unit.transition(), key=2))
    assert [k for k, _ in batch] == [k for k, _ in Transition(**{k: v for k, v in dict(batch).items()})]
    for twin in (copy.deepcopy(batch), pickle.loads(pickle.dumps(batch)), batch.to("cpu")):  # noqa: S301
        assert type(twin) is Batch and same_leaves(twin, batch)
        assert torch.equal(twin.indices, batch.indices) and torch.equal(twin.generations, batch.generations)
    assert Batch(batch.observation, None, None, None, None).indices is None


def test_bad_arguments_are_named():
    buf = build(TransitionBuffer)
    with pytest.raises(TypeError, match="^unit: expected a gpubuf.Unit"):
        buf.sample(unit=(2, 0.9))
    with pytest.raises(TypeError, match="^with_replacement: expected a bool"):
        buf.sample(with_replacement=1)
    with pytest.raises(ValueError, match=r"^frame_stack: expected an int in \[1, 16\], got 17"):
        buf.sample(unit=Unit.frames(M + 1))  # checked against the buffer by the sample
    with pytest.raises(ValueError, match="^n_step_return: .* n_steps=3"):
        build(TransitionBuffer, n_steps=3).sample(unit=Unit.n_step(2, 0.9))
    with pytest.raises(ValueError, match="^unit: not with with_next_obs"):  # raised before any warning
        buf.sample(unit=Unit.transition(), with_next_obs=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'n_step'"):
        buf.sample(n_step=3)
    with pytest.raises(TypeError, match="at most 5 positional arguments"):
        buf.sample(None, True, 4, False, "allow", None)
    with pytest.raises(TypeError, match="multiple values for argument 'key'"):
        buf.sample(0, key=1)


# ---- 0.2.0's forms


OLD_FORMS = [  # (0.2.0 keywords, the unit that replaces them, what the warning names)
    ({"with_next_obs": True}, Unit.transition(), "unit=Unit.transition()"),
    ({"frame_stack": 2, "frame_stride": 2}, Unit.frames(2, 2), "unit=Unit.frames(2, 2)"),
    ({"frame_stack": 3, "with_next_obs": True}, Unit.frames(3, next_obs=True), "unit=Unit.frames(3, next_obs=True)"),
    ({"n_step_return": (3, 0.9)}, Unit.n_step(3, 0.9), "unit=Unit.n_step(3, 0.9)"),
    ({"n_step_return": (3, 0.9), "with_next_obs": True}, Unit.n_step(3, 0.9), "unit=Unit.n_step(3, 0.9)"),
    ({"n_step_return": (2, 0.5), "frame_stack": 2, "frame_stride": 3}, Unit.n_step(2, 0.5, frames=2, stride=3),
     "unit=Unit.n_step(2, 0.5, frames=2, stride=3)"),
]


@pytest.mark.parametrize("cls", [TransitionBuffer, PrioritizedTransitionBuffer])
@pytest.mark.parametrize("form", range(len(OLD_FORMS)))
def test_old_unit_keywords_warn_and_return_what_they_returned(cls, form):
    buf = build(cls)
    keywords, unit, spelling = OLD_FORMS[form]
    new = buf.sample(key=5, unit=unit)
    old = deprecated(lambda: buf.sample(key=5, **keywords), spelling)
    if cls is TransitionBuffer:  # 0.2.0: the batch alone, a plain Transition
        assert type(old) is Transition and same_leaves(old, new)
    else:  # 0.2.0: (batch, indices)
        assert type(old) is tuple and type(old[0]) is Transition
        assert same_leaves(old[0], new) and torch.equal(old[1], new.indices)


@pytest.mark.parametrize("cls", [TransitionBuffer, PrioritizedTransitionBuffer])
def test_old_result_keywords_warn_and_return_their_tuples(cls):
    buf = build(cls)
    new = buf.sample(key=4, unit=Unit.window())
    batch, idx = deprecated(lambda: buf.sample(key=4, return_indices=True), "batch.indices")
    assert type(batch) is Transition and same_leaves(batch, new) and torch.equal(idx, new.indices)
    batch, idx, gens = deprecated(lambda: buf.sample(key=4, return_generations=True), "batch.generations")
    assert same_leaves(batch, new) and torch.equal(idx, new.indices) and torch.equal(gens, new.generations)
    alone = deprecated(lambda: buf.sample(key=4, return_indices=False), "gpubuf.Batch")
    assert type(alone) is Transition and same_leaves(alone, new)


@pytest.mark.parametrize("cls", [TransitionBuffer, PrioritizedTransitionBuffer])
def test_the_old_positional_order_warns_and_reads_key_first(cls):
    buf = build(cls)
    new = buf.sample(key=9, with_replacement=True, batch_size=4, unit=Unit.transition())
    for key in (9, torch.Generator().manual_seed(9)):
        got = deprecated(lambda key=key: buf.sample(key, True, 4, True), "key=, with_replacement=, batch_size=",
                         "unit=Unit.transition()", "first positional argument is batch_size", category=FutureWarning)
        old = got if cls is TransitionBuffer else got[0]
        assert type(old) is Transition and same_leaves(old, new)
    got = deprecated(lambda: buf.sample(0), "pass key= by keyword", category=FutureWarning)
    assert same_leaves(got if cls is TransitionBuffer else got[0], buf.sample(key=0, unit=Unit.window()))


@pytest.mark.parametrize("cls", [TransitionBuffer, PrioritizedTransitionBuffer])
def test_batch_size_and_unit_positionally_are_the_new_form(cls):
    buf = build(cls)
    got = quiet(lambda: buf.sample(4, Unit.transition(), key=9))
    assert type(got) is Batch and len(got.indices) == 4
    assert same_leaves(got, buf.sample(batch_size=4, unit=Unit.transition(), key=9))
    with pytest.raises(TypeError, match="multiple values for argument 'batch_size'"):
        buf.sample(4, Unit.window(), batch_size=4)


def test_calls_without_an_old_form_keep_their_0_2_0_results():
    uni, per = build(TransitionBuffer), build(PrioritizedTransitionBuffer)
    batch = quiet(lambda: uni.sample(key=1))  # a Batch is the Transition it returned
    assert type(batch) is Batch and dict(batch).keys() == dict(uni.sample(key=1, unit=Unit.window())).keys()
    pair = deprecated(lambda: per.sample(key=1), "(batch, indices)", "sample(unit=gpubuf.Unit.window())")
    batch, idx = pair
    assert type(batch) is Batch and torch.equal(idx, batch.indices)
    assert type(quiet(lambda: per.sample(key=1, unit=Unit.window()))) is Batch
    plain = plain_copy(uni.sample(key=1))
    assert deprecated(lambda: uni.sample(key=1, out=plain), "pass a Batch") is plain


def test_an_out_of_another_sample_comes_back_as_a_fresh_sample_or_is_refused():
    uni, per = build(TransitionBuffer, n_steps=2), build(PrioritizedTransitionBuffer, n_steps=2)
    with pytest.raises(ValueError, match="^out: expected the leaves this sample fills .* got next_observation"):
        uni.sample(unit=Unit.window(), key=2, out=uni.sample(unit=Unit.transition(), key=1))
    for out, boundaries in ((per.sample(unit=Unit.window(), key=3), "allow"),  # a prioritized batch's weights
                            (uni.sample(unit=Unit.window(), key=3, boundaries="mask"), "allow"),  # flags
                            (uni.sample(unit=Unit.window(), key=3), "mask")):
        fresh = uni.sample(unit=Unit.window(), key=2, boundaries=boundaries)
        got = uni.sample(unit=Unit.window(), key=2, boundaries=boundaries, out=out)
        assert got is out and got.weights is None and dict(got).keys() == dict(fresh).keys()
        assert same_leaves(got, fresh)
    got = per.sample(unit=Unit.window(), key=2, out=uni.sample(unit=Unit.window(), key=3))
    assert torch.equal(got.weights, per.sample(unit=Unit.window(), key=2).weights)


def test_a_batch_refilled_by_out_keeps_its_indices_tensor_current():
    per = build(PrioritizedTransitionBuffer)
    batch = per.sample(unit=Unit.transition(), key=1)
    kept = batch.indices
    got = per.sample(unit=Unit.transition(), key=2, out=batch)
    assert got is batch and got.indices is kept
    assert torch.equal(kept, per.sample(unit=Unit.transition(), key=2).indices)

