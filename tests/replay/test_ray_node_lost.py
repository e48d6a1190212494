"""A Ray actor's node is lost: a two-node Ray cluster on this machine (ray.cluster_utils), the writer actor on the
worker node, the node removed mid-run. The learner reports the writer dead once, holds whole inserts of the actor's
rows in order, and a new actor on the head node takes the lanes over."""

import time

import numpy as np
import pytest
import torch
from extras import needs

from gpubuf import PrioritizedTransitionBuffer, Transition

ray = needs("ray")
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
HANG_S = 300.0


def until(condition, what):
    end = time.monotonic() + HANG_S
    while not condition():
        assert time.monotonic() < end, what
        time.sleep(0.02)


def test_a_lost_node_reports_its_writer_once_and_keeps_what_it_published():
    from ray.cluster_utils import Cluster

    needs("gymnasium")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        node = cluster.add_node(num_cpus=1, resources={"far": 1})
        import ray_actors

        ray_actors.start_ray(address=cluster.address)
        cluster.wait_for_nodes()

        E, T = 2, 8
        z = np.zeros((1, E), np.int64)
        sample = Transition(observation=np.zeros((1, E, 4), np.float32), action=z, reward=np.zeros((1, E), np.float32),
                            terminated=np.zeros((1, E), bool), truncated=np.zeros((1, E), bool),
                            info={"step": z, "actor": z})
        buf = PrioritizedTransitionBuffer(E * 4000, 4, sample, seed=0)
        far = ray.remote(num_cpus=1, resources={"far": 1})(ray_actors.CartPoleActor)
        actor = far.remote(buf.writer(rows=32, transport="ray"), 0, E, 5)
        actor.run.remote(10_000, T, close=False)
        until(lambda: buf.collect() >= 0 and len(buf) >= 40 * E, "the far actor's rows did not come in")
        cluster.remove_node(node)
        died = [ray_actors.reported_dead(buf)]
        assert "died" in died[0] and 'transport="ray"' in died[0]
        assert buf.collect() == 0  # once
        held = buf.ring.count
        assert held % T == 0  # whole inserts
        log = ray_actors.cartpole_log(0, E, 5, held)
        data = buf.storage.data
        assert torch.equal(data[("info", "step")][:held, 0], torch.arange(held))
        assert np.array_equal(data[("observation",)][:held].numpy(), log.observation)
        assert np.array_equal(data[("action",)][:held].numpy(), log.action)
        # the lanes go to an actor on the head node; the lost one's last row ends their episodes
        near = ray.remote(num_cpus=1)(ray_actors.CartPoleActor)
        again = near.remote(buf.writer(envs=range(0, E), rows=32, transport="ray"), 1, E, 6)
        run = again.run.remote(10, T)
        until(lambda: buf.collect() >= 0 and bool(ray.wait([run], timeout=0)[0]), "the new actor did not finish")
        assert ray.get(run) == 80
        buf.collect()
        assert buf.ring.count == held + 80, (buf.ring.count, held, len(buf))
        assert data[("truncated",)][held - 1].all()
        assert (data[("info", "actor")][held:held + 80] == 1).all()
    finally:
        ray.shutdown()
        cluster.shutdown()
