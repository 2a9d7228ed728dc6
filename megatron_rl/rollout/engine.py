"""One rank's generation engine: batched prefill and decode over a slot KV cache.

The engine owns this rank's requests and KV cache; the model's MoE layers own the route to the
experts (a dispatcher). One call of `step()` is one synchronous EP step: a single forward through
every MoE layer, whether it prefills newly admitted requests, decodes the live ones, or, with
nothing local to do, routes zero tokens (`dummy_step`, Megatron's `dummy_forward`) so the other
ranks' all-to-alls still complete. Finished requests leave the batch at once.

A request ends at its `fixed_len` when set (trace replay: ignore EOS, stop at the traced length),
else at EOS or `max_new_tokens`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_rl.models.qwen3_moe import Qwen3MoeModel
from megatron_rl.rollout.kv_cache import SlotKVCache
from megatron_rl.rollout.sampling import SamplingParams, choose_tokens


@dataclass
class Request:
    prompt_id: str
    sample: int
    prompt: list[int]
    max_new_tokens: int
    fixed_len: int | None = None
    tokens: list[int] = field(default_factory=list)
    slot: int = -1

    @property
    def key(self) -> tuple[str, int]:
        return (self.prompt_id, self.sample)

    def done(self, eos_id: int | None) -> bool:
        if self.fixed_len is not None:
            return len(self.tokens) >= self.fixed_len
        if eos_id is not None and self.tokens and self.tokens[-1] == eos_id:
            return True
        return len(self.tokens) >= self.max_new_tokens


class RolloutEngine:
    """Everything it allocates (KV cache, token ids, masks) is on the model's device; only the
    requests' bookkeeping and the chosen tokens live on the host. `max_batch` is the KV cache's
    slot count (`kv_cache.kv_cache_slots` sizes it from the device's memory)."""

    def __init__(self, model: Qwen3MoeModel, sampling: SamplingParams, max_batch: int,
                 max_len: int, eos_id: int | None = None):
        cfg = model.config
        self.model, self.sampling, self.eos_id = model, sampling, eos_id
        self.max_batch, self.device = max_batch, model.device
        self.cache = SlotKVCache(cfg.num_layers, max_batch, cfg.num_query_groups, max_len,
                                 cfg.kv_channels, model.dtype, self.device)
        self.pending: list[Request] = []
        self.live: list[Request] = []
        self.finished: list[Request] = []

    def add(self, requests: list[Request]) -> None:
        for r in requests:
            need = len(r.prompt) + (r.fixed_len if r.fixed_len is not None else r.max_new_tokens)
            if need > self.cache.max_len:
                raise ValueError(f"request {r.key} needs {need} positions, the KV cache has {self.cache.max_len}")
        self.pending.extend(requests)

    def has_work(self) -> bool:
        return bool(self.pending or self.live)

    @property
    def load(self) -> int:
        """Requests on this rank not yet finished (what the drain check counts)."""
        return len(self.pending) + len(self.live)

    @torch.inference_mode()
    def step(self) -> int:
        """One forward; returns the number of tokens generated."""
        if self.pending and self.cache.free:
            return self._prefill()
        if self.live:
            return self._decode()
        self.dummy_step()
        return 0

    @torch.inference_mode()
    def dummy_step(self) -> None:
        """Join every MoE layer's collectives with zero tokens."""
        empty = torch.zeros(0, self.model.config.hidden_size, dtype=self.model.dtype, device=self.device)
        for moe in self.model.moe_layers:
            moe(empty)

    def _prefill(self) -> int:
        admit = self.pending[: len(self.cache.free)]
        self.pending = self.pending[len(admit):]
        lens = [len(r.prompt) for r in admit]
        S = max(lens)
        ids = torch.zeros(len(admit), S, dtype=torch.long)
        for b, r in enumerate(admit):
            r.slot = self.cache.alloc()
            ids[b, : lens[b]] = torch.tensor(r.prompt, dtype=torch.long)
        ids = ids.to(self.device)
        lens_B = torch.tensor(lens, device=self.device)
        mask_BS = torch.arange(S, device=self.device)[None] < lens_B[:, None]
        pos_BS = self.cache.select([r.slot for r in admit], lens)
        logits_BV = self.model(ids, pos_BS, self.cache, mask_BS, logits_at_B=lens_B - 1)
        self.cache.commit()
        self.live.extend(admit)
        return self._emit(admit, logits_BV)

    def _decode(self) -> int:
        batch = self.live
        ids = torch.tensor([[r.tokens[-1]] for r in batch], dtype=torch.long, device=self.device)
        pos = self.cache.select([r.slot for r in batch], [1] * len(batch))
        logits_BV = self.model(ids, pos, self.cache, None)[:, 0]  # one position per row: no gather
        self.cache.commit()
        return self._emit(batch, logits_BV)

    def _emit(self, batch: list[Request], logits_BV: torch.Tensor) -> int:
        toks = choose_tokens(logits_BV, self.sampling, [r.key for r in batch], [len(r.tokens) for r in batch])
        for r, t in zip(batch, toks.tolist()):
            r.tokens.append(t)
        still = []
        for r in self.live:
            if r.done(self.eos_id):
                self.cache.release(r.slot)
                self.finished.append(r)
            else:
                still.append(r)
        self.live = still
        return len(batch)
