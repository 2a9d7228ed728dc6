"""verl-format rows: a `prompt` that is a list of chat messages, and answers in nested fields.

verl's preprocessors (`examples/data_preprocess/gsm8k.py` and its siblings) write parquet rows

    {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "..."}],
     "ability": "math", "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0, ...}}

so the answer lives at the dotted path `reward_model.ground_truth`. An HF tokenizer renders the
messages with its chat template (`Tokenizer.encode_prompt`); a tokenizer without one (the
character tokenizer) sees the last user message's content, filled into `data.template`.
"""
from __future__ import annotations

from typing import Any

VERL_ANSWER = "reward_model.ground_truth"


def field_at(row: dict, path: str) -> Any:
    """`row["a"]["b"]` for `path` "a.b"; None when any step is missing. A key that itself holds a
    dot (`{"a.b": ...}`) is found first, so flat files with dotted column names still work."""
    if path in row:
        return row[path]
    value: Any = row
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def is_chat(value: Any) -> bool:
    """A verl `prompt`: a non-empty list of messages (datasets may hand back a tuple or array)."""
    return not isinstance(value, (str, bytes, dict)) and hasattr(value, "__len__") and len(value) > 0 \
        and all(isinstance(m, dict) for m in value)


def chat_messages(value: Any, where: str, field: str) -> tuple[dict[str, str], ...]:
    """The messages of a chat `prompt`, checked: each a {role, content} of strings, one a user turn.
    Raises ValueError with what is wrong (the caller names file and row)."""
    messages = []
    for i, m in enumerate(value):
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise ValueError(f"{where}: {field}[{i}]: expected {{role, content}} strings, got {m!r:.80}")
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "user" for m in messages):
        raise ValueError(f"{where}: {field} has no user message (roles: "
                         f"{', '.join(m['role'] for m in messages)})")
    return tuple(messages)


def last_user_content(messages: tuple[dict[str, str], ...]) -> str:
    return next(m["content"] for m in reversed(messages) if m["role"] == "user")
