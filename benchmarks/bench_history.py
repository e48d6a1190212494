"""HistoryBuffer vs a per-env deque baseline vs the copy floor: ``append`` and ``get(3)``.

The history suite of ``gpubuf bench`` (:mod:`gpubuf.apps.benchmarking.history`), with this script's options:
a JSON file under benchmarks/results/ and the markdown table on stdout.

    python benchmarks/bench_history.py                       # CPU, n_envs 16 256 1024
    python benchmarks/bench_history.py --device cuda --n-envs 1024 4096
"""

import argparse
from dataclasses import replace
from pathlib import Path

import torch

from gpubuf.apps.benchmarking import report, suites


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--n-envs", type=int, nargs="+", default=[16, 256, 1024])
    p.add_argument("--repeats", type=int, default=31)
    p.add_argument("--no-deque", action="store_true", help="skip the (slow) deque baseline")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/history_<device>.json)")
    args = p.parse_args()
    device = torch.device(args.device)
    sizes = replace(suites.Sizes(), n_envs=tuple(args.n_envs), history_repeats=args.repeats)
    result = suites.run(["history"], sizes, device, peers=[] if args.no_deque else ["deque"])
    out = Path(args.out or Path(__file__).parent / "results" / f"history_{device.type}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    report.write_json(result, str(out))
    print(report.markdown(result))


if __name__ == "__main__":
    main()
