"""The ``gpubuf`` console script, run as a user runs it (a subprocess on the installed entry point): a learning run and
an async pixel run write their JSON and plot (no progress frames into a log), ``--version`` is the package's, and bad
options are one line with exit code 2, before any work."""

import json
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from extras import needs

from gpubuf.apps.cli import main

needs("envpool")  # the demo steps EnvPool envs (absent on the GPU machine)

GPUBUF = str(Path(sys.executable).parent / "gpubuf")


def run(*args, timeout=120):
    return subprocess.run([GPUBUF, *args], capture_output=True, text=True, timeout=timeout)


def test_demo_learning_run_writes_json_and_png_and_no_progress_frames_to_a_log(tmp_path):
    """A short learning run (no timing asserts). Its stderr is a pipe, not a terminal: no progress bar frames."""
    out, plot = tmp_path / "demo.json", tmp_path / "curve.png"
    proc = run("demo", "--env-steps", "320", "--num-envs", "4", "--out", str(out), "--plot", str(plot))
    assert proc.returncode == 0, proc.stderr
    numbers = json.loads(out.read_text())
    assert numbers["env_steps"] == 320 and numbers["device"] in ("cpu", "cuda") and numbers["env"] == "CartPole-v1"
    assert numbers["mode"] == "learned model + CEM planning" and numbers["reward_threshold"] == 475
    assert all(0 < s <= 320 and r > 0 for s, r in numbers["episodes"])  # [env steps at its end, return]
    for op in ("env", "source step", "append", "get", "insert", "sample", "update", "train", "plan"):
        assert numbers["median_us"][op] > 0, op
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for row in ("env steps/s", "return, last 10 episodes", "history append median us", "replay sample median us",
                "priority update median us", "Planner.act median us", "learning curve:", "device", "sizes"):
        assert row in proc.stdout
    assert "\r" not in proc.stderr + proc.stdout and "it/s" not in proc.stderr
    assert str(plot) in proc.stdout


def test_demo_async_pixels(tmp_path):
    """Pixel tasks run the timing variant; --steps counts env batches (half the envs each, async)."""
    out = tmp_path / "demo.json"
    proc = run("demo", "--env", "Pong-v5", "--steps", "30", "--num-envs", "4", "--async", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    numbers = json.loads(out.read_text())
    assert numbers["async"] and numbers["env_steps"] == 30 * 2 and numbers["sizes"]["obs_shape"] == [4, 84, 84]
    assert numbers["mode"].startswith("random plans") and (tmp_path / "demo.png").exists()


def test_version_comes_from_the_package_metadata():
    proc = run("--version")
    assert proc.returncode == 0 and proc.stdout == f"gpubuf {version('gpubuf')}\n"


def test_bad_env_name_is_one_line_with_exit_code_2():
    proc = run("demo", "--env", "NoSuchGame-v9")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "gpubuf demo: error: --env: unknown EnvPool task 'NoSuchGame-v9' (envpool.list_all_envs() lists them)"]


@pytest.mark.parametrize(("args", "message"), [
    (["demo", "--bogus"], "gpubuf: error: unrecognized arguments: --bogus"),
    (["demo", "--num-envs", "many"], "gpubuf demo: error: argument --num-envs: invalid int value: 'many'"),
    (["demo", "--num-envs", "0"], "gpubuf demo: error: --num-envs: expected at least 1, got 0"),
    (["demo", "--async", "--num-envs", "1"], "gpubuf demo: error: --num-envs: expected at least 2, got 1"),
    (["demo", "--steps", "-3"], "gpubuf demo: error: --steps: expected a positive int, got -3"),
    (["demo", "--env-steps", "0"], "gpubuf demo: error: --env-steps: expected a positive int, got 0"),
    (["demo", "--threads", "0"], "gpubuf demo: error: --threads: expected a positive int, got 0"),
    (["demo", "--steps", "3", "--env-steps", "9"], "gpubuf demo: error: argument --env-steps: not allowed with "
                                                   "argument --steps"),
    (["demo", "--async"], "gpubuf demo: error: --async: the learning run on CartPole-v1 needs sync envs"),
    (["demo", "--plot", "/no/such/dir/x.png"], "gpubuf demo: error: --plot: cannot write '/no/such/dir/x.png'"),
    (["demo", "--device", "tpu9"], "gpubuf demo: error: --device: cannot use 'tpu9'"),
    (["demo", "--out", "/no/such/dir/x.json"], "gpubuf demo: error: --out: cannot write '/no/such/dir/x.json'"),
    ([], "gpubuf: error: the following arguments are required: command"),
])
def test_bad_options_are_one_line_with_exit_code_2(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), lines


@pytest.mark.parametrize(("args", "message"), [
    (["--out", "numbers.png"], "--out: expected a JSON path (the plot goes to --plot), got the image path "),
    (["--out", "numbers.JPEG"], "--out: expected a JSON path (the plot goes to --plot), got the image path "),
    (["--out", "n.svg", "--plot", "p.png"], "--out: expected a JSON path"),
    (["--out", "n.pdf"], "--out: expected a JSON path"),
    (["--out", "n.jpg"], "--out: expected a JSON path"),
    (["--out", "same.json", "--plot", "same.json"], "--out, --plot: expected two different files (the plot would "
                                                   "overwrite the numbers), got "),
    (["--out", "n.json", "--plot", "./sub/../n.json"], "--out, --plot: expected two different files"),
    (["--plot", "gpubuf_demo.json"], "--out, --plot: expected two different files"),  # the default --out
    (["--out", "numbers.png.json", "--plot", "numbers.png.json"], "--out, --plot: expected two different files"),
])
def test_out_and_plot_that_would_overwrite_each_other_are_refused_before_any_work(args, message, tmp_path, capsys,
                                                                                  monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("gpubuf.apps.cli.run_demo", lambda *a: pytest.fail("the demo ran"))
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--env-steps", "16", *args])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"gpubuf demo: error: {message}"), lines
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_out_and_plot_linked_to_one_file_are_refused(tmp_path, capsys):
    (tmp_path / "a.json").write_text("{}")
    (tmp_path / "b.png").symlink_to(tmp_path / "a.json")
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--out", str(tmp_path / "a.json"), "--plot", str(tmp_path / "b.png")])
    assert exit_info.value.code == 2 and "--out, --plot: expected two different files" in capsys.readouterr().err
    assert (tmp_path / "a.json").read_text() == "{}"
