"""Replay: uniform and prioritized transition buffers, their configuration, ring bookkeeping,
samplers, prefix-sum tree, storages (device, host, ``storage_dir`` files), frame stacks and n-step returns,
the CUDA-graph sampler and the sharded buffer (:mod:`gpubuf.replay.sharded`, loaded when used)."""

from gpubuf.replay.buffer import BOUNDARIES, TransitionBuffer
from gpubuf.replay.graph_sampler import GraphSampler
from gpubuf.replay.prioritized import PrioritizedTransitionBuffer
from gpubuf.replay.rate_limiter import RateLimiter

__all__ = ["BOUNDARIES", "GraphSampler", "PrioritizedTransitionBuffer", "RateLimiter", "TransitionBuffer"]
