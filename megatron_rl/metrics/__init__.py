"""What a run reports: per-step metrics to JSONL and W&B (`logger.py`) under verl's names (`keys.py`,
`verl.py`) and the W&B run (`wandb_run.py`). The code and software a run ran on, which the config,
the checkpoints and the W&B run record, is `megatron_rl/provenance.py`, below the config."""
