"""Replay benchmarks: gpubuf TransitionBuffer / PrioritizedTransitionBuffer against their peers, same run.

The replay suite of ``gpubuf bench`` (:mod:`gpubuf.apps.benchmarking.per` and :mod:`gpubuf.apps.benchmarking.sequences`
say what is timed), with this script's options: a JSON file under benchmarks/results/ and the markdown
table on stdout. A peer that does not import is listed as missing. Run with the venv made by
``benchmarks/setup_peers.sh``:

    .venv-peers/bin/python benchmarks/bench_replay.py            # writes benchmarks/results/replay_<device>.json
"""

import argparse
import os
from dataclasses import replace

import torch

from gpubuf.apps.benchmarking import report, suites


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=20, help="blocks of 5 timed calls per implementation")
    p.add_argument("--log2-sizes", default="17,20,22")
    p.add_argument("--batch", type=int, default=256, help="PER insert/sample/update batch")
    p.add_argument("--peers", default="cpprb,torchrl,flashbax,jaxnasium")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    sizes = replace(suites.Sizes(), log2_sizes=tuple(map(int, args.log2_sizes.split(","))), batch=args.batch,
                    replay_repeats=args.repeats)
    result = suites.run(["replay"], sizes, device, threads=args.threads, peers=[p for p in args.peers.split(",") if p])
    out = args.out or os.path.join(os.path.dirname(__file__), "results", f"replay_{device.type}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    report.write_json(result, out)
    print(report.markdown(result))


if __name__ == "__main__":
    main()
