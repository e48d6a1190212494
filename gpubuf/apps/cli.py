"""The ``gpubuf`` command. ``gpubuf demo``: EnvPool envs -> replay and histories -> a learned model planned through.
``gpubuf bench``: gpubuf against the installed peers, written as markdown, JSON and a PNG chart. ``gpubuf info``: what
runs here (versions, device, each op's implementation, extras, storage tiers).

The demo itself lives in :mod:`gpubuf.apps.demo` (the learner in :mod:`gpubuf.apps.mbrl`), the benchmarks in
:mod:`gpubuf.apps.benchmarking`; this module parses and validates the options (before any work), shows the demo's
progress bar on a terminal (nothing when stderr is a log file), prints the reports and writes the files."""

import argparse
import json
import os
import platform
import sys
import warnings
from importlib.metadata import version

from gpubuf import __version__
from gpubuf.apps.benchmarking.peers import PEERS


class OneLineParser(argparse.ArgumentParser):
    """Errors are one line on stderr and exit code 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="gpubuf", description="GPU-resident history and replay buffers for RL.")
    # also from a source tree
    parser.add_argument("--version", action="version", version=f"gpubuf {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    demo = commands.add_parser("demo", help="EnvPool envs -> replay and histories -> learned model + CEM, timed")
    demo.add_argument("--env", default="CartPole-v1",
                      help="EnvPool task id (default: CartPole-v1); pixel tasks run random plans, for timing only")
    demo.add_argument("--num-envs", type=int, default=16, help="parallel envs (default: 16)")
    length = demo.add_mutually_exclusive_group()
    length.add_argument("--env-steps", type=int, default=20_000, help="env steps to run (default: 20000)")
    length.add_argument("--steps", type=int,
                        help="env batches to run instead (each is num-envs env steps, or half of them with --async)")
    demo.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    demo.add_argument("--async", dest="async_", action="store_true",
                      help="async EnvPool: batch_size = num_envs/2 (timing variant only)")
    demo.add_argument("--out", default="gpubuf_demo.json",
                      help="JSON file for the numbers (not an image path: .png, .jpg, .jpeg, .svg, .pdf)")
    demo.add_argument("--plot", default=None,
                      help="PNG file for the plot, another file than --out (default: --out with .png)")
    demo.add_argument("--threads", type=int, default=1,
                      help="torch CPU threads (default: 1; the demo's small models run fastest on one)")
    demo.add_argument("--seed", type=int, default=0)
    bench = commands.add_parser("bench", help="gpubuf vs the installed peers: markdown table, JSON, PNG chart")
    bench.add_argument("--suite", default="history,replay", help="comma-separated: history, replay (default: both)")
    bench.add_argument("--quick", action="store_true", help="small sizes and few repeats (about a minute on 2 CPUs)")
    bench.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    bench.add_argument("--repeats", type=int, help="timing repeats of every suite (default: 31 history, 20 replay)")
    bench.add_argument("--n-envs", help="history env counts, comma-separated (default: 16,256,1024)")
    bench.add_argument("--log2-sizes", help="PER capacities as powers of 2, comma-separated (default: 17,20,22)")
    bench.add_argument("--batch", type=int, help="PER insert/sample/update batch (default: 256)")
    bench.add_argument("--peers", default=",".join(PEERS),
                       help=f"peers to run when installed, comma-separated (default: {','.join(PEERS)})")
    bench.add_argument("--threads", type=int, default=1, help="torch (and XLA) CPU threads (default: 1)")
    bench.add_argument("--out", default="gpubuf_bench.md",
                       help="markdown path; the PNG chart and the JSON go beside it (default: gpubuf_bench.md)")
    info = commands.add_parser("info", help="versions, device, what each op runs here, extras, storage tiers")
    info.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    info.add_argument("--json", action="store_true", help="the report as JSON")
    parser.demo, parser.bench, parser.info = demo, bench, info  # the checks report through them
    return parser


def check_device(parser, name):
    """The torch device ``name`` names (None: cuda when available, else cpu), if a tensor can live there."""
    import torch

    try:
        device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError) as err:
        parser.error(f"--device: cannot use {name!r} ({str(err).splitlines()[0]})")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device: expected a cpu or cuda device, got {name!r}")
    return device


def check_positive(parser, *flags):
    """Each ``(flag, value)`` of ``flags`` holds ``None`` or a positive int, else an error naming the flag."""
    for flag, value in flags:
        if value is not None and value < 1:
            parser.error(f"{flag}: expected a positive int, got {value}")


def check_writable(parser, flag, path, *beside):
    """``path`` and the files ``path`` with the suffixes ``beside`` can be written (before any work)."""
    out_dir = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(out_dir) or not os.access(out_dir, os.W_OK):
        parser.error(f"{flag}: cannot write {path!r} (no writable directory {out_dir!r})")
    for file in (path, *(os.path.splitext(path)[0] + suffix for suffix in beside)):
        if os.path.isdir(file):
            parser.error(f"{flag}: cannot write {file!r} (a directory of that name is in the way)")


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".svg", ".pdf")


def check_demo_paths(parser, args):
    """``--out`` (JSON) and ``--plot`` (image, default: ``--out`` with ``.png``) must be two files, and ``--out`` must
    not end in an image suffix: the plot would overwrite the numbers."""
    if args.out.lower().endswith(IMAGE_SUFFIXES):
        parser.error(f"--out: expected a JSON path (the plot goes to --plot), got the image path {args.out!r}")
    args.plot = args.plot or os.path.splitext(args.out)[0] + ".png"
    out, plot = os.path.realpath(args.out), os.path.realpath(args.plot)
    if out == plot or (os.path.exists(out) and os.path.exists(plot) and os.path.samefile(out, plot)):
        parser.error("--out, --plot: expected two different files (the plot would overwrite the numbers), got "
                     f"{args.out!r} and {args.plot!r}")


def check_args(parser, args):
    """Validate what argparse cannot, before any work; returns the torch device."""
    check_demo_paths(parser.demo, args)
    try:
        import envpool
    except ImportError as err:
        parser.demo.error(f"the demo steps EnvPool envs: pip install envpool ({err})")
    from gpubuf.apps.demo import require

    for module, use in (("tqdm", "gpubuf demo's progress bar"), ("matplotlib", "gpubuf demo's plot")):
        try:
            require(module, use)
        except ImportError as err:
            parser.demo.error(str(err))
    parser = parser.demo
    if args.env not in envpool.list_all_envs():
        parser.error(f"--env: unknown EnvPool task {args.env!r} (envpool.list_all_envs() lists them)")
    if args.num_envs < 1 or (args.async_ and args.num_envs < 2):
        parser.error(f"--num-envs: expected at least {2 if args.async_ else 1}, got {args.num_envs}")
    check_positive(parser, ("--steps", args.steps), ("--env-steps", args.env_steps), ("--threads", args.threads))
    if args.async_ and len(envpool.make_spec(args.env).observation_space.shape) == 1:
        parser.error(f"--async: the learning run on {args.env} needs sync envs (its model trains on per-env windows "
                     "of consecutive steps); --async is for pixel tasks such as Pong-v5")
    device = check_device(parser, args.device)
    for flag, path in (("--out", args.out), ("--plot", args.plot)):
        check_writable(parser, flag, path)
    return device


def int_list(parser, flag, text, low):
    """``"16,256"`` -> (16, 256), each at least ``low``; anything else is an error naming ``flag``."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        parser.error(f"{flag}: expected comma-separated ints, got {text!r}")
    if any(v < low for v in values):
        parser.error(f"{flag}: expected ints of at least {low}, got {text!r}")
    return values


