"""Sources: what steps vector envs and writes their rows into the buffers (:mod:`gpubuf.sources.envpool`),
and gymnasium wrappers whose stacks live in a HistoryBuffer (:mod:`gpubuf.sources.wrappers`). Each module
loads when used."""
