"""Module paths of gpubuf's flat layout before 0.2.0 (``gpubuf.envpool``, ``gpubuf.prioritized``, ...): still
importable through 0.2.x, each import warning with a ``DeprecationWarning`` that names the path to use, and removed
in 0.3.0. Pickles of buffers made before 0.2.0 name such paths, so they load too (with the warning); pickles made
now name only ``gpubuf`` itself (``gpubuf._rebuild_buffer`` and the buffer's public name), which no move breaks."""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

REMOVED_IN = "0.3.0"
# earlier module path -> the module that holds it now
MOVED = {
    **{f"gpubuf.{m}": f"gpubuf._core.{m}"
       for m in ("checkpoint", "concurrency", "copies", "inputs", "staging", "state", "transition")},
    **{f"gpubuf.{m}": f"gpubuf.replay.{m}" for m in ("prioritized", "ring", "steady_insert")},
    **{f"gpubuf.{m}": f"gpubuf.replay.sampling.{m}" for m in ("episode_marks", "samplers")},
    "gpubuf.storage": "gpubuf.replay.storage.memory", "gpubuf.storage_dir": "gpubuf.replay.storage.directory",
    "gpubuf.tiers": "gpubuf.replay.storage.tiers",
    # the flat gpubuf.replay of 0.2.0's first layout, laid out by job since
    **{f"gpubuf.replay.{m}": f"gpubuf.replay.sampling.{m}"
       for m in ("device_priorities", "episode_marks", "graph_sampler", "readers", "sample_args", "samplers",
                 "selectors", "stacked", "tree")},
    **{f"gpubuf.replay.{m}": f"gpubuf.replay.feeds.{m}"
       for m in ("export", "process_writers", "rate_limiter", "write_backs", "writer_doors", "writer_hub")},
    **{f"gpubuf.replay.storage_{m}": f"gpubuf.replay.storage.{m}" for m in ("files", "format", "journal", "lock")},
    "gpubuf.replay.storage_dir": "gpubuf.replay.storage.directory",
    "gpubuf.replay.tiers": "gpubuf.replay.storage.tiers",
    **{f"gpubuf.replay.shard_{m}": f"gpubuf.replay.sharded.{m}" for m in ("priorities", "sampling", "transport",
                                                                        "windows")},
    **{f"gpubuf.{m}": f"gpubuf.apps.{m}" for m in ("benchmarking", "cli", "demo", "mbrl")},
    **{f"gpubuf.{m}": f"gpubuf.sources.{m}" for m in ("envpool", "wrappers")},
    # renamed as they moved
    "gpubuf.distributed": "gpubuf.replay.sharded.buffer",
    "gpubuf.graph_sampling": "gpubuf.replay.sampling.graph_sampler",
    "gpubuf.interrupts": "gpubuf._core.signals", "gpubuf.prefix_tree": "gpubuf.replay.sampling.tree",
    "gpubuf.replay_config": "gpubuf.replay.config", "gpubuf.stacked_sampling": "gpubuf.replay.sampling.stacked",
}


def warn_moved(old: str) -> None:
    warnings.warn(f"{old} is deprecated since gpubuf 0.2.0 and will be removed in {REMOVED_IN}: import "
                  f"{MOVED[old]} instead (or the name from gpubuf itself)", DeprecationWarning, stacklevel=3)


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an earlier module path (``import gpubuf.envpool``) as the module that holds it now, with a
    ``DeprecationWarning``: both names are the same module object, whose spec stays its own. It answers for the
    names of :data:`MOVED` only."""

    def __init__(self):
        self.specs = {}

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec):
        warn_moved(spec.name)
        module = importlib.import_module(MOVED[spec.name])
        self.specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module):
        module.__spec__ = self.specs.pop(module.__spec__.name, module.__spec__)  # the real module's spec

    def get_code(self, fullname):
        """The code of the module that holds an earlier path, for ``python -m gpubuf.cli`` (runpy)."""
        spec = importlib.util.find_spec(MOVED[fullname])
        return spec.loader.get_code(spec.name)


def install() -> None:
    """Adds the finder once (a re-import of gpubuf does not add a second)."""
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(MovedModules())
