"""``gpubuf bench``: the files it writes and its option checks (tiny sizes; no timing asserts)."""

import importlib.util
import json

import pytest

from gpubuf.apps.benchmarking.peers import PEERS
from gpubuf.apps.cli import main

TINY = ["bench", "--quick", "--n-envs", "2", "--log2-sizes", "8", "--batch", "16", "--repeats", "1", "--device",
        "cpu"]


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """One tiny run with every peer asked for (those not installed get listed); returns its files."""
    out = tmp_path_factory.mktemp("bench") / "b.md"
    assert main([*TINY, "--out", str(out)]) == 0
    return out.read_text(), out.with_suffix(".png").read_bytes(), json.loads(out.with_suffix(".json").read_text())


def test_markdown_has_a_gpubuf_row_per_op_and_the_machine(bench_run):
    md, _, result = bench_run
    ops = {("2 envs", "get(3)"), ("2 envs", "append"), ("PER N=2**8", "insert 16"), ("PER N=2**8", "sample 16"),
           ("PER N=2**8", "update 16"), ("seq 8 envs x 64 steps", "sample 32x16 frames")}
    for case, op in ops:
        assert f"| {case} | {op} | gpubuf | " in md, (case, op)
    assert {(r["case"], r["op"]) for r in result["rows"]} == ops
    assert "| case | op | impl | median us | gpubuf speedup |" in md and "![median time per op](b.png)" in md
    for field in ("- machine: ", " CPUs", "- device: cpu", "torch 2.", "- method: "):
        assert field in md, field


def test_json_rows_and_png(bench_run):
    _, png, result = bench_run
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    assert result["machine"]["device"] == "cpu" and result["settings"]["history_repeats"] == 1
    assert all(r["us"] > 0 and r["bytes"] > 0 for r in result["rows"])
    impls = {r["impl"] for r in result["rows"]}
    assert {"gpubuf", "gpubuf (out=)", "gpubuf (no replacement)", "copy floor", "deque"} <= impls


def test_missing_peers_are_listed_not_fatal(bench_run):
    md, _, result = bench_run
    absent = {name for name, (modules, _) in PEERS.items()
              if any(importlib.util.find_spec(m) is None for m in modules)}
    assert set(result["missing"]) == absent
    for name in absent:
        assert f"{name} ({PEERS[name][1]})" in md
    if absent:
        assert "- not installed: " in md


def test_peers_can_be_left_out_and_a_suite_chosen(tmp_path, capsys):
    out = tmp_path / "h.md"
    assert main([*TINY, "--suite", "history", "--peers", "", "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert {r["impl"] for r in result["rows"]} == {"gpubuf", "gpubuf (out=)", "copy floor",
                                                   "copy floor, one destination"}
    assert result["missing"] == {} and "not installed" not in out.read_text()
    assert str(out) in capsys.readouterr().out


@pytest.mark.parametrize(("args", "message"), [
    (["--suite", "history,foo"], "--suite: expected a comma-separated subset of history,replay, got 'history,foo'"),
    (["--repeats", "0"], "--repeats: expected a positive int, got 0"),
    (["--repeats", "x"], "argument --repeats: invalid int value: 'x'"),
    (["--batch", "0"], "--batch: expected a positive int, got 0"),
    (["--threads", "0"], "--threads: expected a positive int, got 0"),
    (["--n-envs", "4,x"], "--n-envs: expected comma-separated ints, got '4,x'"),
    (["--n-envs", "0"], "--n-envs: expected ints of at least 1, got '0'"),
    (["--log2-sizes", "4"], "--log2-sizes: every capacity must hold a batch of 256, got (4,)"),
    (["--log2-sizes", "27"], "--log2-sizes: expected at most 26, got 27"),
    (["--log2-sizes", ""], "--log2-sizes: expected comma-separated ints, got ''"),
    (["--n-envs", ""], "--n-envs: expected comma-separated ints, got ''"),
    (["--n-envs", "100000000"], "--n-envs: expected at most 8192, got 100000000"),
    (["--device", "meta"], "--device: expected a cpu or cuda device, got 'meta'"),
    (["--peers", "cpprb,nope"], "--peers: expected a comma-separated subset of deque,cpprb,rlox,torchrl,flashbax,"),
    (["--device", "tpu9"], "--device: cannot use 'tpu9'"),
    (["--out", "/no/such/dir/b.md"], "--out: cannot write '/no/such/dir/b.md'"),
    (["--out", "b.json"], "--out: expected a markdown path ending in .md, got 'b.json'"),
])
def test_bad_options_are_one_line_with_exit_code_2_before_any_work(args, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *args])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"gpubuf bench: error: {message}"), lines
    assert list(tmp_path.iterdir()) == []  # nothing ran, nothing written


def test_without_matplotlib_the_table_and_numbers_are_still_written(tmp_path, monkeypatch, capsys):
    """A source tree on a bare machine (the GPU box): no chart, said so, the rest written."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    out = tmp_path / "b.md"
    assert main([*TINY, "--suite", "history", "--out", str(out)]) == 0
    assert json.loads(out.with_suffix(".json").read_text())["rows"] and not out.with_suffix(".png").exists()
    assert "![" not in out.read_text() and "no chart (matplotlib is not installed" in capsys.readouterr().out


def test_a_directory_in_the_way_of_the_json_or_png_is_named_before_any_work(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for suffix in (".json", ".png"):
        (tmp_path / f"b{suffix}").mkdir()
        with pytest.raises(SystemExit) as exit_info:
            main(["bench", "--out", "b.md"])
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.strip() == (f"gpubuf bench: error: --out: cannot write 'b{suffix}' (a directory "
                                                   "of that name is in the way)")
        (tmp_path / f"b{suffix}").rmdir()
    assert list(tmp_path.iterdir()) == []
