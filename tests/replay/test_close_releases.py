"""``close()`` always releases a ``storage_dir``, whatever is pending: a deferred priority update that failed its checks
(NaN, an index outside the buffer) is raised after the flush and the release, so the directory re-opens (in this process
and a fresh one) with the priorities the failed update left untouched; a ``with`` block whose body raised lets the
body's exception through and reports the close's own error as a ``RuntimeWarning``."""

import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from fixtures import make_transition

from gpubuf import PrioritizedTransitionBuffer, TransitionBuffer

E = 2
BAD = {  # a deferred update that fails its checks: (indices, td_errors, the error raised later, its words)
    "nan": ([0, 1], [float("nan"), 1.0], ValueError, "NaN or infinite"),
    "index": ([0, 10_000], [1.0, 2.0], IndexError, "indices outside"),
}


def per(path, device):
    return PrioritizedTransitionBuffer(E * 32, 4, make_transition(0, 1, E), device=device, seed=0, storage_dir=path)


def dropped_update(buf, bad: str, graph: bool = False) -> None:
    """Rows, an update written, then a deferred one that fails its checks (not raised yet)."""
    buf.insert(make_transition(0, 12, E))
    buf.update_priorities(torch.arange(4), torch.full((4,), 3.0))
    idx, td, _, _ = BAD[bad]
    idx, td = torch.tensor(idx, device=buf.device), torch.tensor(td, device=buf.device)
    if graph:
        buf.graph_sampler(4).update_priorities(idx, td)
    else:
        buf.update_priorities(idx, td, deferred=True)


def reopened_priorities(path, device) -> torch.Tensor:
    again = per(path, device)
    try:
        assert len(again) == 12 * E
        return again.sampling_mass()
    finally:
        again.close()


@pytest.mark.parametrize("graph", [False, True], ids=["buffer", "graph sampler"])
@pytest.mark.parametrize("bad", list(BAD))
def test_close_releases_the_directory_then_raises_the_pending_update(bad, graph, backend, device, tmp_path):
    buf = per(tmp_path / "d", device)
    dropped_update(buf, bad, graph)
    expected = buf.sampling_mass()  # the failed update wrote nothing
    _, _, error, words = BAD[bad]
    with pytest.raises(error, match=words):
        buf.close()
    assert torch.equal(reopened_priorities(tmp_path / "d", device), expected)  # released by that one close
    buf.close()  # raised once; closing again is harmless
    buf.sample()  # a closed buffer still samples


def test_a_directory_closed_with_a_pending_update_reopens_in_a_fresh_process(device, tmp_path):
    buf = per(tmp_path / "d", device)
    dropped_update(buf, "nan")
    with pytest.raises(ValueError, match="NaN"):
        buf.close()
    code = textwrap.dedent(f"""
        from fixtures import make_transition
        from gpubuf import PrioritizedTransitionBuffer
        buf = PrioritizedTransitionBuffer({E * 32}, 4, make_transition(0, 1, {E}), storage_dir={str(tmp_path / "d")!r})
        assert len(buf) == {12 * E}
        buf.close()
        print("reopened")
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "reopened" in run.stdout, run.stderr[-3000:]
    del buf  # alive until here: the child opened the directory while this buffer still existed


def test_a_with_block_raises_the_pending_update_after_releasing(backend, device, tmp_path):
    with pytest.raises(IndexError, match="indices outside"), per(tmp_path / "d", device) as buf:
        dropped_update(buf, "index")
    reopened_priorities(tmp_path / "d", device)


def test_a_with_block_lets_its_own_exception_through_and_warns_the_pending_update(backend, device, tmp_path):
    with pytest.warns(RuntimeWarning, match=r"close\(\).*KeyError.*ValueError.*NaN"), \
            pytest.raises(KeyError, match="the body's own"), per(tmp_path / "d", device) as buf:
        dropped_update(buf, "nan")
        raise KeyError("the body's own")
    reopened_priorities(tmp_path / "d", device)


def test_a_with_block_whose_body_raised_and_that_closes_cleanly_warns_nothing(device, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(KeyError), TransitionBuffer(E * 32, 4, make_transition(0, 1, E), device=device,
                                                       storage_dir=tmp_path / "d") as buf:
            buf.insert(make_transition(0, 4, E))
            raise KeyError("body")
    TransitionBuffer(E * 32, 4, make_transition(0, 1, E), device=device, storage_dir=tmp_path / "d").close()


def test_close_releases_the_directory_when_its_flush_fails(device, tmp_path, monkeypatch):
    buf = TransitionBuffer(E * 32, 4, make_transition(0, 1, E), device=device, storage_dir=tmp_path / "d")
    buf.insert(make_transition(0, 4, E))

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(buf.storage.dir, "save_state", full_disk)
    with pytest.raises(OSError, match="No space"):
        buf.close()
    monkeypatch.undo()
    TransitionBuffer(E * 32, 4, make_transition(0, 1, E), device=device, storage_dir=tmp_path / "d").close()


def test_a_memory_buffer_still_raises_a_pending_update_at_close(device):
    buf = PrioritizedTransitionBuffer(E * 32, 4, make_transition(0, 1, E), device=device)
    buf.insert(make_transition(0, 4, E))
    buf.update_priorities(torch.tensor([0], device=buf.device), torch.tensor([float("inf")], device=buf.device),
                          deferred=True)
    with pytest.raises(ValueError, match="NaN or infinite"):
        buf.close()
    buf.close()
