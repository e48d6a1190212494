"""Replay: uniform and prioritized transition buffers, their configuration, ring bookkeeping,
samplers, prefix-sum tree, storages (device, host, ``storage_dir`` files), frame stacks and n-step returns,
the CUDA-graph sampler and the sharded buffer (:mod:`gpubuf.replay.sharded`, loaded when used)."""

from gpubuf.replay.buffer import BOUNDARIES, TransitionBuffer
from gpubuf.replay.feeds.rate_limiter import RateLimiter
from gpubuf.replay.prioritized import PrioritizedTransitionBuffer
from gpubuf.replay.sampling.graph_sampler import GraphSampler

__all__ = ["BOUNDARIES", "GraphSampler", "PrioritizedTransitionBuffer", "RateLimiter", "TransitionBuffer"]
