"""The rollout engine as `elastic/` drives it (its `ShrinkableEngine` protocol): the torch backend's
plain and migrating engines (`torch_engine.py`), megatron-core's (`megatron_engine.py`) and injected
faults for tests (`faults.py`)."""
