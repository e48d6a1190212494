"""The peers gpubuf is measured against: which are wanted, which import, which failed to build."""

import importlib.util
import sys
import traceback
from collections.abc import Callable

# peer -> (modules it needs, how to install it); "deque" is the pure-Python baseline, always there
PEERS = {"deque": ((), None), "cpprb": (("cpprb",), "pip install cpprb"), "rlox": (("rlox",), "pip install rlox"),
         "torchrl": (("torchrl", "tensordict"), "pip install torchrl tensordict"),
         "flashbax": (("flashbax", "jax"), "pip install flashbax jax"),
         "jaxnasium": (("jaxnasium", "jax"), "pip install 'jaxnasium[algs]'")}


class Peers:
    """Builds the wanted peers that import; records the others (``missing``: install hint, ``failed``: error)."""

    def __init__(self, wanted):
        self.wanted = set(wanted)
        self.missing: dict[str, str] = {}
        self.failed: dict[str, str] = {}

    def build(self, name: str, factory: Callable):
        """``factory()`` when ``name`` is wanted and importable, else None (and the reason is recorded)."""
        modules, hint = PEERS[name]
        if name not in self.wanted or name in self.failed:
            return None
        if any(importlib.util.find_spec(m) is None for m in modules):
            self.missing[name] = hint
            return None
        try:
            return factory()
        except Exception as err:  # noqa: BLE001  (a peer that fails is reported, not fatal)
            self.failed[name] = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:160]}"
            traceback.print_exc(limit=1, file=sys.stderr)
            return None

    def build_all(self, builders: dict, *args) -> dict:
        """``{name: builders[name](*args)}`` for each peer :meth:`build` builds."""
        built = {name: self.build(name, lambda make=make: make(*args)) for name, make in builders.items()}
        return {name: contender for name, contender in built.items() if contender is not None}
