"""Shared fixtures: every contract test runs on both backends.

Without CUDA, the Triton backend runs through the interpreter on CPU tensors (``TRITON_INTERPRET=1``
must be set before triton is imported, hence here). With CUDA, the triton backend runs natively.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch):
    """Forces the buffers built in the test onto one backend; yields its name."""
    monkeypatch.setenv("GPUBUF_BACKEND", request.param)
    return request.param


@pytest.fixture
def device():
    return DEVICE


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)
