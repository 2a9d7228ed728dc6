"""Models: Qwen3-MoE in plain PyTorch (the `torch` backend) and its expert-parallel dispatcher
(`ep_dispatch.py`), its HuggingFace adapter, the megatron-core backend and its weight names, and
what every floor asks of a parameter (`params.py`)."""
from megatron_rl.models.config import MoEModelConfig
from megatron_rl.models.hf import load_hf_checkpoint, save_hf_checkpoint
from megatron_rl.models.qwen3_moe import Qwen3MoeModel

__all__ = ["MoEModelConfig", "Qwen3MoeModel", "load_hf_checkpoint", "save_hf_checkpoint"]
