"""A damaged storage_dir is refused, never re-created over or guessed at; a flush that cannot write its state
changes nothing; a process forked from the owner may read the directory but never write it.

Every refusal is checked twice: the error names the file (or argument) and the directory is byte for byte as
before, its lock file included.
"""

import errno
import json
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch
from test_storage_dir_durability import E, M, as_before_the_journal, held_rows, rows

from gpubuf import PrioritizedTransitionBuffer, TransitionBuffer


def make(path, cls=PrioritizedTransitionBuffer):
    return cls(E * M, 8, rows(1, 0, width=3), device="cpu", storage_dir=path)


def flushed(path, cls=PrioritizedTransitionBuffer):
    """A closed (flushed) directory holding 5 rows of id 3 (priorities 2 and 3 at starts 0, 1 when prioritized)."""
    buf = make(path, cls).insert(rows(5, 3, width=3))
    if cls is PrioritizedTransitionBuffer:
        buf.update_priorities([0, 1], [2.0, 3.0])
    buf.close()
    return path


def snapshot(path):
    """{name: bytes} of every file of the directory (the lock file too)."""
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file() and not p.is_symlink()}


def refused(path, match, cls=PrioritizedTransitionBuffer, error=ValueError):
    """Opening ``path`` raises ``error`` matching ``match`` and changes nothing in it."""
    before = snapshot(path) if path.exists() else None
    with pytest.raises(error, match=match) as failed:
        make(path, cls)
    assert (snapshot(path) if path.exists() else None) == before
    return failed.value


# ---------------------------------------------------------------------------------------------- no gpubuf.json


@pytest.mark.parametrize("kept", [
    "all", "leaf0.bin", "leaf3.bin", "counters.bin", "state.pt", "counters.tmp", "state.pt.tmp", "gpubuf.tmp",
])
@pytest.mark.parametrize("lock", [True, False])
def test_a_directory_that_lost_gpubuf_json_is_never_created_over(tmp_path, kept, lock):
    path = flushed(tmp_path / "b")
    (path / "gpubuf.json").unlink()
    if kept != "all":
        for p in path.iterdir():
            if p.name not in (kept, "lock"):
                p.unlink()
        if not (path / kept).exists():  # a temporary file of a write cut short
            (path / kept).write_bytes(b"partial")
    if not lock:
        (path / "lock").unlink()
    err = refused(path, f"storage_dir: '{path}' holds a buffer's files \\(.*{kept if kept != 'all' else 'leaf0.bin'}"
                        ".*\\) but no gpubuf.json")
    assert "nothing in it was changed" in str(err) and "restore its gpubuf.json, or remove the directory" in str(err)
    assert (path / "lock").exists() == lock  # a lock file made by the refused open is removed again


