"""Replay writes whose bookkeeping stays on the device: :class:`~gpubuf.replay.capturable.writer.GraphWriter` and the
device copy of the ring it advances (:class:`~gpubuf.replay.capturable.device_ring.DeviceRing`)."""
