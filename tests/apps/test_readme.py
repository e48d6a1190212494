"""The Python blocks of the README and of every page in docs/ run as written (a newcomer must succeed from
the documentation alone)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from extras import EXTRA, needs

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(page: Path) -> list[str]:
    """The ```python blocks of a Markdown page, in order."""
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


BLOCKS = python_blocks(README)
# (page, code) of every Python block in the README and docs/, with ids such as README-block0, distributed-block0
DOC_BLOCKS = [(page, code) for page in PAGES for code in python_blocks(page)]
DOC_IDS = [f"{page.stem}-block{i}" for page in PAGES for i in range(len(python_blocks(page)))]
RANKS = 2  # torchrun processes for the multi-GPU example


def torchrun_skip_reason(cuda_devices: int | None = None, gloo: bool | None = None) -> str | None:
    """Why the multi-GPU example cannot run here (None: it can). One rank per GPU over NCCL needs RANKS GPUs;
    without CUDA it runs over gloo with CPU shards; one GPU can do neither as written."""
    import torch
    import torch.distributed as dist

    n = (torch.cuda.device_count() if torch.cuda.is_available() else 0) if cuda_devices is None else cuda_devices
    if not dist.is_available():
        return "torch.distributed is not available in this torch build"
    if n == 0:
        ok = dist.is_gloo_available() if gloo is None else gloo
        return None if ok else "no GPU, and this torch has no gloo backend for CPU shards"
    if n < RANKS:
        return (f"the example runs one rank per GPU over NCCL: {RANKS} ranks need {RANKS} GPUs, this machine has "
                f"{n} (without a GPU it runs over gloo with CPU shards)")
    return None if dist.is_nccl_available() else "this torch has no NCCL backend for the GPUs"


def test_torchrun_runs_where_it_can():
    assert torchrun_skip_reason(0, True) is None  # gloo with CPU shards
    assert torchrun_skip_reason(0, False) == "no GPU, and this torch has no gloo backend for CPU shards"
    assert "this machine has 1" in torchrun_skip_reason(1)


def test_readme_has_quick_starts():
    assert len(BLOCKS) >= 3

# optional packages a block uses through gpubuf's names
USED_THROUGH = {"torchrl": "gpubuf.torchrl", "envpool": "EnvPoolSource", "gymnasium": "VectorEnvSource",
                "minari": "to_minari", "h5py": "to_hdf5"}


def test_the_docs_have_their_blocks_and_one_runs_under_torchrun():
    pages = {page.stem for page, _ in DOC_BLOCKS}
    assert {"README", "replay", "history-buffer", "distributed"} <= pages
    assert sum("init_process_group" in code for _, code in DOC_BLOCKS) >= 1


@pytest.mark.parametrize(("page", "code"), DOC_BLOCKS, ids=DOC_IDS)
def test_doc_block_runs(page, code, monkeypatch, tmp_path):
    for package in EXTRA:  # optional packages (envpool and gymnasium are absent on the GPU machine)
        if re.search(rf"\b(import|from) {package}\b", code) or USED_THROUGH.get(package, "\0") in code:
            needs(package if package != "torchrl" else "torchrl.data")
    monkeypatch.delenv("GPUBUF_BACKEND", raising=False)
    monkeypatch.chdir(tmp_path)  # checkpoints the blocks write land here
    if "init_process_group" in code:  # the multi-GPU learner: run as its page says, under torchrun
        skip = torchrun_skip_reason()
        if skip:
            pytest.skip(skip)
        (tmp_path / "learner.py").write_text(code)
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS),
                              "learner.py"], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        return
    if 'if __name__ == "__main__":' in code:  # a script whose spawned processes import it: run as one
        (tmp_path / "script.py").write_text(code)
        run = subprocess.run([sys.executable, "script.py"], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        return
    exec(compile(code, str(page), "exec"), {"__name__": "readme"})
