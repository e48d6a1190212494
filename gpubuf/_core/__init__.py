"""Shared internals of every buffer: input checks and casts, host-to-device staging, state-dict checks,
checkpoint files, held signals, the per-buffer lock, copies through state_dict, host-memory advice and the
``Transition`` type, and device names. The lowest layer: imports nothing else of gpubuf."""
