"""Launching, signals, the device, the parallel layout (`dims.py` builds `ParallelDims`) and the
expert-parallel token dispatcher (the CPU/gloo path)."""
