"""Registers, shared memory and spills of every Triton kernel variant, compiled ahead of time for sm_80
and sm_90 with no GPU (``python benchmarks/kernel_resources.py`` -> results/kernel_resources.json and a
markdown table in results/kernel_resources.md and on stdout: one row per kernel and arch, ranges over its
dtype/index-width variants)."""

import json
import os
import subprocess
import sys
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    rows = json.loads(subprocess.run([sys.executable, "-m", "gpubuf.kernels.signatures", "80", "90"], env=env,
                                     capture_output=True, text=True, check=True).stdout)
    import triton

    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "kernel_resources.json"), "w") as f:
        json.dump({"triton": triton.__version__, "rows": rows}, f, indent=1)
    groups = defaultdict(list)
    for r in rows:
        groups[(r["kernel"].split("(")[0], r["arch"])].append(r)
    lines = [f"Triton {triton.__version__}, ptxas from the wheel; {len(rows)} variants compiled", "",
             "| kernel | arch | variants | registers | shared B | spills B | warps | errors |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for (name, arch), rs in sorted(groups.items()):
        ok = [r for r in rs if "error" not in r]

        def span(key, ok=ok):
            vals = [r[key] for r in ok]
            return "-" if not vals else (f"{min(vals)}" if min(vals) == max(vals) else f"{min(vals)}-{max(vals)}")

        spills = max((r["local"] + r["stack"] for r in ok), default=0)
        lines.append(f"| {name} | {arch} | {len(rs)} | {span('registers')} | {span('shared')} | {spills} | "
                     f"{span('num_warps')} | {len(rs) - len(ok)} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(HERE, "results", "kernel_resources.md"), "w") as f:
        f.write(text)
    print(text, end="")


if __name__ == "__main__":
    main()