MAX_BENCH_ENVS = 8192


def check_bench_args(parser, args):
    """Validate ``gpubuf bench`` options before any work; returns (suites, sizes, device, peers)."""
    from dataclasses import replace

    from gpubuf.apps.benchmarking.suites import QUICK, SUITE_NAMES, Sizes

    parser = parser.bench
    suites = args.suite.split(",")
    if not set(suites) <= set(SUITE_NAMES):
        parser.error(f"--suite: expected a comma-separated subset of {','.join(SUITE_NAMES)}, got {args.suite!r}")
    peers = [p for p in args.peers.split(",") if p]
    if not set(peers) <= set(PEERS):
        parser.error(f"--peers: expected a comma-separated subset of {','.join(PEERS)}, got {args.peers!r}")
    check_positive(parser, ("--repeats", args.repeats), ("--batch", args.batch), ("--threads", args.threads))
    sizes = QUICK if args.quick else Sizes()
    if args.repeats:
        sizes = replace(sizes, history_repeats=args.repeats, replay_repeats=args.repeats)
    if args.n_envs is not None:
        sizes = replace(sizes, n_envs=int_list(parser, "--n-envs", args.n_envs, 1))
        # 64x64x3 frames, 11 steps each, in three copies: 4.5 MB per env
        if max(sizes.n_envs) > MAX_BENCH_ENVS:
            parser.error(f"--n-envs: expected at most {MAX_BENCH_ENVS}, got {max(sizes.n_envs)}")
    sizes = replace(sizes, batch=args.batch or sizes.batch)
    if args.log2_sizes is not None:
        sizes = replace(sizes, log2_sizes=int_list(parser, "--log2-sizes", args.log2_sizes, 1))
    if 2 ** min(sizes.log2_sizes) < sizes.batch:
        parser.error(f"--log2-sizes: every capacity must hold a batch of {sizes.batch}, got {sizes.log2_sizes}")
    # about 100 bytes per transition, in each contender: 6.7 GB each at 2**26
    if max(sizes.log2_sizes) > 26:
        parser.error(f"--log2-sizes: expected at most 26, got {max(sizes.log2_sizes)}")
    if not args.out.endswith(".md"):
        parser.error(f"--out: expected a markdown path ending in .md, got {args.out!r}")
    check_writable(parser, "--out", args.out, ".png", ".json")
    return suites, sizes, check_device(parser, args.device), peers


