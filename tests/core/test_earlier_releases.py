"""What the release before the subpackages (d75cdaf) left with users still loads through 0.2.x: its module paths
import the modules that hold them now (with a DeprecationWarning), and its pickles of buffers unpickle to the same
buffers. Pickles made now name nothing but ``gpubuf`` itself, so no later move of a module breaks them."""

import importlib
import pickle
import pickletools
import runpy
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from snapshots import assert_same_state, snapshot

import gpubuf

DATA = Path(__file__).resolve().parent / "data"
# every module of that release's flat layout
EARLIER = ("benchmarking", "checkpoint", "cli", "concurrency", "copies", "demo", "distributed", "envpool",
           "episode_marks", "graph_sampling", "history", "inputs", "interrupts", "mbrl", "planning", "prefix_tree",
           "prioritized", "replay", "replay_config", "ring", "samplers", "stacked_sampling", "staging", "state",
           "steady_insert", "storage", "storage_dir", "tiers", "transition", "wrappers")


def test_every_earlier_module_path_imports():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # each warns (tests/core/test_imports.py)
        for name in EARLIER:
            assert importlib.import_module(f"gpubuf.{name}").__name__.startswith("gpubuf.")


def test_pickles_made_now_name_gpubuf_alone():
    built = runpy.run_path(str(DATA / "make_buffers_pickle.py"), run_name="built_here")
    for name in ("u", "p", "h"):
        blob = pickle.dumps(built[name])
        names = [arg for op, arg, _ in pickletools.genops(blob) if op.name in ("SHORT_BINUNICODE", "BINUNICODE")
                 and isinstance(arg, str) and arg.startswith("gpubuf")]
        assert set(names) == {"gpubuf"}, names  # gpubuf._rebuild_buffer and the class by its public name
        assert type(pickle.loads(blob)) is type(built[name])
    batch = built["u"].sample(key=1, batch_size=2)
    blob = pickle.dumps(batch)
    assert {arg for op, arg, _ in pickletools.genops(blob) if op.name in ("SHORT_BINUNICODE", "BINUNICODE")
            and isinstance(arg, str) and arg.startswith("gpubuf")} == {"gpubuf"}  # gpubuf.Transition
    torch.testing.assert_close(pickle.loads(blob).observation, batch.observation, rtol=0, atol=0)


def test_pickles_of_the_earlier_release_load_as_the_same_buffers():
    for moved in ("gpubuf.copies", "gpubuf.prioritized"):
        sys.modules.pop(moved, None)
    with open(DATA / "buffers_d75cdaf.pkl", "rb") as f, pytest.warns(DeprecationWarning, match="removed in 0.3.0"):
        old = pickle.load(f)
    built = runpy.run_path(str(DATA / "make_buffers_pickle.py"), run_name="built_here")  # the same buffers, now
    for name, cls in (("uniform", gpubuf.TransitionBuffer), ("prioritized", gpubuf.PrioritizedTransitionBuffer),
                      ("history", gpubuf.HistoryBuffer)):
        assert type(old[name]) is cls
    for name in ("uniform", "prioritized"):
        assert_same_state(snapshot(old[name]), snapshot(built[name[0]]), name)
        a, b = old[name].sample(key=7, batch_size=4), built[name[0]].sample(key=7, batch_size=4)
        a, b = (a[0], b[0]) if isinstance(a, tuple) else (a, b)
        torch.testing.assert_close(a.observation, b.observation, rtol=0, atol=0)
    got, want = old["history"].get(3), built["h"].get(3)
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in got)
