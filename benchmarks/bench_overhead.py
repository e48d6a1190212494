"""Host overhead per call of every buffer op at small sizes, beside its floor and cpprb, in units of
one trivial torch op dispatch measured in the same run.

Sizes: 16 envs, CartPole-sized observations (4 float32), batch 32, 16k capacity (1024 rows x 16 envs),
history get(4) with action_block 1. Columns per call:

- gpubuf: the buffer call;
- tight: the same steady-state work in the fewest torch ops, no checks (``tight_reference.py``);
- cpprb (when importable): ReplayBuffer / PrioritizedReplayBuffer with the same fields (next
  observations through ``next_of``), add of 16 rows, sample(32), update_priorities of 32;
- host-only: the gpubuf call with its device work replaced by nothing (:class:`HostOnly`): the
  Python and glue ops that the GPU path pays too.

The unit is one ``torch.add(a, b, out=out)`` on 16 float32 elements (timed as 8 in a row); the mean of
8 different trivial ops (add, mul, sub with out=, index_select, empty, copy_, fill_, a slice) is
reported beside it. Everything runs interleaved in rotating order (:func:`gpubuf.apps.benchmarking.timing.
median_us`: per round one untimed call, then two timed), one thread, medians; trees are built before
timing. Measure on a quiet machine.

    python benchmarks/bench_overhead.py            # -> results/overhead_cpu.json and a markdown table
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tight_reference import History, Replay

import gpubuf
import gpubuf.ops.backends as backends
import gpubuf.ops.history as history_ops
import gpubuf.ops.prefix_tree as tree_ops
import gpubuf.ops.sequence as sequence_ops
from gpubuf import HistoryBuffer, PrioritizedTransitionBuffer, Transition, TransitionBuffer, Unit
from gpubuf.apps.benchmarking.timing import machine, median_us, syncer
from gpubuf.ops import host_loops
from gpubuf.replay.storage.memory import MemoryStorage

E, OBS, B, ROWS, N = 16, 4, 32, 1024, 4
# issue 20's targets in units: (call, host-only)
TARGETS = {"history append": (10, 15), "history get(4)": (15, 15), "history get(4, out=)": (11, 15),
           "replay insert": (25, 15), "PER insert": (25, 15), "uniform sample": (80, 15),
           "PER sample": (80, 15), "PER sample without replacement": (125, 25), "PER update": (55, 15)}
LEAVES = {"observation": ((OBS,), torch.float32), "action": ((), torch.int64), "reward": ((), torch.float32),
          "terminated": ((), torch.bool), "truncated": ((), torch.bool)}
TRANSITION = Unit.transition()  # the sampled unit, built once as a learner would


def _nothing(*args, **kwargs):
    return None


def _distinct_leaves(*args):
    """A tree sample's fake: leaves 0 .. B-1 into its ``out`` (the last argument), so a draw without
    replacement ends after one round."""
    torch.arange(args[-1].shape[0], out=args[-1])


def _sampled_masses(tree, offsets, fanout, u, out, mass):
    """The compiled descent's fake: leaves 0 .. B-1 of mass 1."""
    out[:] = np.arange(out.shape[0])
    mass[:] = 1.0


def _written(*args):
    """The compiled priority writes' fake: every check passed, largest priority 1."""
    return 0, np.float32(1.0)


def _fresh_masses(tree, offsets, fanout, u):
    """The backend table's descent with masses, faked: leaves 0 .. B-1 of mass 1."""
    return torch.arange(u.shape[0]), torch.ones(u.shape[0], dtype=torch.float64)


def _weights(mass, beta, out=None, work=None):
    """The backend table's importance weights, faked: ``out``, or an empty float32 tensor."""
    return out if out is not None else torch.empty(mass.shape, dtype=torch.float32)


# each backend table's callables faked while the switch is on (a written priority's code stays 0)
TABLE_FAKES = {"tree_update": _nothing, "tree_update_range": _nothing, "tree_sample": _distinct_leaves,
               "tree_sample_masses": _fresh_masses, "priority_write": _nothing, "masses": _nothing,
               "importance_weights": _weights, "window_gather": _nothing, "history_append": _nothing,
               "history_gather_frames": _nothing, "history_pack_blocks": _nothing}


