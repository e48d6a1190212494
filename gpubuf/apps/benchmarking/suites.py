"""Runs the chosen suites at default (the README's recorded tables) or quick sizes; returns one result dict."""

import os
import sys
from dataclasses import asdict, dataclass

import torch

import gpubuf
from gpubuf.apps.benchmarking import history, per, sequences
from gpubuf.apps.benchmarking.peers import PEERS, Peers
from gpubuf.apps.benchmarking.timing import machine, versions

SUITE_NAMES = ("history", "replay")


@dataclass
class Sizes:
    """n_envs: history runs; log2_sizes, batch: PER capacities and batch; seq_envs x seq_steps: sequence frames."""

    n_envs: tuple[int, ...] = (16, 256, 1024)
    log2_sizes: tuple[int, ...] = (17, 20, 22)
    batch: int = 256
    seq_envs: int = 64
    seq_steps: int = 1024
    history_repeats: int = 31
    replay_repeats: int = 20


QUICK = Sizes(n_envs=(16, 64), log2_sizes=(12, 16), seq_envs=8, seq_steps=64, history_repeats=5, replay_repeats=3)


def progress(rows: list[dict]) -> list[dict]:
    """One stderr line per case and op: each contender's median; returns ``rows``."""
    for key in dict.fromkeys((r["suite"], r["case"], r["op"]) for r in rows):
        cells = ", ".join(f"{r['impl']} {r['us']:.0f}us" for r in rows if (r["suite"], r["case"], r["op"]) == key)
        print(f"{' '.join(key)}: {cells}", file=sys.stderr, flush=True)
    return rows


def run(suites, sizes: Sizes, device: torch.device, threads: int = 1, peers=tuple(PEERS)) -> dict:
    """The result of :mod:`gpubuf.apps.benchmarking.report`: rows of every suite, machine, versions, missing peers."""
    if threads == 1:  # before the JAX peers import jax
        os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the JAX peers run on the host, as the others do
    torch.set_num_threads(threads)
    found = Peers(peers)
    rows = []
    if "history" in suites:
        for n in sizes.n_envs:
            rows += progress(history.run(n, device, sizes.history_repeats, found))
    if "replay" in suites:
        for lg in sizes.log2_sizes:
            rows += progress(per.run(lg, sizes.batch, device, sizes.replay_repeats, found))
        rows += progress(sequences.run(sizes.seq_envs, sizes.seq_steps, device, sizes.replay_repeats, found))
    return {"machine": machine(device),
            "settings": asdict(sizes) | {"suites": list(suites), "threads": threads},
            "versions": {"gpubuf": gpubuf.__version__}
            | versions(["torch", "numpy", "cpprb", "rlox", "torchrl", "tensordict", "flashbax", "jax", "jaxnasium"]),
            "missing": found.missing, "failed": found.failed, "rows": rows}
