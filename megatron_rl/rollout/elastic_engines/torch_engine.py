"""The rollout engine seen through `elastic.runtime.interface.ElasticEngine`: what `elastic/` may touch.

Holds the model (with the experts this rank holds now) and the rank's `RolloutEngine`; moves an
expert as one flat tensor of its weights in every layer; swaps the EP group by building a new
`AllToAllDispatcher` over a pre-created group and handing it to the model. Expert buffers are made
on the model's device; `transport` carries them (and the dispatcher's tokens) to the collectives.
"""
from __future__ import annotations

import torch

from elastic.runtime.transport import DirectTransport
from megatron_rl.models.ep_dispatch import AllToAllDispatcher
from megatron_rl.models.moe import LocalDispatcher
from megatron_rl.models.params import is_expert_param, tensor_digest
from megatron_rl.rollout.engine import Request, RolloutEngine
from megatron_rl.rollout.kv.budget import kv_numel


class ElasticRolloutEngine:
    def __init__(self, engine: RolloutEngine, world: int, transport: DirectTransport | None = None):
        self.engine, self.model, self.world = engine, engine.model, world
        self.device, self.transport = engine.device, transport or DirectTransport()
        cfg = self.model.config
        self.fc1_numel = 2 * cfg.moe_ffn_hidden_size * cfg.hidden_size
        self.fc2_numel = cfg.hidden_size * cfg.moe_ffn_hidden_size

    def load(self) -> int:
        return self.engine.load

    def step(self) -> int:
        return self.engine.step()

    def dummy_step(self) -> None:
        self.engine.dummy_step()

    def held_experts(self) -> list[int]:
        return self.model.moe_layers[0].experts.held()

    def expert_layers(self, expert: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(fc1, fc2) of `expert` in every MoE layer, in layer order."""
        return [(moe.experts.get(expert).linear_fc1.weight, moe.experts.get(expert).linear_fc2.weight)
                for moe in self.model.moe_layers]

    def export_expert(self, expert: int) -> torch.Tensor:
        return torch.cat([w.detach().reshape(-1) for pair in self.expert_layers(expert) for w in pair])

    def empty_expert(self) -> torch.Tensor:
        n = len(self.model.moe_layers) * (self.fc1_numel + self.fc2_numel)
        return torch.empty(n, dtype=self.model.dtype, device=self.device)

    def split_expert(self, flat: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The inverse of `export_expert`: (fc1, fc2) views per layer."""
        cfg = self.model.config
        chunks = flat.split([self.fc1_numel, self.fc2_numel] * len(self.model.moe_layers))
        return [(chunks[2 * i].view(2 * cfg.moe_ffn_hidden_size, cfg.hidden_size),
                 chunks[2 * i + 1].view(cfg.hidden_size, cfg.moe_ffn_hidden_size))
                for i in range(len(self.model.moe_layers))]

    def import_expert(self, expert: int, flat: torch.Tensor) -> None:
        for moe, (fc1, fc2) in zip(self.model.moe_layers, self.split_expert(flat)):
            moe.experts.add(expert, fc1, fc2)

    def drop_expert(self, expert: int) -> None:
        for moe in self.model.moe_layers:
            moe.experts.drop(expert)

    def use_group(self, group, owners: dict[int, int]) -> None:
        if self.world == 1:
            self.model.set_dispatcher(LocalDispatcher())
            return
        self.model.set_dispatcher(AllToAllDispatcher(group, [owners[e] for e in sorted(owners)], self.transport))

    def expert_bytes(self) -> int:
        """Memory of the experts this rank holds now (every layer)."""
        return sum(w.numel() * w.element_size() for e in self.held_experts() for pair in self.expert_layers(e)
                   for w in pair)

    def release_memory(self) -> int:
        """A detached rank, its experts already dropped, frees its KV cache for a lease; returns the
        bytes its cache held (the runtime adds the dropped experts' bytes)."""
        freed = self.engine.release_memory()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # back to the driver: a lease may run in another process
        return freed

    def reclaim_memory(self) -> None:
        """Before the restore: the KV cache again (the experts come back with the restore's moves)."""
        self.engine.reclaim_memory()

    def checksums(self) -> dict[str, str]:
        out = {}
        for name, p in self.model.named_parameters():
            if not is_expert_param(name):
                out[name] = tensor_digest(p)
        for e in self.held_experts():
            out[f"expert.{e}"] = tensor_digest(self.export_expert(e))
        return out


class MigratingRolloutEngine(ElasticRolloutEngine):
    """The elastic engine whose live requests can move to another rank (straggler KV migration).

    A request crosses as three tensors: a header (prompt length, tokens so far, max_new_tokens,
    fixed_len or -1, KV positions held, carried values, predicted_len or -1: the receiver admits it
    by the planner's prediction, as its sender did), its prompt and tokens followed by its
    carried values' float64 bits, and its KV rows of every layer. The sampling state is the
    request's identity and token count (`sampling.uniform` is keyed by them), so the receiver
    continues bit-identically. `carried` (key -> list of floats) is what the caller records per
    request beside the engine (the trainer's sampling log-probs); it moves with the request. The
    sender drops the request only when `release_request` is called, after the receiver confirmed
    (`elastic.runtime.online`).
    """

    def __init__(self, engine: RolloutEngine, world: int, transport: DirectTransport | None = None,
                 carried: dict[tuple[str, int], list[float]] | None = None):
        super().__init__(engine, world, transport)
        self.carried = carried

    def progress(self) -> list[tuple[tuple[str, int], int, bool]]:
        """(key, tokens generated, finished) of every request this rank holds or finished."""
        e = self.engine
        return [(r.key, len(r.tokens), False) for r in e.pending + e.live] + \
            [(r.key, len(r.tokens), True) for r in e.finished]

    def _find(self, key: tuple[str, int]):
        for where in (self.engine.live, self.engine.pending):
            for r in where:
                if r.key == key:
                    return r, where
        raise KeyError(f"request {key} is not live on this rank")

    def export_request(self, key: tuple[str, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        r, where = self._find(key)
        cache = self.engine.cache
        held = cache.lengths[r.slot] if where is self.engine.live else 0
        carried = [] if self.carried is None else self.carried.get(key, [])
        header = torch.tensor([len(r.prompt), len(r.tokens), r.max_new_tokens,
                               -1 if r.fixed_len is None else r.fixed_len, held, len(carried),
                               -1 if r.predicted_len is None else r.predicted_len], dtype=torch.long)
        ids = torch.cat([torch.tensor(r.prompt + r.tokens, dtype=torch.long),
                         torch.tensor(carried, dtype=torch.float64).view(torch.long)])  # exact bits
        # A paged request's shared prompt pages are copied out: the receiver holds its own.
        kv = cache.export_kv(r.slot, held) if held else self.empty_kv(0)
        return header, ids, kv

    def empty_kv(self, held: int) -> torch.Tensor:
        k = self.engine.cache.k[0]
        return torch.empty(kv_numel(len(self.engine.cache.k), k.shape[1], held, k.shape[3]), dtype=k.dtype,
                           device=k.device)

    def import_request(self, key: tuple[str, int], header: torch.Tensor, ids: torch.Tensor,
                       kv: torch.Tensor) -> None:
        prompt_len, n_tokens, max_new, fixed, held, n_carried, predicted = header.tolist()
        r = Request(key[0], key[1], ids[:prompt_len].tolist(), max_new, None if fixed < 0 else fixed,
                    ids[prompt_len:prompt_len + n_tokens].tolist(), predicted_len=None if predicted < 0 else predicted)
        if self.carried is not None:
            end = prompt_len + n_tokens
            self.carried[key] = ids[end:end + n_carried].contiguous().view(torch.float64).tolist()
        e = self.engine
        # The cache's own admission test (a free slot; paged: its predicted pages beside the live
        # requests' and the reserve). Refused, or not yet prefilled, it waits in line and is
        # prefilled with its tokens so far when admitted, as a preempted request is.
        if not held or not (e.cache.free and e.cache.admissible([held], [r.predicted_positions()], len(e.live), [0])):
            e.pending.append(r)
            return
        r.slot = e.cache.import_kv(kv, held, r.predicted_positions())
        e.live.append(r)

    def release_request(self, key: tuple[str, int]) -> None:
        r, where = self._find(key)
        where.remove(r)
        if self.carried is not None:
            self.carried.pop(key, None)
        if r.slot >= 0 and where is self.engine.live:
            self.engine.cache.release(r.slot)
