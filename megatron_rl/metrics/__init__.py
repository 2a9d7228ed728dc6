"""What a run reports: per-step metrics to JSONL and W&B (`logger.py`) under verl's names (`keys.py`,
`verl.py`), the W&B run (`metrics/wandb_run.py`) and the code and software a run ran on (`metrics/provenance.py`)."""
