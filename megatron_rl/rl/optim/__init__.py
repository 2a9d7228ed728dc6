"""Optimizers a run trains with: fp32 masters for a bf16 model (`mixed_precision.py`), ZeRO-1 for the
torch backend (`zero.py`) with DeepSpeed's CPU Adam offload (`cpu_adam.py`), and megatron-core's DDP
and DistributedOptimizer for `backend: megatron` (`megatron_train.py`)."""
