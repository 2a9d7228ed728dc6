"""The rollout phase of a training step: the plan, the elastic rollout over the training model
(`phase.py`), its recording engine (log-probs and routes), partial rollouts' carried groups
(`partial.py`) and what detached ranks do under leases (`leases.py`)."""
