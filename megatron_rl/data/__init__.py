"""Prompt datasets, the resumable prompt iterator, tokenizers and the synthetic arithmetic task."""
from megatron_rl.data.iterator import Batch, PromptIterator
from megatron_rl.data.prompts import DataConfig, DatasetError, Prompt, PromptDataset, load_prompts
from megatron_rl.data.tokenizer import CharTokenizer, TokenizerConfig, build_tokenizer

__all__ = [
    "Batch", "PromptIterator", "DataConfig", "DatasetError", "Prompt", "PromptDataset",
    "load_prompts", "CharTokenizer", "TokenizerConfig", "build_tokenizer",
]
