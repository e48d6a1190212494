"""gpubuf's storage and prioritized sampler inside torchrl's Ray-backed replay buffer, with two writer actors.

torchrl's ``TensorDictReplayBuffer(..., service_backend="ray")`` returns a ``RayReplayBuffer``: the buffer lives in
one Ray actor, built there from the storage and sampler factories it is given (here gpubuf's ``ReplayStorage`` and
``PrioritizedSampler``: the two arguments are the one change from torchrl's ``LazyTensorStorage`` and sampler).
``rb.client()`` is a picklable handle: two writer actors ``extend`` through theirs while the learner (this process)
samples and writes back priorities. (``torchrl.services.get_services().register("replay", rb)`` would let the
writers look the buffer up by name instead.)

Run: ``python examples/torchrl_ray_service.py [--steps 200] [--seed 0]``; it prints the rows written, the rows held
and the mean importance weight of the last batches, and ends with ``ok`` once every sampled row is a written row.
"""

import argparse
import time
from functools import partial

import ray
import torch
from tensordict import TensorDict
from torchrl.data import TensorDictReplayBuffer

from gpubuf.torchrl import PrioritizedSampler, ReplayStorage

CAPACITY = 4096


@ray.remote(num_cpus=0)
class Writer:
    """Stands in for an environment worker: writes ``steps`` batches of 32 rows, ``value`` = its global index."""

    def __init__(self, replay, first: int):
        self.replay, self.first = replay, first

    def run(self, steps: int) -> int:
        for i in range(steps):
            r = torch.arange(self.first + 32 * i, self.first + 32 * (i + 1))
            self.replay.extend(TensorDict({"value": r, "obs": torch.stack([r, -r], 1).float()}, batch_size=[32]))
        return 32 * steps


def main(steps: int = 200, seed: int = 0) -> None:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    torch.manual_seed(seed)
    start = time.perf_counter()
    rb = TensorDictReplayBuffer(
        storage=partial(ReplayStorage, CAPACITY),  # torchrl: partial(LazyTensorStorage, CAPACITY)
        sampler=partial(PrioritizedSampler, CAPACITY, alpha=0.6, beta=0.4),  # torchrl: its PrioritizedSampler
        batch_size=64,
        priority_key="td_error",
        service_backend="ray",
        service_backend_options={"remote_config": {"num_cpus": 0}},
    )
    try:
        writers = [Writer.remote(rb.client(), first) for first in (0, 1_000_000)]
        jobs = [w.run.remote(steps) for w in writers]
        while len(rb) < 64:
            time.sleep(0.05)
        batches, weights = 0, []
        while True:
            done = len(ray.wait(jobs, num_returns=len(jobs), timeout=0)[0]) == len(jobs)
            batch = rb.sample()
            v = batch["value"]
            assert torch.equal(batch["obs"], torch.stack([v, -v], 1).float()), "a sampled row is not a written row"
            batch["td_error"] = torch.rand(batch.shape[0]) + 0.01  # a learner's TD errors
            rb.update_tensordict_priority(batch)
            weights.append(float(batch["priority_weight"].mean()))
            batches += 1
            if done:
                break
        written = sum(ray.get(jobs))
        print(f"rows written by 2 writers: {written}, held: {len(rb)} (capacity {CAPACITY}), "
              f"batches sampled while writing: {batches}, mean weight of the last 10: "
              f"{sum(weights[-10:]) / len(weights[-10:]):.3f} ({time.perf_counter() - start:.1f}s)")
        assert rb.write_count == written and len(rb) == min(written, CAPACITY)
        print("ok")
    finally:
        rb.close()
        ray.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    main(args.steps, args.seed)
