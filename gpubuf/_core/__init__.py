"""Shared internals of every buffer: input checks and casts, host-to-device staging, state-dict checks,
checkpoint files, held signals, the per-buffer lock, copies through state_dict, host-memory advice and the
``Transition`` type. Imports nothing else of gpubuf but :mod:`gpubuf.ops` device helpers."""
