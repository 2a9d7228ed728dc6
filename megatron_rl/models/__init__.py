"""Models: Qwen3-MoE in plain PyTorch (the `torch` backend) and its HuggingFace adapter."""
from megatron_rl.models.config import MoEModelConfig
from megatron_rl.models.hf import load_hf_checkpoint, save_hf_checkpoint
from megatron_rl.models.qwen3_moe import Qwen3MoeModel

__all__ = ["MoEModelConfig", "Qwen3MoeModel", "load_hf_checkpoint", "save_hf_checkpoint"]