def _selected(src, dim, index, out=None):
    """The host-only ``torch.index_select``: ``out``, or an empty tensor of the selection's shape
    (one allocation, no copy)."""
    return out if out is not None else src.new_empty((index.shape[0], *src.shape[1:]))


class HostOnly:
    """Benchmark-only switch: while on, the gpubuf ops (history append and gathers, window gathers,
    tree samples and updates, entry points and torch twins, wherever a gpubuf module holds them; the CPU's
    compiled loops),
    storage writes and the data moves the history fast paths make inline (``torch.index_select``,
    ``torch.nan_to_num``, ``Tensor.copy_``) do nothing (an ``index_select`` without ``out`` returns an
    empty tensor of its shape); a tree sample writes leaves 0 .. B-1 (one op).
    The time spent switching is left out by :meth:`clock`."""

    def __init__(self):
        writes = (history_ops.append_twin, history_ops.gather_frames_twin, history_ops.pack_blocks_twin,
                  sequence_ops.gather_twin, tree_ops.update_twin, tree_ops.update_range_twin)
        fakes = {id(f): _nothing for f in writes}
        fakes.update({id(tree_ops.sample_twin): _distinct_leaves})
        # the CPU's compiled loops (compiled by the calls cases() made before this switch is built)
        fakes.update({id(host_loops.tree_sample_masses): _sampled_masses, id(host_loops.priority_update): _written,
                      id(host_loops.priority_write): _written, id(host_loops.priority_masses): _nothing,
                      id(host_loops.masses): _nothing, id(host_loops.importance_weights): _nothing})
        modules = [m for key, m in list(sys.modules.items()) if key.split(".")[0] == "gpubuf"]
        self.swaps = [(m, name, fakes[id(value)], value)
                      for m in modules for name, value in list(vars(m).items()) if id(value) in fakes]
        self.swaps += [(table, name, fake, getattr(table, name)) for table in backends.cached_tables()
                       for name, fake in TABLE_FAKES.items() if getattr(table, name) is not None]
        self.swaps += [(MemoryStorage, "write", _nothing, MemoryStorage.write),
                       (torch, "index_select", _selected, torch.index_select),
                       (torch, "nan_to_num", lambda *a, out=None, **k: out, torch.nan_to_num),
                       (torch.Tensor, "copy_", lambda self, *a, **k: self, None)]  # None: inherited
        self.switching = 0.0  # seconds spent turning the switch on and off

    def wrap(self, fn):
        """``fn`` run with the switch on."""
        def run():
            t0 = time.perf_counter()
            for owner, name, fake, _ in self.swaps:
                setattr(owner, name, fake)
            t1 = time.perf_counter()
            try:
                return fn()
            finally:
                t2 = time.perf_counter()
                for owner, name, _, original in self.swaps:
                    if original is None:
                        delattr(owner, name)
                    else:
                        setattr(owner, name, original)
                self.switching += t1 - t0 + time.perf_counter() - t2
        return run

    def clock(self, sync):
        """:func:`gpubuf.apps.benchmarking.timing.wall_clock` less the time spent switching."""
        def start():
            sync()
            t0, s0 = time.perf_counter(), self.switching

            def stop() -> float:
                sync()
                return (time.perf_counter() - t0 - (self.switching - s0)) * 1e6
            return stop
        return start


def unit_ops(device):
    """(8 x the unit op, the 8 trivial ops once)."""
    a, b, out = (torch.rand(16, device=device) for _ in range(3))
    idx = torch.arange(8, device=device)
    trivial = [lambda: torch.add(a, b, out=out), lambda: torch.mul(a, b, out=out), lambda: torch.sub(a, b, out=out),
               lambda: torch.index_select(a, 0, idx), lambda: torch.empty(16, device=device),
               lambda: out.copy_(a), lambda: out.fill_(1.0), lambda: a[2:10]]

    def unit8():
        for _ in range(8):
            torch.add(a, b, out=out)

    def trivial8():
        for f in trivial:
            f()
    return unit8, trivial8


