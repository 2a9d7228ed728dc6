"""Launching (and what a failed rank reports: `rank_failures.py`, `disk_full.py`), torchrun's
environment (`torchrun.py`, read without torch), signals, the device, the parallel layout (`dims.py`
builds `ParallelDims`) and the expert-parallel token dispatcher (the CPU/gloo path)."""
