"""Prefix-sum tree updates on the GPU: one program vs one many-program launch per level.

For each capacity (2**k leaves, fanout 32, the buffers' tree): scattered updates of K leaves (K = 256, 4096,
65536) and a full range rebuild, each timed with CUDA events (median of ``--repeats``), once forcing the
one-program launch and once the many-program launches (``MANY_PROGRAMS_FROM``), the two interleaved; both
must leave the same tree as the torch twin (leaves exactly, parents to 1e-14). Writes JSON (``--out``) and
prints markdown.

    python benchmarks/bench_tree_update.py --device cuda --log2-sizes 20,24
"""

import argparse
import functools
import json
import sys

import torch

from gpubuf.apps.benchmarking.timing import cuda_event_clock, median_us
from gpubuf.ops import backend_table
from gpubuf.ops.prefix_tree import update_range_twin, update_twin
from gpubuf.replay.sampling.tree import PrefixSumTree


def launch(pt, threshold: int, kernel, *args) -> None:
    """``kernel(*args)`` with many-program launches from ``threshold`` leaves (2**62: one program always);
    ``pt`` is :mod:`gpubuf.kernels.prefix_tree`."""
    pt.MANY_PROGRAMS_FROM = threshold
    kernel(*args)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--log2-sizes", default="20,24")
    p.add_argument("--batches", default="256,4096,65536", help="scattered update sizes K")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda" or not torch.cuda.is_available():
        print("bench_tree_update: needs a CUDA device", file=sys.stderr)
        return 2
    from gpubuf.kernels import prefix_tree as pt

    torch.cuda.set_device(device)
    default = pt.MANY_PROGRAMS_FROM
    rows = []
    for k in (int(x) for x in args.log2_sizes.split(",")):
        cap, F = 2**k, 32
        tree = PrefixSumTree(cap, backend_table(device, "torch"), F)
        g = torch.Generator(device=device).manual_seed(k)
        full = torch.rand(cap, dtype=torch.float64, device=device, generator=g)
        update_range_twin(tree.tree, tree.offsets, F, 0, full)
        cases = [("full rebuild", None)] + [(f"update {K}", int(K)) for K in args.batches.split(",")]
        for case, K in cases:
            if K is None:
                kernel, twin, rest = pt.update_range, update_range_twin, (tree.offsets, F, 0, full)
            else:
                idx = torch.randint(0, cap, (K,), device=device, generator=g)
                vals = torch.rand(cap, dtype=torch.float64, device=device, generator=g)[idx]
                kernel, twin, rest = pt.update, update_twin, (tree.offsets, F, idx, vals)
            want = tree.tree.clone()
            twin(want, *rest)
            modes = {"one program": 2**62, "many programs": 1}
            got = {mode: tree.tree.clone() for mode in modes}
            fns = {mode: functools.partial(launch, pt, threshold, kernel, got[mode], *rest)
                   for mode, threshold in modes.items()}
            # the two modes interleaved, each call timed with CUDA events (the first call compiles and warms)
            row = {"log2_leaves": k, "case": case, **median_us(fns, args.repeats, skip=0, clock=cuda_event_clock())}
            for mode in modes:
                assert torch.equal(got[mode][:cap], want[:cap]), (case, mode)
                torch.testing.assert_close(got[mode], want, rtol=1e-14, atol=0)
            rows.append(row)
            print(f"2**{k} {case}: one {row['one program']:.0f} us, many {row['many programs']:.0f} us",
                  file=sys.stderr, flush=True)
    pt.MANY_PROGRAMS_FROM = default
    print("| leaves | case | one program us | many programs us | one / many |\n|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| 2**{r['log2_leaves']} | {r['case']} | {r['one program']:.0f} | {r['many programs']:.0f} | "
              f"{r['one program'] / r['many programs']:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device), "fanout": 32, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
