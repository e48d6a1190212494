"""Transition conversions: to(device), iteration over set fields, TensorDict round trip."""

import numpy as np
import pytest
import torch
from extras import needs

from gpubuf import Transition, TransitionBuffer
from gpubuf._core.transition import from_tensordict, items, to, to_tensordict


def batch(B=3, n=2):
    return Transition(observation=torch.arange(B * n * 4.0).view(B, n, 4), action=np.zeros((B, n), np.int64),
                      reward=torch.ones(B, n), terminated=torch.zeros(B, n, dtype=torch.bool),
                      truncated=torch.zeros(B, n, dtype=torch.bool),
                      info={"agents": {"a": torch.full((B, n, 2), 7.0)}, "t": torch.arange(B * n).view(B, n)})


def test_items_yields_the_set_fields_in_order():
    t = batch()
    assert [k for k, _ in items(t)] == ["observation", "action", "reward", "terminated", "truncated", "info"]
    assert list(dict(items(t))) == [k for k, _ in items(t)]
    t.info, t.PER_weights = {}, torch.ones(3)
    assert [k for k, _ in items(t)][-1] == "PER_weights" and "info" not in dict(items(t))


def test_to_moves_every_leaf_and_leaves_the_original_alone(device):
    t = batch()
    moved = to(t, device)
    assert moved is not t and isinstance(t.action, np.ndarray)  # the original is unchanged
    assert moved.next_observation is None and moved.PER_weights is None
    leaves = [moved.observation, moved.action, moved.reward, moved.terminated, moved.truncated,
              moved.info["agents"]["a"], moved.info["t"]]
    assert all(isinstance(x, torch.Tensor) and x.device.type == torch.device(device).type for x in leaves)
    torch.testing.assert_close(moved.action.cpu(), torch.zeros(3, 2, dtype=torch.int64))
    same = to(moved, device)
    assert same.observation is moved.observation  # already there: no copy, as Tensor.to


def test_a_moved_batch_inserts_into_a_buffer():
    sample = Transition(observation=np.zeros((1, 2, 3), np.float32), action=np.zeros((1, 2), np.int64),
                        reward=np.zeros((1, 2), np.float32), terminated=np.zeros((1, 2), bool),
                        truncated=np.zeros((1, 2), bool))
    buf = TransitionBuffer(8, 2, sample, device="cpu", seed=0)
    buf.insert(to(sample, "cpu"))
    assert len(buf) == 2  # one time row of 2 envs


def test_bad_arguments_name_themselves():
    with pytest.raises(TypeError, match="transition: expected a gpubuf.Transition, got dict"):
        to({}, "cpu")
    with pytest.raises(ValueError, match="device: expected a torch device or its name, got 'gpu9'"):
        to(batch(), "gpu9")
    with pytest.raises(TypeError, match=r"info\['agents'\]\['a'\]: expected a torch tensor"):
        to(Transition(1.0, 1, 1.0, False, False, info={"agents": {"a": "text"}}), "cpu")
    with pytest.raises(TypeError, match="transition: expected a gpubuf.Transition, got list"):
        list(items([]))


# ------------------------------------------------------------------ TensorDict


