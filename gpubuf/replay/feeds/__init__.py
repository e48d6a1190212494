"""Feeds: how rows reach a replay buffer and leave it, besides ``insert`` and ``sample``: writers in other processes
(``process_writers``, ``writer_hub``, ``writer_doors``), the rate limiter (``rate_limiter``), write-backs of sampled
rows (``write_backs``) and episodes exported as datasets (``export``)."""
