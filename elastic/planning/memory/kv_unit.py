"""What one request holds of a rank's KV budget, under the KV cache the run uses: the one home of
that rule for the planner (`kv.Demand`), the online rule's moves (`online.place`), and the
simulator's admission and migrations (`elastic/sim/admission.py`, `placement.py`).

Every budget is in KV positions (`MemoryBudget.kv_budget_bytes // kv_bytes_per_token`); the unit
says how many positions a request of `prompt + tokens` holds. One class per KV kind, named once
(`KV_KINDS`) and built by `kv_unit`, so nothing that prices KV compares a kind's name:
- `TokensUnit` (`tokens`): exactly its positions (the planner's and the simulator's default model);
- `SlotsUnit` (`slots`, megatron_rl/rollout/kv/slots.py): a whole slot of the longest sequence,
  `slot_len` positions, whatever its length;
- `PagedUnit` (`paged`, megatron_rl/rollout/kv/paged.py): whole pages of `page_size` positions. The
  samples of one GRPO group that a rank prefills together hold their prompt's full pages once
  (`shared`); a migrated request holds its own copy of them.
The engine's side of the same kinds (its cache class and sizing) is megatron_rl/rollout/kv/kind.py,
whose objects hand the planner their unit.

Pure Python: it takes numbers or numpy arrays alike (broadcast), so the planner's shape and the
configs that build it import no numpy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class KVUnit:
    """How a KV cache holds a request (one subclass per kind)."""

    kind: ClassVar[str]
    # The cache admits the requests that fit and queues the rest (a free slot, or the pages of its
    # predicted length): a batch larger than a rank's KV runs, slower. The `tokens` model holds
    # every request from its prefill on, so a batch that does not fit cannot run.
    queues: ClassVar[bool]

    @classmethod
    def named(cls, page_size: int) -> KVUnit:
        """The unit as a config names it (`kv_unit`); `page_size` is read by `paged` only."""
        return cls()

    def held(self, prompt, tokens, slot_len):
        """KV positions a request of `prompt` positions and `tokens` more holds (`slot_len`: one
        slot's positions, read under `slots` only)."""
        raise NotImplementedError

    def shared(self, prompt):
        """Of `held`, the positions of a request's prompt that the other samples of its group on the
        same rank hold with it (its full pages under `paged`; nothing otherwise)."""
        return 0 * prompt


@dataclass(frozen=True)
class TokensUnit(KVUnit):
    kind = "tokens"
    queues = False

    def held(self, prompt, tokens, slot_len):
        return prompt + tokens


@dataclass(frozen=True)
class SlotsUnit(KVUnit):
    kind = "slots"
    queues = True

    def held(self, prompt, tokens, slot_len):
        return 0 * (prompt + tokens) + slot_len


@dataclass(frozen=True)
class PagedUnit(KVUnit):
    kind = "paged"
    queues = True
    page_size: int = 16

    def __post_init__(self):
        if self.page_size < 1:
            raise ValueError(f"KVUnit.page_size: expected >= 1, got {self.page_size}")

    @classmethod
    def named(cls, page_size: int) -> KVUnit:
        return cls(page_size)

    def held(self, prompt, tokens, slot_len):
        return -(-(prompt + tokens) // self.page_size) * self.page_size

    def shared(self, prompt):
        return prompt // self.page_size * self.page_size


_UNITS = {u.kind: u for u in (TokensUnit, SlotsUnit, PagedUnit)}
KV_KINDS = tuple(_UNITS)  # the choices of the simulator's `kv` and `flexfloor simulate --kv`


def kv_unit(kind: str, page_size: int = 16) -> KVUnit:
    """The unit of the KV kind `kind` (one of `KV_KINDS`), pages of `page_size` positions under `paged`."""
    if kind not in _UNITS:
        raise ValueError(f"KVUnit.kind: expected one of {', '.join(KV_KINDS)}, got {kind!r}")
    return _UNITS[kind].named(page_size)


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


TOKENS = TokensUnit()  # every request holds exactly its positions: the default where no cache is named
