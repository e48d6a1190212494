"""Shared fixtures: every contract test runs on both backends.

Without CUDA, the Triton backend runs through the interpreter on CPU tensors (``TRITON_INTERPRET=1``
must be set before triton is imported, hence here). With CUDA, the interpreter stays off and the Triton
backend runs natively: kernel tests put their tensors on ``DEVICE``, and a test whose buffers must live on
the host takes ``host_backend``, whose ``triton`` case is skipped unless the interpreter is on.

``GPUBUF_TEST_TIMEOUT=<seconds>`` fails any test running longer (the device script sets it: one stuck test
must not eat a whole GPU loan).
"""

import contextlib
import os
import signal

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")

DEVICE = "cuda" if HAS_CUDA else "cpu"
# Child processes the tests start (subprocess, spawn) import the shared test modules (fixtures, snapshots,
# history_model, ...) by name, as the tests do through pytest's ``pythonpath``.
TESTS = os.path.dirname(os.path.abspath(__file__))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)
# ``scripts/test`` sets GPUBUF_TEST_INSTALLED=1: the suite must then run the installed wheel, never the checkout.
ROOT = os.path.dirname(TESTS)
if os.environ.get("GPUBUF_TEST_INSTALLED") == "1":
    import gpubuf

    if os.path.dirname(os.path.abspath(gpubuf.__file__)) == os.path.join(ROOT, "gpubuf"):
        pytest.exit(f"GPUBUF_TEST_INSTALLED=1 but gpubuf imports from the checkout ({gpubuf.__file__}); install "
                    "the wheel (scripts/test does) and run pytest from a venv, not with the checkout on sys.path",
                    returncode=3)
    os.environ["PYTHONSAFEPATH"] = "1"  # child pythons started in the checkout do not import its gpubuf either
NO_HOST_TRITON = ("Triton runs host (CPU) tensors only through its interpreter (TRITON_INTERPRET=1), which is off "
                  "when CUDA is present; this case's buffers live on the host")


@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch):
    """Forces the buffers built in the test onto one backend; yields its name. Tests taking it build their
    buffers on ``device`` (the GPU when present)."""
    monkeypatch.setenv("GPUBUF_BACKEND", request.param)
    return request.param


@pytest.fixture(params=["compiled", "torch"])
def host_loops(request, monkeypatch):
    """Runs the test with the CPU's compiled host loops (numba) and again with the pure-torch twins; yields which."""
    from gpubuf.ops import host_loops as loops

    if request.param == "compiled" and not loops.ENABLED:
        pytest.skip('needs numba: pip install "gpubuf[fast]"')
    monkeypatch.setattr(loops, "ENABLED", request.param == "compiled")
    return request.param


@pytest.fixture(params=["torch", "triton"])
def host_backend(request, monkeypatch):
    """As ``backend``, for tests whose buffers live on the host: ``triton`` needs the interpreter (skipped
    without it, saying so)."""
    if request.param == "triton" and not INTERPRET:
        pytest.skip(NO_HOST_TRITON)
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


def _limit() -> int:
    try:
        return int(os.environ.get("GPUBUF_TEST_TIMEOUT", "0"))
    except ValueError:
        return 0


@contextlib.contextmanager
def _time_limit(item):
    """Per-test time limit from ``GPUBUF_TEST_TIMEOUT`` (SIGALRM: main thread, POSIX)."""
    limit = _limit()
    if limit <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def expired(signum, frame):
        pytest.fail(f"{item.nodeid}: over GPUBUF_TEST_TIMEOUT={limit} s", pytrace=True)

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(limit)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    _skip_when_an_extra_is_missing((yield))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _time_limit(item):
        outcome = yield
    _skip_when_an_extra_is_missing(outcome)


def _skip_when_an_extra_is_missing(outcome) -> None:
    """A test (or its fixtures) stopped by an optional package that is not installed (a core-only install) is
    skipped, naming the extra that brings the package; a package that is installed but fails to import still
    fails the test."""
    from extras import missing_extra

    err = outcome.excinfo[1] if outcome.excinfo else None
    why = missing_extra(err) if isinstance(err, ImportError) else None
    if why:
        outcome.force_exception(pytest.skip.Exception(why))

