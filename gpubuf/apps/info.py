"""What runs here: ``gpubuf info`` and :func:`gpubuf.info`.

One report for a user debugging speed or a GPU failure: the versions gpubuf runs with (Python, gpubuf, torch, triton,
numba, CUDA and the driver), the device and its compute capability, the backend a buffer built there gets and what each
of its operations runs (a Triton kernel, a compiled numba loop or the pure-torch twin), which optional extras import,
and the storage tiers a replay buffer can use there."""

import importlib.util
import os
import platform

import torch

from gpubuf.apps.benchmarking.timing import versions as installed_versions
from gpubuf.ops import backend_table, resolve_device

# extra -> the packages it brings (an extra imports when every one of them does)
EXTRAS = {"fast": ("numba",), "apps": ("matplotlib", "tqdm"), "envpool": ("envpool",), "gymnasium": ("gymnasium",),
          "jax": ("jax",), "export": ("minari", "h5py"), "torchrl": ("torchrl",), "tensordict": ("tensordict",),
          "ray": ("ray",)}


class Report(dict):
    """The report as a dict of sections (``versions``, ``device``, ``ops``, ``extras``, ``storage_tiers``);
    ``str()`` gives the text ``gpubuf info`` prints."""

    def __str__(self) -> str:
        lines = []
        for section, values in self.items():
            lines.append(f"{section}:")
            lines += [f"  {key}: {value}" for key, value in values.items()]
        return "\n".join(lines)


def versions() -> dict:
    """Python, gpubuf, torch, triton, numba (None where not installed), CUDA (torch's build) and the driver."""
    found = installed_versions(("gpubuf", "triton", "numba"))
    return {"python": platform.python_version(), "gpubuf": found["gpubuf"], "torch": torch.__version__,
            "triton": found["triton"], "numba": found["numba"], "cuda": torch.version.cuda, "driver": _nvidia_driver()}


def _nvidia_driver() -> str | None:
    """The NVIDIA kernel driver's version (Linux), None where there is none."""
    try:
        with open("/proc/driver/nvidia/version") as f:
            words = f.readline().split()
    except OSError:
        return None
    return next((w for w in words if w[:1].isdigit() and "." in w), None)


def device_report(device: torch.device) -> dict:
    """The device, its name and compute capability, and the backend a buffer built there gets."""
    report = {"device": str(device), "name": platform.processor() or platform.machine(), "capability": None}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        report.update(name=props.name, capability=f"sm_{props.major}{props.minor}",
                      memory_gib=round(props.total_memory / 2**30, 1))
    table = backend_table(device)
    report.update(backend=table.name, GPUBUF_BACKEND=os.environ.get("GPUBUF_BACKEND") or None,
                  TRITON_INTERPRET=table.interpreted, GPUBUF_NUMBA=os.environ.get("GPUBUF_NUMBA") or None)
    return report


def ops_report(device: torch.device) -> dict:
    """Each operation -> what an eager call of a buffer on ``device`` runs (its backend table's answer)."""
    return backend_table(device).implementations()


def extras_report() -> dict:
    """Each extra -> ``"yes"``, or what is missing (``"no (numba)"``); checked without importing them."""
    report = {}
    for extra, packages in EXTRAS.items():
        missing = [p for p in packages if importlib.util.find_spec(p) is None]
        report[extra] = f"no ({', '.join(missing)}; pip install \"gpubuf[{extra}]\")" if missing else "yes"
    return report


def tiers_report(device: torch.device) -> dict:
    """The storage tiers a replay buffer sampling on ``device`` can keep its rows in."""
    on_gpu = device.type == "cuda"
    return {"device": f"yes ({device})",
            "host memory (storage_device='cpu')": "yes, pinned staging to the GPU" if on_gpu else "yes (the device)",
            "files (storage_dir=...)": "yes, memory-mapped" if os.name == "posix" else "yes"}


def info(device: str | torch.device | None = None) -> Report:
    """The report for ``device`` (default: ``cuda`` when available, else ``cpu``; ``ValueError`` naming ``device``
    when it cannot be used here). ``print(gpubuf.info())`` shows it as ``gpubuf info`` does."""
    dev = resolve_device(device)
    return Report(versions=versions(), device=device_report(dev), ops=ops_report(dev), extras=extras_report(),
                  storage_tiers=tiers_report(dev))
