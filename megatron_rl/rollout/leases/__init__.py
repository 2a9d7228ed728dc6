"""Side work a detached rank runs under a lease: the jobs and their pool (`jobs.py`), a sidecar model's
queries (`sidecar.py`) and an SGLang engine (`sglang.py`)."""