def test_an_empty_or_missing_directory_or_one_of_other_files_is_created_fresh(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    (tmp_path / "other" / "lock").write_text("pid 1 on elsewhere\n")  # a lock file alone holds no rows
    for name in ("empty", "missing/deeper", "other"):
        buf = make(tmp_path / name).insert(rows(2, 1, width=3))
        assert len(buf) == 2 * E
        buf.close()
        assert len(make(tmp_path / name)) == 2 * E
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


def test_a_dangling_gpubuf_json_link_is_not_taken_for_a_missing_one(tmp_path):
    path = flushed(tmp_path / "b")
    (path / "gpubuf.json").unlink()
    os.symlink(tmp_path / "nowhere.json", path / "gpubuf.json")
    refused(path, "storage_dir: cannot read .*gpubuf.json")


# ---------------------------------------------------------------------------------------------- counters.bin


def journal_words(path):
    return np.fromfile(path / "counters.bin", dtype=np.int64)


@pytest.mark.parametrize("flush", [True, False])
def test_a_journal_cut_to_the_length_of_the_earlier_format_is_refused(tmp_path, flush):
    path = tmp_path / "b"
    buf = make(path, TransitionBuffer).insert(rows(5, 3, width=3))
    if flush:
        buf.flush()
    del buf
    words = journal_words(path)
    (path / "counters.bin").write_bytes(words[:3].tobytes())
    refused(path, "storage_dir: .*counters.bin holds 24 bytes, .* but gpubuf.json was written with the 12-word "
                  "journal.*a damaged \\(cut short\\?\\) row journal", TransitionBuffer)


def test_a_zeroed_journal_is_named_beside_the_state_it_cannot_follow(tmp_path):
    """Zeros are a journal of an empty ring that never flushed; the state says two flushes: both files are named."""
    path = tmp_path / "b"
    buf = make(path, TransitionBuffer).insert(rows(5, 3, width=3))
    buf.flush()
    buf.close()
    (path / "counters.bin").write_bytes(bytes(journal_words(path).nbytes))
    refused(path, r"state.pt cannot be restored .*saved by flush 2 with \d+ rows ever written, which the row "
                  r"journal .*counters.bin \(0 flushes, 0 rows ever written\) cannot follow", TransitionBuffer)


def test_a_cut_journal_of_a_directory_made_before_the_journal_was_recorded_is_refused_by_its_state(tmp_path):
    """A journal-era directory made before gpubuf.json named the journal: a state.pt numbered by a flush tells."""
    path = flushed(tmp_path / "b", TransitionBuffer)
    meta = json.loads((path / "gpubuf.json").read_text())
    del meta["journal"]
    (path / "gpubuf.json").write_text(json.dumps(meta))
    words = journal_words(path)
    assert words[0] in (0, 1) and words[1] == 0  # active slot, clean
    (path / "counters.bin").write_bytes(np.array([0, 0, 0], np.int64).tobytes())  # counters that fit the ring
    refused(path, "counters.bin holds 24 bytes, .* but state.pt was saved by flush 1 of the journal",
            TransitionBuffer)
    (path / "state.pt").unlink()  # never flushed: the counters are checked as the earlier format kept them
    (path / "counters.bin").write_bytes(np.array([1, 0, 5], np.int64).tobytes())
    refused(path, r"counters.bin holds 24 bytes, .*\(position 1, rows held 0, rows ever written 5\) they are not a "
                  "ring of 32 rows per env", TransitionBuffer)


@pytest.mark.parametrize("counters", [
    (M, 5, 5),  # position past the ring
    (-1, 5, 5),
    (5, M + 1, M + 1),  # rows past it
    (5, -1, 5),
    (5, 5, 4),  # fewer rows ever written than held
    (3, 5, 5),  # a ring not yet full writes at its row count
    (5, 5, 9),  # ... having written every row it holds
    (0, M, M - 1),
])
def test_counters_of_the_earlier_format_that_do_not_fit_the_ring_are_refused(tmp_path, counters):
    path = flushed(tmp_path / "b", TransitionBuffer)
    as_before_the_journal(path, counters)
    refused(path, f"storage_dir: .*counters.bin holds 24 bytes, .*\\(position {counters[0]}, rows held "
                  f"{counters[1]}, rows ever written {counters[2]}\\) they are not a ring", TransitionBuffer)


@pytest.mark.parametrize("counters, held", [((5, 5, 5), 5), ((0, 0, 0), 0), ((7, M, 3 * M + 7), M)])
def test_counters_of_the_earlier_format_that_fit_the_ring_open(tmp_path, counters, held):
    path = tmp_path / "b"
    make(path, TransitionBuffer).insert(rows(M, 3, width=3)).close()
    as_before_the_journal(path, counters)
    state = torch.load(path / "state.pt", weights_only=True)
    torch.save({**state, "total": min(state["total"], counters[2])}, path / "state.pt")
    buf = make(path, TransitionBuffer)
    assert len(buf) == held * E
    assert journal_words(path).size == 12


def test_a_directory_of_the_earlier_format_is_converted_only_once_it_opened(tmp_path):
    path = flushed(tmp_path / "b", TransitionBuffer)
    as_before_the_journal(path, (5, 5, 5))
    (path / "state.pt").write_bytes((path / "state.pt").read_bytes()[:100])
    refused(path, "state.pt cannot be restored", TransitionBuffer)  # counters.bin still its 24 bytes


@pytest.mark.parametrize("size", [0, 8, 16, 23, 25, 32, 95, 97, 192])
def test_a_journal_of_any_other_length_is_refused(tmp_path, size):
    path = flushed(tmp_path / "b")
    data = journal_words(path).tobytes()
    (path / "counters.bin").write_bytes((data * 2)[:size])
    refused(path, "storage_dir: .*counters.bin is missing or is not the row journal "
                  f"\\(12 int64 words, 96 bytes; it is {size} bytes\\)")


def test_a_missing_journal_is_refused(tmp_path):
    path = flushed(tmp_path / "b")
    (path / "counters.bin").unlink()
    refused(path, "storage_dir: .*counters.bin is missing or is not the row journal .*it is missing")


@pytest.mark.parametrize("word, value, match", [
    (0, -1, r"active slot -1"),
    (1, 7, r"dirty 7"),
    ("pos", -2, r"position -2"),
    ("count", M + 3, rf"rows {M + 3}"),
    ("total", 2, r"total 2\)? ?.*do not fit"),
    ("flushes", -1, r"flushes -1"),
])
def test_a_journal_whose_words_are_not_a_journals_is_refused(tmp_path, word, value, match):
    path = flushed(tmp_path / "b")
    words = journal_words(path)
    slot = 2 + 4 * int(words[0])
    index = word if isinstance(word, int) else slot + ("pos", "count", "total", "flushes").index(word)
    words[index] = value
    (path / "counters.bin").write_bytes(words.tobytes())
    refused(path, f"storage_dir: counters in .*counters.bin .*{match}")


def test_gpubuf_json_naming_another_journal_is_refused(tmp_path):
    path = flushed(tmp_path / "b")
    meta = json.loads((path / "gpubuf.json").read_text())
    meta["journal"] = {"file": "counters.bin", "int64 words": 16}
    (path / "gpubuf.json").write_text(json.dumps(meta))
    refused(path, "storage_dir: .*gpubuf.json describes the row journal as")


# ---------------------------------------------------------------------------------------------- state.pt


def test_a_state_file_cut_at_any_byte_is_refused_naming_it(tmp_path):
    path = flushed(tmp_path / "b")
    good = (path / "state.pt").read_bytes()
    n = len(good)
    for cut in sorted({0, 1, 2, 10, 64, 100, 512, n // 3, n // 2, 2 * n // 3, n - 200, n - 100, n - 22, n - 2,
                       n - 1}):
        (path / "state.pt").write_bytes(good[:cut])
        err = refused(path, "storage_dir: .*state.pt cannot be restored")
        assert not isinstance(err.__cause__, OSError)
    (path / "state.pt").write_bytes(good)
    assert len(make(path)) == 5 * E  # repaired: it opens


@pytest.mark.parametrize("content", [b"garbage" * 300, bytes(4096), b"PK\x03\x04" + bytes(200)])
def test_a_state_file_of_garbage_is_refused_naming_it(tmp_path, content):
    path = flushed(tmp_path / "b")
    (path / "state.pt").write_bytes(content)
    refused(path, "storage_dir: .*state.pt cannot be restored")


def test_a_state_file_that_is_a_directory_or_a_dangling_link_is_refused_naming_it(tmp_path):
    path = flushed(tmp_path / "b")
    (path / "state.pt").unlink()
    (path / "state.pt").mkdir()
    refused(path, "storage_dir: .*state.pt cannot be restored")
    (path / "state.pt").rmdir()
    os.symlink(tmp_path / "nowhere.pt", path / "state.pt")
    refused(path, "storage_dir: .*state.pt cannot be restored")


@pytest.mark.parametrize("change, match", [
    (lambda s: None, "expected the dict a flush saves, got NoneType"),
    (lambda s: [s], "expected the dict a flush saves, got list"),
    (lambda s: "state", "expected the dict a flush saves, got str"),
    (lambda s: {1: 2}, "KeyError"),
    (lambda s: {**s, "rng": 5}, "rng: expected a uint8 generator state, got int"),
    (lambda s: {**s, "rng": s["rng"].float()}, "rng: expected a uint8 generator state"),
    (lambda s: {**s, "rng": s["rng"][None]}, "rng: expected a uint8 generator state"),
    (lambda s: {**s, "rng": s["rng"][:10]}, "RuntimeError"),
    (lambda s: {**s, "total": "5"}, "total: expected an int"),
    (lambda s: {**s, "total": 5.0}, "total: expected an int"),
    (lambda s: {**s, "total": True}, "total: expected an int"),
    (lambda s: {**s, "flush": "1"}, "flush: expected an int"),
    (lambda s: {**s, "flush": None}, "flush: expected an int"),
    (lambda s: {**s, "priority": s["priority"].tolist()}, "priority: expected a torch.float32 tensor"),
    (lambda s: {**s, "priority": s["priority"].double()}, "priority: expected a torch.float32 tensor"),
    (lambda s: {**s, "priority": s["priority"][:-1]}, "priority: expected a torch.float32 tensor"),
    (lambda s: {**s, "priority": s["priority"].int()}, "priority: expected a torch.float32 tensor"),
    (lambda s: {**s, "max_priority": "3"}, "max_priority: expected a finite number"),
    (lambda s: {**s, "max_priority": torch.tensor(3.5)}, "max_priority: expected a finite number"),
    (lambda s: {**s, "beta": [0.4]}, "beta: expected a finite number"),
    (lambda s: {**s, "beta": None}, "beta: expected a finite number"),
])
def test_a_state_file_holding_wrong_types_is_refused_naming_it(tmp_path, change, match):
    path = flushed(tmp_path / "b")
    torch.save(change(torch.load(path / "state.pt", weights_only=True)), path / "state.pt")
    refused(path, f"storage_dir: .*state.pt cannot be restored .*{match}")


# ---------------------------------------------------------------------------------------------- a flush that fails


_LIMITED = textwrap.dedent("""
    import json, os, resource, signal, sys
    import numpy as np
    sys.path.insert(0, {tests!r})
    from test_storage_dir_damage import flushed, make, rows, snapshot
    from pathlib import Path
    path = Path({path!r})
    buf = make(path).insert(rows(5, 3, width=3))
    buf.update_priorities([0, 1], [2.0, 3.0]).flush()
    buf.insert(rows(2, 4, width=3)).update_priorities([2, 3], [6.0, 7.0])  # after the flush: not in state.pt
    before = snapshot(path)
    assert os.path.getsize(path / "state.pt") > 2000
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1000, hard))
    try:
        buf.flush()
        out = {{"flushed": True}}
    except OSError as err:
        out = {{"type": type(err).__name__, "errno": err.errno, "message": str(err)}}
    out["unchanged"] = snapshot(path) == before
    out["files"] = sorted(p.name for p in path.iterdir())
    batch, idx = buf.sample(batch_size=4)  # the buffer still works, under the limit too
    buf.insert(rows(1, 5, width=3))
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    buf.flush()  # the limit lifted: the next flush succeeds
    out["max_priority"] = buf.max_priority
    out["len"] = len(buf)
    out["mass"] = buf.sampling_mass().tolist()
    buf.close()
    print(json.dumps(out))
""")


def test_a_flush_past_the_file_size_limit_raises_naming_state_pt_and_changes_nothing(tmp_path):
    path = tmp_path / "b"
    code = _LIMITED.format(tests=os.path.dirname(__file__), path=str(path))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["type"] == "OSError" and out["errno"] == errno.EFBIG, out
    assert f"storage_dir: cannot write {path / 'state.pt'} (File too large)" in out["message"]
    assert "the flush changed nothing" in out["message"]
    assert out["unchanged"] and "state.pt.tmp" not in out["files"]  # the temporary file removed
    again = make(path)  # re-opens as the last (successful) flush left it
    assert len(again) == out["len"] == 8 * E and again.max_priority == out["max_priority"] == pytest.approx(7, 1e-5)
    assert again.sampling_mass().tolist() == out["mass"]


def test_a_flush_on_a_full_disk_raises_naming_state_pt_and_changes_nothing(tmp_path, monkeypatch):
    path = tmp_path / "b"
    buf = make(path).insert(rows(5, 3, width=3))
    buf.update_priorities([0, 1], [2.0, 3.0]).flush()
    buf.insert(rows(2, 4, width=3)).update_priorities([2], [6.0])
    before = snapshot(path)
    write = os.write

    def full(fd, data):  # the state file gets 100 bytes, then the disk is full
        if os.readlink(f"/proc/self/fd/{fd}").endswith("state.pt.tmp"):
            if os.fstat(fd).st_size >= 100:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return write(fd, bytes(memoryview(data)[:100]))
        return write(fd, data)

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError, match=f"storage_dir: cannot write {path / 'state.pt'} \\(No space left on "
                                      "device\\); the flush changed nothing") as failed:
        buf.flush()
    monkeypatch.undo()
    assert failed.value.errno == errno.ENOSPC
    assert snapshot(path) == before  # no state.pt.tmp, the previous state.pt, the journal as it was
    buf.flush()
    buf.close()
    again = make(path)
    assert len(again) == 7 * E and again.max_priority == pytest.approx(6, 1e-5)


