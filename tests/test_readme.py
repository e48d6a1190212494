"""The README's Python quick starts run as written (a newcomer must succeed from the README alone)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_quick_starts():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_block_runs(code, monkeypatch, tmp_path):
    for package in ("envpool", "gymnasium"):  # absent on the GPU machine
        if f"import {package}" in code:
            pytest.importorskip(package)
    monkeypatch.delenv("GPUBUF_BACKEND", raising=False)
    monkeypatch.chdir(tmp_path)  # checkpoints the blocks write land here
    if "init_process_group" in code:  # the multi-GPU learner: run as the README says, under torchrun
        (tmp_path / "learner.py").write_text(code)
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "learner.py"],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        return
    exec(compile(code, str(README), "exec"), {"__name__": "readme"})
