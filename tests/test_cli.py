"""The ``gpubuf`` console script, run as a user runs it (a subprocess on the installed entry point)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpubuf.cli import main

pytest.importorskip("envpool")  # the demo steps EnvPool envs (absent on the GPU machine)

GPUBUF = str(Path(sys.executable).parent / "gpubuf")


def run(*args, timeout=120):
    return subprocess.run([GPUBUF, *args], capture_output=True, text=True, timeout=timeout)


def test_demo_runs_end_to_end_in_seconds(tmp_path):
    out = tmp_path / "demo.json"
    proc = run("demo", "--steps", "200", "--num-envs", "8", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    numbers = json.loads(out.read_text())
    assert numbers["env_steps"] == 200 * 8 and numbers["device"] in ("cpu", "cuda")
    for op in ("env", "append", "get", "sample", "update"):
        assert numbers["median_us"][op] > 0, op
    for row in ("env steps/s", "history append median us", "history get median us", "PER sample median us",
                "PER update median us", "device", "sizes"):
        assert row in proc.stdout
    assert "200/200 steps" in proc.stderr  # the progress bar


def test_demo_async_pixels(tmp_path):
    out = tmp_path / "demo.json"
    proc = run("demo", "--env", "Pong-v5", "--steps", "30", "--num-envs", "4", "--async", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    numbers = json.loads(out.read_text())
    assert numbers["async"] and numbers["env_steps"] == 30 * 2 and numbers["sizes"]["obs_shape"] == [4, 84, 84]


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
