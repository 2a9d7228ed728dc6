"""Prompt datasets, the resumable prompt iterator, tokenizers and the synthetic arithmetic task."""
from megatron_rl.data.iterator import Batch, PromptIterator
from megatron_rl.data.prompts import (
    DataConfig,
    DatasetError,
    Prompt,
    PromptDataset,
    load_prompts,
)
from megatron_rl.data.tokenizer import CharTokenizer, TokenizerConfig, build_tokenizer

__all__ = [
    "Batch",
    "CharTokenizer",
    "DataConfig",
    "DatasetError",
    "Prompt",
    "PromptDataset",
    "PromptIterator",
    "TokenizerConfig",
    "build_tokenizer",
    "load_prompts",
]