def test_to_tensordict_without_the_package_says_how_to_install(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tensordict(name, *args, **kwargs):
        if name == "tensordict":
            raise ImportError("No module named 'tensordict'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensordict)
    with pytest.raises(ImportError, match="needs the optional tensordict package: pip install tensordict"):
        to_tensordict(batch())


def test_tensordict_round_trip():
    needs("tensordict")
    t = batch()
    t.PER_weights = torch.rand(3)
    td = to_tensordict(t)
    assert list(td.batch_size) == [3]  # PER_weights (3,) limits the shared leading shape
    assert td["info", "agents", "a"].shape == (3, 2, 2)
    back = from_tensordict(td)
    assert back.next_observation is None
    for (k, v), (k2, v2) in zip(items(to(t, "cpu")), items(back), strict=True):
        assert k == k2
        if isinstance(v, dict):
            torch.testing.assert_close(v["agents"]["a"], v2["agents"]["a"])
            torch.testing.assert_close(v["t"], v2["t"])
        else:
            torch.testing.assert_close(v, v2)
    t.PER_weights = None
    assert list(to_tensordict(t).batch_size) == [3, 2]  # every leaf starts with (B, n_steps)
    assert list(to_tensordict(t, batch_dims=1).batch_size) == [3]


def test_tensordict_bad_input_names_the_argument():
    tensordict = needs("tensordict")
    with pytest.raises(ValueError, match=r"batch_dims: leaf action has shape \(3, 2\), expected it to start with 3"):
        to_tensordict(batch(), batch_dims=3)
    with pytest.raises(ValueError, match="batch_dims: expected an int >= 0 or None, got -1"):
        to_tensordict(batch(), batch_dims=-1)
    with pytest.raises(ValueError, match=r"td: unknown keys \['obs'\]"):
        from_tensordict(tensordict.TensorDict({"obs": torch.zeros(2)}, batch_size=[2]))
    with pytest.raises(TypeError, match="td: expected a TensorDict, got dict"):
        from_tensordict({})
    with pytest.raises(ValueError, match="transition: expected at least one field that is set"):
        to_tensordict(Transition(None, None, None, None, None))


# ------------------------------------------------------------------ the same, as Transition methods

def sampled_with_flags():
    """A prioritized batch sampled with boundaries="mask": every field a sampler can set is set."""
    from gpubuf import PrioritizedTransitionBuffer

    T, E = 6, 2
    step = torch.arange(T * E, dtype=torch.float32).view(T, E)
    rollout = Transition(observation=step.unsqueeze(-1), action=step.long(), reward=step,
                         terminated=(step == 4), truncated=torch.zeros(T, E, dtype=torch.bool))
    buf = PrioritizedTransitionBuffer(T * E, 4, rollout, n_steps=3, device="cpu", seed=0)
    buf.insert(rollout)
    return buf.sample(key=0, boundaries="mask")[0]  # (batch, indices)


def test_methods_are_the_functions():
    t = sampled_with_flags()
    assert [k for k, _ in t] == ["observation", "action", "reward", "terminated", "truncated",
                                 "PER_weights", "is_first", "mask", "has_transition"]
    assert list(dict(t)) == [k for k, _ in items(t)]
    moved = t.to("cpu", non_blocking=True)
    assert moved is not t and moved.is_first is t.is_first and moved.mask is t.mask  # nothing is dropped
    np_batch = batch()
    assert isinstance(np_batch.to("cpu").action, torch.Tensor) and isinstance(np_batch.action, np.ndarray)
    with pytest.raises(ValueError, match="device: expected a torch device or its name, got 'gpu9'"):
        np_batch.to("gpu9")


def test_methods_round_trip_a_sampled_batch_through_a_tensordict():
    tensordict = needs("tensordict")
    t = sampled_with_flags()
    td = t.to_tensordict()
    assert isinstance(td, tensordict.TensorDict) and list(td.batch_size) == [4]  # PER_weights is (B,)
    assert list(t.to_tensordict(batch_dims=0).batch_size) == []
    back = Transition.from_tensordict(td)
    assert isinstance(back, Transition) and [k for k, _ in back] == [k for k, _ in t]
    for (_, v), (_, v2) in zip(t, back, strict=True):
        torch.testing.assert_close(v, v2)
    with pytest.raises(ValueError, match=r"td: unknown keys \['obs'\]"):
        Transition.from_tensordict(tensordict.TensorDict({"obs": torch.zeros(2)}, batch_size=[2]))


def test_a_none_inside_info_is_kept_by_to_and_left_out_of_a_tensordict():
    t = Transition(np.zeros((2, 3)), None, None, None, None, info={"lives": np.ones(2), "final_obs": None})
    moved = t.to("cpu")
    assert moved.info["final_obs"] is None and isinstance(moved.info["lives"], torch.Tensor)
    needs("tensordict")
    td = t.to_tensordict(batch_dims=np.int64(1))  # numpy ints are ints here too
    assert list(td["info"].keys()) == ["lives"] and list(td.batch_size) == [2]