# ---------------------------------------------------------------------------------------------- forked children


def fork(work):
    """Fork a child that runs ``work()`` and sends back its JSON result; returns ``(pid, pipe to read it from)``."""
    r, w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: the child only runs Python here
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code, result = 1, "null"
        try:
            os.close(r)
            torch.set_num_threads(1)
            result = json.dumps(work())
            code = 0
        except BaseException as err:  # noqa: B036 - reported to the parent
            result = json.dumps({"crashed": repr(err)})
        finally:
            with open(w, "w") as f:
                f.write(result)
            os._exit(code)
    os.close(w)
    return pid, r


def result_of(pid, r):
    """The JSON result of a :func:`fork` child, once it exited (successfully)."""
    with open(r) as f:
        result = json.loads(f.read())
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, result
    return result


def in_child(work):
    """Run ``work()`` in a forked child; returns ``(its JSON result, its pid)``."""
    pid, r = fork(work)
    return result_of(pid, r), pid


def attempt(call):
    try:
        call()
    except Exception as err:
        return [type(err).__name__, str(err)]
    return ["ok", ""]


def test_a_forked_child_may_read_but_not_write_the_directory(tmp_path):
    path = tmp_path / "b"
    buf = make(path)
    buf.insert(rows(5, 3, width=3)).insert(rows(2, 4, width=3))  # numpy rows twice: the steady path is learnt
    buf.update_priorities([0, 1], [2.0, 3.0]).flush()
    buf.insert(rows(1, 5, width=3))
    before, rows_before = snapshot(path), held_rows(buf).clone()
    mass = buf.sampling_mass().clone()
    other = PrioritizedTransitionBuffer(E * M, 8, rows(1, 0, width=3), device="cpu").insert(rows(M, 9, width=3))
    torch_rows = rows(3, 8, width=3)
    torch_rows = type(torch_rows)(**{k: torch.as_tensor(v) if isinstance(v, np.ndarray) else v
                                     for k, v in vars(torch_rows).items()})

    def child():
        out = {
            "insert": attempt(lambda: buf.insert(rows(3, 8, width=3))),  # the steady path
            "insert tensors": attempt(lambda: buf.insert(torch_rows)),  # the checked path
            "load_state_dict": attempt(lambda: buf.load_state_dict(other.state_dict())),
            "update_priorities": attempt(lambda: buf.update_priorities([2, 3], [9.0, 9.0])),
            "update_beta": attempt(lambda: buf.update_beta(0.9)),
            "flush": attempt(buf.flush),
        }
        batch, _ = buf.sample(batch_size=16, with_replacement=True)  # reading: allowed
        out["sampled"] = sorted(set(batch.reward.flatten().tolist()))
        out["closed"] = buf.storage.closed
        out["close"] = attempt(buf.close)  # nothing: the owner's lock and files untouched
        out["after close"] = attempt(lambda: buf.insert(rows(1, 8, width=3)))
        return out

    out, child_pid = in_child(child)
    refusal = (f"storage_dir: '{path}' is owned by pid {os.getpid()} (which opened it); this process (pid "
               f"{child_pid}) may not write it: open the directory in this process after the owner closes it")
    for op in ("insert", "insert tensors", "load_state_dict", "update_priorities", "update_beta", "flush",
               "after close"):
        assert out[op][0] == "RuntimeError" and out[op][1].startswith(refusal), (op, out[op])
    assert out["close"] == ["ok", ""] and out["closed"] is True
    assert set(out["sampled"]) <= {3.0, 4.0, 5.0}
    assert snapshot(path) == before  # nothing written: rows, journal, state, lock file
    assert torch.equal(held_rows(buf), rows_before) and torch.equal(buf.sampling_mass(), mass)
    assert buf.beta == 0.4 and not buf.storage.closed
    # the owner's lock outlived the child's close and exit
    with pytest.raises(ValueError, match=f"storage_dir: '{path}' is open for writing by pid {os.getpid()} on "):
        make(path)
    buf.insert(rows(1, 6, width=3)).flush()  # the owner still writes
    buf.close()
    assert len(make(path)) == 9 * E


