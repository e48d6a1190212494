"""Sampling: which starts a batch begins at and how its rows are read.

The sampling policies (``samplers``: validity, prefix-sum trees, priorities, draws; ``tree``; ``device_priorities``, the
sync-free priority updates), the selectors (``selectors``: recency, mixtures, queues), the draw rules they all share
(``draws``: the proportional draw over a mass vector, the zero-draw-restore of tree leaves), the sample plan and its
stages (``plan``: one per sample configuration, driven by the eager sample ``eager``, the CUDA-graph sampler
``graph_sampler`` and the shards; ``readers``: the plans' cache and the memory check; ``stacked``: frame stacks and
n-step returns; ``episode_marks``) and the one ``sample`` signature (``sample_args``).
"""