def rollout(T, rng):
    return Transition(observation=rng.standard_normal((T, E, OBS)).astype(np.float32),
                      action=rng.integers(0, 2, (T, E)).astype(np.int64), reward=np.ones((T, E), np.float32),
                      terminated=np.zeros((T, E), bool), truncated=np.zeros((T, E), bool))


def fields(t: Transition) -> dict:
    return {k: getattr(t, k) for k in LEAVES}


def cases(device):
    """``{call: {contender: fn}}`` for gpubuf, tight (CPU only) and cpprb, on the same data."""
    rng = np.random.default_rng(0)
    hist = HistoryBuffer(E, 8, 1, ("action",), device=device)
    tight_hist = History(E, 8, {"observation": ((1, OBS), torch.float32), "action": ((1, 1), torch.float32)}, 1,
                         ("action",))
    info = {"observation": rng.standard_normal((E, 1, OBS)).astype(np.float32),
            "action": np.zeros((E, 1, 1), np.float32)}
    for _ in range(8):
        hist.append(info)
        tight_hist.append(info)
    outs = {k: torch.empty_like(v) for k, v in hist.get(N).items()}
    tight_outs = {k: torch.empty_like(v) for k, v in outs.items()}
    fill, one = rollout(ROWS, rng), rollout(1, rng)
    uni = TransitionBuffer(E * ROWS, B, one, device=device, seed=0)
    per = PrioritizedTransitionBuffer(E * ROWS, B, one, device=device, seed=0)
    tight_uni, tight_per = Replay(ROWS, E, LEAVES), Replay(ROWS, E, LEAVES, prioritized=True)
    for buf in (uni, per):
        buf.insert(fill)
        buf.sample(unit=TRANSITION)  # trees built
    for t in range(ROWS):
        row = {k: v[t:t + 1] for k, v in fields(fill).items()}
        tight_uni.insert(row)
        tight_per.insert(row)
    row = fields(one)
    idx = np.arange(B, dtype=np.int64)
    td = rng.random(B).astype(np.float32)
    cfg = gpubuf.PlanConfig(horizon=4, receding_horizon=1, history_len=2)
    planner = gpubuf.Planner(cfg, lambda history, ids: torch.zeros(len(ids), 4, 1, device=device), E, 1,
                             device=device)
    step = {"observation": torch.zeros(E, 1, OBS, device=device), "action": torch.zeros(E, 1, 1, device=device)}
    calls = {
        "history append": {"gpubuf": lambda: hist.append(info), "tight": lambda: tight_hist.append(info)},
        "history get(4)": {"gpubuf": lambda: hist.get(N), "tight": lambda: tight_hist.get(N)},
        "history get(4, out=)": {"gpubuf": lambda: hist.get(N, out=outs),
                                 "tight": lambda: tight_hist.get(N, out=tight_outs)},
        "replay insert": {"gpubuf": lambda: uni.insert(one), "tight": lambda: tight_uni.insert(row)},
        "PER insert": {"gpubuf": lambda: per.insert(one), "tight": lambda: tight_per.insert(row)},
        "uniform sample": {"gpubuf": lambda: uni.sample(unit=TRANSITION), "tight": lambda: tight_uni.sample(B)},
        "PER sample": {"gpubuf": lambda: per.sample(unit=TRANSITION, with_replacement=True),
                       "tight": lambda: tight_per.sample(B)},
        "PER sample without replacement": {"gpubuf": lambda: per.sample(unit=TRANSITION),
                                           "tight": lambda: tight_per.sample(B, with_replacement=False)},
        "PER update": {"gpubuf": lambda: per.update_priorities(idx, td),
                       "tight": lambda: tight_per.update_priorities(idx, td)},
        "Planner.act (trivial model)": {"gpubuf": lambda: planner.act(step)},
    }
    if device.type != "cpu":
        for c in calls.values():
            c.pop("tight", None)
    for call, fn in cpprb_cases(rng, idx, td).items():
        calls[call]["cpprb"] = fn
    return calls