def test_after_the_owner_closes_a_forked_child_may_open_the_directory_itself(tmp_path):
    path = tmp_path / "b"
    buf = make(path, TransitionBuffer).insert(rows(2, 3, width=3))
    go_r, go_w = os.pipe()

    def child():
        os.close(go_w)
        with open(go_r) as f:
            f.read()  # until the owner closed
        with make(path, TransitionBuffer) as mine:  # its copy of the lock's descriptor was closed at the fork
            mine.insert(rows(1, 7, width=3))
            return {"len": len(mine)}

    pid, r = fork(child)
    os.close(go_r)
    buf.close()
    os.close(go_w)  # the child goes on
    assert result_of(pid, r) == {"len": 3 * E}
    again = make(path, TransitionBuffer)
    assert held_rows(again).flatten().tolist() == [3.0] * E * 2 + [7.0] * E


def test_a_child_does_not_keep_the_directory_locked_after_the_owner_closes(tmp_path):
    path = tmp_path / "b"
    buf = make(path, TransitionBuffer).insert(rows(2, 3, width=3))
    go_r, go_w = os.pipe()

    def child():  # alive, holding nothing of the directory, until the parent is done
        os.close(go_w)
        with open(go_r) as f:
            f.read()
        return {}

    pid, r = fork(child)
    os.close(go_r)
    try:
        buf.close()
        third = make(path, TransitionBuffer)  # while the child lives
        assert len(third) == 2 * E
        third.close()
    finally:
        os.close(go_w)
        assert result_of(pid, r) == {}
