"""What one request holds of a rank's KV budget, under the KV cache the run uses: the one home of
that rule for the planner (`kv.Demand`), the online rule's moves (`replan_place`), and the
simulator's admission and migrations (`elastic/sim/admission.py`, `placement.py`).

Every budget is in KV positions (`MemoryBudget.kv_budget_bytes // kv_bytes_per_token`); the kind
says how many positions a request of `prompt + tokens` holds:
- `tokens`: exactly its positions (the planner's and the simulator's default model);
- `slots` (megatron_rl/rollout/kv_cache.py): a whole slot of the longest sequence, `slot_len`
  positions, whatever its length;
- `paged` (megatron_rl/rollout/paged_kv.py): whole pages of `page_size` positions. The samples of
  one GRPO group that a rank prefills together hold their prompt's full pages once (`shared`); a
  migrated request holds its own copy of them.

Pure Python: it takes numbers or numpy arrays alike (broadcast), so the planner's shape and the
configs that build it import no numpy.
"""
from __future__ import annotations

from dataclasses import dataclass

KV_KINDS = ("tokens", "slots", "paged")


@dataclass(frozen=True)
class KVUnit:
    kind: str = "tokens"
    page_size: int = 16

    def __post_init__(self):
        if self.kind not in KV_KINDS:
            raise ValueError(f"KVUnit.kind: expected one of {', '.join(KV_KINDS)}, got {self.kind!r}")
        if self.page_size < 1:
            raise ValueError(f"KVUnit.page_size: expected >= 1, got {self.page_size}")

    @property
    def queues(self) -> bool:
        """The cache admits the requests that fit and queues the rest (a free slot, or the pages
        of its predicted length): a batch larger than a rank's KV runs, slower. The `tokens` model
        holds every request from its prefill on, so a batch that does not fit cannot run."""
        return self.kind != "tokens"

    def held(self, prompt, tokens, slot_len):
        """KV positions a request of `prompt` positions and `tokens` more holds (`slot_len`: one
        slot's positions, read under `slots` only)."""
        if self.kind == "tokens":
            return prompt + tokens
        if self.kind == "paged":
            return -(-(prompt + tokens) // self.page_size) * self.page_size
        return 0 * (prompt + tokens) + slot_len

    def shared(self, prompt):
        """Of `held`, the positions of a request's prompt that the other samples of its group on the
        same rank hold with it (its full pages under `paged`; nothing otherwise)."""
        if self.kind == "paged":
            return prompt // self.page_size * self.page_size
        return 0 * prompt


def slot_len(prompt, longest):
    """A slot's positions: the batch's longest prompt (`prompt`: every request's) plus the longest
    response it may reach (`longest`: the generation cap where one is known), what the slot cache
    gives every request."""
    return max(prompt, default=0) + longest


def share_groups(keys, known_prefix=None):
    """Each response's sharing group under `paged`, from its `(prompt_id, sample)` key: its prompt,
    whose samples prefilled together compute it once; a response carried over from an earlier
    rollout (`known_prefix`: its tokens so far) is re-prefilled with them and shares nothing (its
    own key)."""
    return [k if known_prefix and known_prefix.get(k) else k[0] for k in keys]


TOKENS = KVUnit()  # every request holds exactly its positions: the default where no cache is named
