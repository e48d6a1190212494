"""Triton kernels and their launchers (shipped as ``gpubuf.kernels``); the only place importing triton."""
