"""The torchrl DQN example (``examples/torchrl_dqn.py``: torchrl's env wrapper, collector, loss and replay buffer with
gpubuf's prioritized sampler) learns CartPole-v1, run as a user runs it: a fresh process, its printed result.

Done when its best mean return of 10 episodes within 20k frames is at least 100 (a random policy scores about 22).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from extras import needs

needs("torchrl.data")
needs("gymnasium")

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torchrl_dqn.py"


def test_torchrl_dqn_with_gpubufs_sampler_learns_cartpole():
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--frames", "20000", "--seed", "0"], capture_output=True,
                          text=True, timeout=900, env={**os.environ, "RL_WARNINGS": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("best mean return of 10 episodes: "), proc.stdout[-2000:]
    assert float(last.rsplit(" ", 1)[1]) >= 100, proc.stdout[-2000:]
