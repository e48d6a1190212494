"""Builds the buffers of ``buffers_d75cdaf.pkl`` and, run as a script, pickles them to the path given.

The file was written by gpubuf d75cdaf, the release before the subpackages:
``PYTHONPATH=<checkout of d75cdaf> python make_buffers_pickle.py buffers_d75cdaf.pkl``. The test runs this
module with today's gpubuf to build the same buffers again (module globals ``u``, ``p``, ``h``).
"""

import pickle
import sys

import numpy as np

from gpubuf import HistoryBuffer, PrioritizedTransitionBuffer, Transition, TransitionBuffer

E = 3


def rows(T: int, start: int) -> Transition:
    v = (np.arange(start, start + T)[:, None] * E + np.arange(E)).astype(np.float32)
    return Transition(observation=np.stack([v, -v], -1), action=v.astype(np.int64), reward=v,
                      terminated=np.zeros((T, E), bool), truncated=(v % 7 == 0), info={"id": v.astype(np.int64)})


u = TransitionBuffer(8 * E, 2, rows(1, 0), device="cpu", seed=3)
u.insert(rows(5, 0))
p = PrioritizedTransitionBuffer(8 * E, 2, rows(1, 0), device="cpu", seed=3)
p.insert(rows(5, 0))
_, idx = p.sample(batch_size=4)
p.update_priorities(idx, np.arange(1.0, 5.0))
h = HistoryBuffer(E, 6, action_block=2, device="cpu")
for t in range(4):
    h.append({"obs": np.full((E, 2), t, np.float32), "action": np.full((E, 1), -t, np.float32)})

if __name__ == "__main__":
    with open(sys.argv[1], "wb") as f:
        pickle.dump({"uniform": u, "prioritized": p, "history": h}, f)
