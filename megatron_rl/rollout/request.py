"""A request: one response of one prompt, as the engine generates it (rollout/engine.py) and its
scheduler admits it (rollout/scheduler.py).

A request ends at its `fixed_len` when set (trace replay: ignore EOS, stop at the traced length),
else at EOS or `max_new_tokens`.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Request:
    prompt_id: str
    sample: int
    prompt: list[int]
    max_new_tokens: int
    fixed_len: int | None = None
    tokens: list[int] = field(default_factory=list)
    slot: int = -1
    # The planner's predicted response length (paged KV admission); None: the cap (fixed_len or max_new_tokens).
    predicted_len: int | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.prompt_id, self.sample)

    def done(self, eos_id: int | None) -> bool:
        if self.fixed_len is not None:
            return len(self.tokens) >= self.fixed_len
        if eos_id is not None and self.tokens and self.tokens[-1] == eos_id:
            return True
        return len(self.tokens) >= self.max_new_tokens

    def predicted_positions(self) -> int:
        """KV positions it is expected to end with: prompt + predicted response, at least what it holds."""
        cap = self.fixed_len if self.fixed_len is not None else self.max_new_tokens
        want = cap if self.predicted_len is None else min(cap, self.predicted_len)
        return len(self.prompt) + max(len(self.tokens) + 1, want)
