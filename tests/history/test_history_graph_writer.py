"""HistoryBuffer.graph_writer(): appends of one entry per env with the heads and counts on the device.

A graph append (with a ``reset`` mask) leaves the buffer as ``reset(ids)`` then ``append(...)`` do; eager calls after it
see the device's heads and counts; a value its stored dtype cannot hold writes nothing and is raised once; a loop of
simulator step -> append traces whole under ``torch.compile(fullgraph=True)`` with no recompile.
"""

import copy
import pickle

import numpy as np
import pytest
import torch

from gpubuf import HistoryBuffer

E, L = 4, 5


def info(t: int) -> dict:
    """One entry per env, valued by step and env (a wrong slot shows)."""
    pixels = (torch.arange(E * 6).view(E, 1, 2, 3) + 10 * t).to(torch.uint8)
    return {"pixels": pixels, "action": torch.full((E, 1, 2), float(t)) + torch.arange(E).view(E, 1, 1)}


def assert_same(a: HistoryBuffer, b: HistoryBuffer):
    sa, sb = a.state_dict(), b.state_dict()
    assert torch.equal(sa["counts"], sb["counts"]) and torch.equal(sa["heads"], sb["heads"])
    for key in sa["data"]:
        assert torch.equal(sa["data"][key], sb["data"][key]), key
    assert a.num_strided() == b.num_strided()
    for n in (1, 2, 3):
        ga, gb = a.get(n), b.get(n)
        assert (ga is None) == (gb is None)
        for key in ga or ():
            assert torch.equal(ga[key], gb[key]), (n, key)


def pair():
    a, b = (HistoryBuffer(E, L, 2, ("action",), device="cpu") for _ in range(2))
    a.append(info(0))
    b.append(info(0))
    return a, b, b.graph_writer()


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_graph_appends_write_what_reset_and_append_write(backend_name, monkeypatch):
    monkeypatch.setenv("GPUBUF_BACKEND", backend_name)
    a, b, w = pair()
    g = torch.Generator().manual_seed(0)
    for t in range(1, 24 if backend_name == "torch" else 8):  # the 5-slot rings wrap; envs reset at random
        reset = torch.rand(E, generator=g) < 0.25
        ids = np.flatnonzero(reset.numpy())
        if len(ids):
            a.reset(ids)
        a.append(info(t))
        w.append(info(t), reset=reset)
        if t % 5 == 0:
            assert_same(a, b)
    assert_same(a, b)


def test_eager_calls_between_graph_appends_keep_both_copies_equal():
    a, b, w = pair()
    for t in range(1, 15):
        if t % 4 == 0:  # eager reset and append on both
            for buf in (a, b):
                buf.reset([1, 3])
                buf.append(info(t))
        elif t % 4 == 1:  # a subset of envs, eagerly
            for buf in (a, b):
                buf.append({k: v[:2] for k, v in info(t).items()}, env_ids=[2, 0])
        else:
            a.append(info(t))
            w.append(info(t))
    assert_same(a, b)


def test_copies_and_state_after_graph_appends():
    a, b, w = pair()
    for t in range(1, 8):
        a.append(info(t))
        w.append(info(t))
    for c in (copy.deepcopy(b), pickle.loads(pickle.dumps(b))):
        assert_same(a, c)
    fresh = HistoryBuffer(E, L, 2, ("action",), device="cpu")
    fresh.load_state_dict(b.state_dict())
    assert_same(a, fresh)
    empty = HistoryBuffer(E, L, 2, ("action",), device="cpu")
    empty.append(info(0))
    empty.reset(list(range(E)))
    b.load_state_dict(empty.state_dict())
    w.append(info(9))  # from the loaded (empty) state on
    assert b.num_strided() == [1] * E
    with pytest.raises(TypeError, match="cannot be copied"):
        copy.deepcopy(w)


def test_a_value_its_dtype_cannot_hold_writes_nothing_and_is_raised_once():
    a, b, w = pair()
    w.append(info(1))
    before = b.state_dict()
    before = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in before.items() if k != "data"}
    bad = info(2)
    bad["pixels"] = bad["pixels"].to(torch.int64) + 300  # beyond uint8
    w.append(bad, reset=torch.ones(E, dtype=torch.bool))
    with pytest.raises(ValueError, match="1 append\\(s\\) since the last check wrote nothing"):
        w.check()
    w.check()  # once
    after = b.state_dict()
    assert torch.equal(after["counts"], before["counts"]) and torch.equal(after["heads"], before["heads"])
    a.append(info(1))
    assert_same(a, b)


@pytest.mark.parametrize("bad, error, words", [
    ("missing key", ValueError, "expected the stored keys"),
    ("numpy value", ValueError, "pixels: expected a tensor"),
    ("wrong shape", ValueError, "action: expected a tensor shaped"),
    ("float into uint8", TypeError, "cannot store torch.float32 in the stored dtype torch.uint8"),
])
def test_bad_appends_raise_naming_the_key_and_write_nothing(bad, error, words):
    a, b, w = pair()
    value = info(1)
    if bad == "missing key":
        del value["action"]
    elif bad == "numpy value":
        value["pixels"] = value["pixels"].numpy()
    elif bad == "wrong shape":
        value["action"] = value["action"][:2]
    else:
        value["pixels"] = value["pixels"].float()
    with pytest.raises(error, match=words):
        w.append(value)
    assert_same(a, b)


@pytest.mark.parametrize("name, flag", [
    ("reset", torch.tensor([0, 1, 0, 1])), ("reset", torch.ones(E)), ("reset", torch.ones(E, 1, dtype=torch.bool)),
    ("reset", torch.ones(1, dtype=torch.bool)), ("reset", torch.tensor(True)), ("reset", [True] * E),
    ("valid", torch.tensor([True])), ("valid", True), ("valid", torch.tensor(1)),
])
def test_a_bad_mask_raises_naming_it_and_writes_nothing(name, flag):
    a, b, w = pair()
    with pytest.raises(ValueError, match=f"{name}: expected a bool tensor"):
        w.append(info(99), **{name: flag})
    assert_same(a, b)


def test_inputs_that_require_grad_are_stored_detached():
    a, b, w = pair()
    value = info(1)
    value["action"] = value["action"].requires_grad_()
    w.append(value)
    assert not b.state_dict()["data"]["action"].requires_grad


def test_a_graph_writer_needs_a_first_append():
    with pytest.raises(ValueError, match="history: append once first"):
        HistoryBuffer(E, L, device="cpu").graph_writer()


def test_a_loop_of_appends_traces_whole_without_recompiles():
    torch._dynamo.reset()  # noqa: SLF001
    a, b, w = pair()
    x = torch.zeros(E)

    def step(t):
        nonlocal x
        x = x + t
        reset = x.remainder(3) < 1
        value = {"pixels": (x.view(E, 1, 1, 1) + torch.zeros(E, 1, 2, 3)).to(torch.uint8),
                 "action": x.view(E, 1, 1).expand(E, 1, 2).clone()}
        w.append(value, reset=reset)
        return value, reset

    explanation = torch._dynamo.explain(step)(torch.tensor(1.0))  # noqa: SLF001
    assert explanation.graph_break_count == 0, explanation.break_reasons
    x = torch.zeros(E)
    b.load_state_dict(a.state_dict())
    compiled = torch.compile(step, backend="eager", fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):  # noqa: SLF001
        for t in range(1, 15):
            value, reset = compiled(torch.tensor(float(t)))
            ids = np.flatnonzero(reset.numpy())
            if len(ids):
                a.reset(ids)
            a.append(value)
    assert_same(a, b)