def run_bench(parser, args) -> int:
    """``gpubuf bench``: run the suites, print the markdown, write it with the chart and the JSON."""
    from gpubuf.apps.benchmarking import report, suites

    names, sizes, device, peers = check_bench_args(parser, args)
    result = suites.run(names, sizes, device, threads=args.threads, peers=peers)
    try:
        md, png, js = report.write(result, args.out)
    except OSError as err:
        parser.bench.error(f"--out: cannot write {err.filename!r} ({err.strerror})")
    print(report.markdown(result))
    if png:
        chart = f"chart to {png}"
    else:
        from gpubuf.apps.demo import EXTRA

        chart = f'no chart (matplotlib is not installed: pip install "gpubuf[{EXTRA}]")'
    print(f"table written to {md}, {chart}, numbers to {js}")
    return 0


def run_demo(args, device) -> dict:
    """Make the envs, run :func:`gpubuf.apps.demo.run` under a progress bar; returns the numbers with versions."""
    import envpool
    import numpy as np
    import torch

    from gpubuf.apps import demo

    tqdm = demo.require("tqdm", "gpubuf demo's progress bar").tqdm
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    batch = args.num_envs // 2 if args.async_ else args.num_envs
    env_steps = args.env_steps if args.steps is None else args.steps * batch
    env = envpool.make(args.env, env_type="gymnasium", num_envs=args.num_envs, batch_size=batch, seed=args.seed)
    # disable=None: no bar at all when stderr is not a terminal (a log file gets no carriage-return frames)
    with tqdm(total=env_steps, unit="step", disable=None, file=sys.stderr, dynamic_ncols=True) as bar:
        def progress(log):
            if log.episodes:
                bar.set_postfix(last10=f"{log.last_mean():.0f}", refresh=False)
            bar.update(log.env_steps - bar.n)

        result = demo.run(env, env_steps, device=device, seed=args.seed, progress=progress,
                          task_cost=demo.TASK_COSTS.get(args.env))
    result["env"] = args.env
    result["versions"] = {"gpubuf": version("gpubuf"), "python": platform.python_version(), "torch": torch.__version__,
                          "numpy": np.__version__, "envpool": envpool.__version__, "machine": platform.machine(),
                          "cpu_threads": torch.get_num_threads()}
    return result


def run_info(parser, args) -> int:
    """``gpubuf info``: the report of :func:`gpubuf.info`, as text or JSON."""
    from gpubuf.apps.info import info

    try:
        report = info(args.device)
    except ValueError as err:
        parser.info.error(f"--{err}")
    print(json.dumps(report, indent=2) if args.json else report)
    return 0


def main(argv=None) -> int:
    # envpool's Box spaces
    warnings.filterwarnings("ignore", message=".*precision lowered by casting.*")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        return run_bench(parser, args)
    if args.command == "info":
        return run_info(parser, args)
    device = check_args(parser, args)
    result = run_demo(args, device)

    from gpubuf.apps.demo import summary_table, write_plot

    print(summary_table(result, args.env))
    try:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        write_plot(result, args.env, args.plot)
    except OSError as err:
        parser.demo.error(f"--out/--plot: cannot write {err.filename!r} ({err.strerror})")
    print(f"numbers written to {args.out}, plot to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