def cpprb_cases(rng, idx, td) -> dict:
    """cpprb's insert, sample and update on a full 16k buffer; ``{}`` when cpprb does not import."""
    try:
        import cpprb
    except ImportError:
        return {}
    env = {"obs": {"shape": OBS, "dtype": np.float32}, "act": {"dtype": np.int64}, "rew": {"dtype": np.float32},
           "terminated": {"dtype": np.bool_}, "truncated": {"dtype": np.bool_}}

    def rows(n):
        return {"obs": rng.standard_normal((n, OBS)).astype(np.float32), "act": rng.integers(0, 2, n),
                "rew": np.ones(n, np.float32), "terminated": np.zeros(n, bool), "truncated": np.zeros(n, bool),
                "next_obs": rng.standard_normal((n, OBS)).astype(np.float32)}

    uni = cpprb.ReplayBuffer(E * ROWS, env, next_of="obs")
    per = cpprb.PrioritizedReplayBuffer(E * ROWS, env, next_of="obs", alpha=0.6, eps=1e-6)
    fill, one = rows(E * ROWS), rows(E)
    uni.add(**fill)
    per.add(**fill)
    return {"replay insert": lambda: uni.add(**one), "PER insert": lambda: per.add(**one),
            "uniform sample": lambda: uni.sample(B), "PER sample": lambda: per.sample(B, beta=0.4),
            "PER update": lambda: per.update_priorities(idx, td)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=400)
    p.add_argument("--out", type=Path, help="JSON path (default: results/overhead_<device>.json)")
    args = p.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    calls = cases(device)
    host = HostOnly()
    fns = {(call, who): fn for call, c in calls.items() for who, fn in c.items()}
    fns.update({(call, "host_only"): host.wrap(c["gpubuf"]) for call, c in calls.items()})
    fns[("unit", "one op")], fns[("unit", "8 ops")] = unit_ops(device)
    med = median_us(fns, args.repeats, 1, clock=host.clock(syncer(device)), skip=1, calls=2)
    unit, unit8 = med.pop(("unit", "one op")) / 8, med.pop(("unit", "8 ops")) / 8
    rows = []
    for call in calls:
        us = {who: med.get((call, who)) for who in ("gpubuf", "tight", "cpprb", "host_only")}
        target, host_target = TARGETS.get(call, (None, None))
        r = {"op": call, **{f"{who}_us": v for who, v in us.items()},
             **{f"{who}_units": None if v is None else v / unit for who, v in us.items()},
             "gpubuf_units_of_8_ops": us["gpubuf"] / unit8,
             "gpubuf_over_tight": None if us["tight"] is None else us["gpubuf"] / us["tight"],
             "target_units": target, "host_only_target_units": host_target}
        r["met"] = None if target is None else r["gpubuf_units"] <= target
        r["host_only_met"] = None if host_target is None else r["host_only_units"] <= host_target
        rows.append(r)
    meta = {**machine(device), "torch": torch.__version__, "threads": 1, "repeats": args.repeats,
            "unit": "one torch.add(a, b, out=out) on 16 float32 elements", "unit_us": unit,
            "unit_of_8_ops": "mean of 8 trivial ops (add, mul, sub with out=, index_select, empty, copy_, "
                             "fill_, a slice)", "unit_of_8_ops_us": unit8}
    out = args.out or Path(__file__).parent / "results" / f"overhead_{device.type}.json"
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"host overhead on {device}, torch {torch.__version__}, 1 thread, median of {args.repeats}; "
          f"unit = one trivial op = {unit:.2f} us (mean of 8 trivial ops: {unit8:.2f} us)")
    print("\n| call | gpubuf us | gpubuf | tight | gpubuf / tight | cpprb | host-only | target | host-only target |"
          "\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['op']} | {r['gpubuf_us']:.0f} | {r['gpubuf_units']:.1f} | {_num(r['tight_units'])} | "
              f"{_num(r['gpubuf_over_tight'], 'x')} | {_num(r['cpprb_units'])} | {_num(r['host_only_units'])} | "
              f"{_target(r['target_units'], r['met'])} | {_target(r['host_only_target_units'], r['host_only_met'])} |")
    print("\nunits: multiples of one trivial op; target marks: met / NOT met")


def _num(v, suffix="") -> str:
    return "-" if v is None else f"{v:.1f}{suffix}"


def _target(t, met) -> str:
    return "-" if t is None else f"<= {t} ({'met' if met else 'NOT met'})"


if __name__ == "__main__":
    main()
