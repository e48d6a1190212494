"""Sources: what steps vector envs and writes their rows into the buffers, each module loaded when used.

:mod:`gpubuf.sources.envpool` drives EnvPool envs, :mod:`gpubuf.sources.vector_env` gymnasium vector envs and
:mod:`gpubuf.sources.tensors` takes a batched simulator's per-step tensors, all through :mod:`gpubuf.sources.source`
(what every source shares) and the parts behind it: :mod:`gpubuf.sources.rows` (the row convention),
:mod:`gpubuf.sources.staging` (env outputs -> device tensors), :mod:`gpubuf.sources.actions` (the action codec),
:mod:`gpubuf.sources.extra` (the caller's per-step data) and :mod:`gpubuf.sources.layout` (the leaves of the rows).
:mod:`gpubuf.sources.wrappers`: gymnasium wrappers whose stacks live in a HistoryBuffer."""
