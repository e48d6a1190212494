"""Optional packages in the tests: ``needs("gymnasium")`` imports one or skips the test (or module) with a reason
naming the pip extra of gpubuf that brings it, so a core-only install (torch and gpubuf alone) runs the rest."""

import importlib
import importlib.util

import pytest

# optional package -> the gpubuf extra that installs it
EXTRA = {
    "numba": "fast", "matplotlib": "apps", "tqdm": "apps", "envpool": "envpool", "gymnasium": "gymnasium",
    "mujoco": "gymnasium", "minari": "export", "h5py": "export", "torchrl": "torchrl", "tensordict": "tensordict",
    "jax": "jax", "gymnax": "jax", "ale_py": "bench", "cpprb": "bench", "flashbax": "bench", "ray": "ray",
}


def needs(module: str):
    """Imports ``module`` and returns its top-level package (``needs("torchrl.data")`` -> ``torchrl``: a submodule
    tells the package from a test folder of the same name on ``sys.path``), or skips: 'needs <package>: pip install
    "gpubuf[<extra>]"'."""
    top = module.split(".")[0]
    try:
        importlib.import_module(module)
        return importlib.import_module(top)
    except ImportError as err:
        extra = EXTRA.get(top, "test")
        pytest.skip(f'needs {top} ({err}): pip install "gpubuf[{extra}]"', allow_module_level=True)


def missing_extra(err: ImportError) -> str | None:
    """The skip reason for ``err`` when it (or its cause) is the import of an optional package that is not
    installed, else None."""
    while err is not None:
        top = (getattr(err, "name", None) or "").split(".")[0]
        if top in EXTRA and importlib.util.find_spec(top) is None:
            return f'needs {top}: pip install "gpubuf[{EXTRA[top]}]"'
        err = err.__cause__ if isinstance(err.__cause__, ImportError) else None
    return None

