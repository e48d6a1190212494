"""Sampling: which starts a batch begins at and how its rows are read.

The sampling policies (``samplers``: validity, prefix-sum trees, priorities, draws; ``tree``; ``device_priorities``,
the sync-free priority updates), the selectors (``selectors``: recency, mixtures, queues), the draw rules they all
share (``draws``: the proportional draw over a mass vector, the zero-draw-restore of tree leaves), the reads of drawn
starts (``readers``, ``stacked``: windows, frame stacks, n-step returns; ``episode_marks``), the one ``sample``
signature (``sample_args``) and the CUDA-graph sampler (``graph_sampler``).
"""
