"""megatron_rl: the RL post-training framework (model, rollout engine, trainer) of FlexFloor."""

__version__ = "0.1.0"
