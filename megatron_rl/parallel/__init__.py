"""Launching (and what a failed rank reports: `rank_failures.py`, `disk_full.py`), torchrun's
environment (`torchrun.py`, read without torch), signals, the device and the parallel layout
(`dims.py` builds `ParallelDims`). Nothing here knows the model: the expert-parallel token
dispatcher is `models/ep_dispatch.py`."""
