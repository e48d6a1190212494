"""A bench result -> markdown tables, a PNG chart (log-scale grouped bars) and JSON, side by side.

A result is ``{"machine", "versions", "settings", "missing", "failed", "rows"}``; rows as in
:mod:`gpubuf.apps.benchmarking`. "gpubuf speedup" is a contender's median over gpubuf's on the same case and op."""

import importlib.util
import json
import os
from textwrap import wrap

SUITES = {"history": "HistoryBuffer: per step and env pixels (1, 64, 64, 3) uint8 and action "
                     "(1, 2) float32, action_block 5, max_len 11",
          "replay": "Replay: PER transitions obs float32[17], action float32[6] on a full buffer "
                    "of N (sample: with replacement and importance weights); seq: windows of 64x64x3 uint8 frames"}


def speedups(rows: list[dict]) -> list[float | None]:
    """Per row: its median / gpubuf's median on the same suite, case and op (None for gpubuf itself)."""
    base = {(r["suite"], r["case"], r["op"]): r["us"] for r in rows if r["impl"] == "gpubuf"}
    return [None if r["impl"] == "gpubuf" else r["us"] / base[r["suite"], r["case"], r["op"]] for r in rows]


def markdown(result: dict, chart: str | None = None) -> str:
    """The header (machine, versions, settings, missing peers) and one table per suite."""
    m, s = result["machine"], result["settings"]
    installed = ", ".join(f"{k} {v}" for k, v in result["versions"].items() if v)
    lines = ["# gpubuf bench", "",
             f"- machine: {m['platform']}, {m['cpus']} CPUs, python {m['python']}",
             f"- device: {m['device']} ({m['device_name']}), {m['torch_threads']} torch thread(s)",
             f"- versions: {installed}",
             "- method: contenders interleaved in one process (rotating order), medians per call over "
             f"{s['history_repeats']} repeats (history) and {s['replay_repeats']} repeats of 5 calls (replay); "
             "gpubuf speedup = the contender's median / gpubuf's (above 1: gpubuf is faster)"]
    if result["missing"]:
        lines.append("- not installed: " + ", ".join(f"{k} ({v})" for k, v in result["missing"].items()))
    for name, why in result["failed"].items():
        lines.append(f"- failed: {name}: {why}")
    ratio = speedups(result["rows"])
    for suite, title in SUITES.items():
        rows = [(r, x) for r, x in zip(result["rows"], ratio, strict=True) if r["suite"] == suite]
        if not rows:
            continue
        lines += ["", f"## {suite}", "", title, "", "| case | op | impl | median us | gpubuf speedup |",
                  "|---|---|---|---:|---:|"]
        lines += [f"| {r['case']} | {r['op']} | {r['impl']} | {r['us']:.1f} | {'-' if x is None else f'{x:.2f}x'} |"
                  for r, x in rows]
    if chart:
        lines += ["", f"![median time per op]({chart})"]
    return "\n".join(lines) + "\n"


def write_chart(rows: list[dict], path: str) -> None:
    """One PNG: per suite, grouped bars of median us per call (log scale), one bar per contender per op."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    suites = [s for s in SUITES if any(r["suite"] == s for r in rows)]
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    colors = {name: f"C{i % 10}" for i, name in enumerate(impls)}
    widest = max(len({(r["case"], r["op"]) for r in rows if r["suite"] == s}) for s in suites)
    fig = Figure(figsize=(max(12, 1.4 * widest), 4.5 * len(suites)), layout="constrained")
    FigureCanvasAgg(fig)
    for ax, suite in zip(fig.subplots(len(suites), 1, squeeze=False)[:, 0], suites, strict=True):
        sub = [r for r in rows if r["suite"] == suite]
        groups = list(dict.fromkeys((r["case"], r["op"]) for r in sub))
        for x, (case, op) in enumerate(groups):
            bars = [r for r in sub if (r["case"], r["op"]) == (case, op)]
            width = 0.8 / len(bars)
            for j, r in enumerate(bars):
                ax.bar(x - 0.4 + (j + 0.5) * width, r["us"], width, color=colors[r["impl"]])
        ax.legend(handles=[Patch(color=colors[n], label=n) for n in dict.fromkeys(r["impl"] for r in sub)],
                  fontsize=8, ncols=4)
        ax.set_xticks(range(len(groups)), ["\n".join(wrap(case, 16) + wrap(op, 16)) for case, op in groups], fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("median us per call (log)")
        ax.set_title(f"gpubuf bench: {suite}")
    fig.savefig(path, dpi=100)


def write_json(result: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def write(result: dict, md_path: str) -> tuple[str, str | None, str]:
    """Writes ``md_path``, the chart and the JSON beside it (same stem); returns the three paths.

    Without matplotlib (a source tree on a bare machine) there is no chart: its path is None."""
    stem = os.path.splitext(md_path)[0]
    png = stem + ".png" if importlib.util.find_spec("matplotlib") else None
    js = stem + ".json"
    write_json(result, js)
    with open(md_path, "w") as f:
        f.write(markdown(result, chart=png and os.path.basename(png)))
    if png:
        write_chart(result["rows"], png)
    return md_path, png, js
