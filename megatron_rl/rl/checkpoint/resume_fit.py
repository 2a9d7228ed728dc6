"""What a checkpoint must share with the config it resumes under, checked on the driver before any
rank starts (a mismatch is one line here, not a failure inside every rank): the model's dtype, the
data position (the prompt iterator's state), and the carried partial rollouts (rl/checkpoint/partial_state.py).
The model's shape is `read_trainer_state`'s check (rl/checkpoint/dcp.py).

A dtype change is refused, not cast: a bfloat16 run keeps fp32 masters that a float32 or float64
checkpoint does not have, and its moments would be rounded, so the resumed run would not be the
one that was saved. `flexfloor export` and `init:` start a new run from the weights in any dtype.
"""
from __future__ import annotations

from pathlib import Path

from megatron_rl.data.iterator import PromptIterator
from megatron_rl.errors import CheckpointError
from megatron_rl.rl.checkpoint.partial_state import check_partial_resume
from megatron_rl.rl.checkpoint.trust import read_metadata


def check_resume_fit(cfg, data, tok, path: Path, state: dict) -> None:
    check_resume_dtype(path, cfg.dtype)
    if "data" in state:  # (a stopped SFT warm start saves its own position, checked where it resumes)
        PromptIterator(len(data), cfg.prompts_per_step, cfg.seed).load_state_dict(
            state["data"], source=str(path / "trainer_state.json"))
    check_partial_resume(cfg, data, tok, path, state)


def saved_dtype(path: Path) -> str | None:
    """The dtype of the model weights in checkpoint `path`'s DCP metadata (None: no model tensors)."""
    for key, meta in read_metadata(path).state_dict_metadata.items():
        dtype = getattr(getattr(meta, "properties", None), "dtype", None)
        if key.startswith("model.") and dtype is not None:
            return str(dtype).removeprefix("torch.")
    return None


def check_resume_dtype(path: Path, dtype: str) -> None:
    saved = saved_dtype(path)
    if saved is not None and saved != dtype:
        raise CheckpointError(f"{path}: saved in {saved}, config dtype {dtype}; a run resumes in the dtype it "
                              f"was saved in (set dtype: {saved}), or start a new run from its weights "
                              f"(`flexfloor export`, then init: <the export> with dtype {dtype})")
