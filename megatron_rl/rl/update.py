"""The weight-update phases of a GRPO step: log-prob recomputation, then the policy update.

Row ownership for training is fixed by canonical order, not by who generated a response: rank r
trains on rows [r * n, (r + 1) * n) of the batch (n = rows per rank), split into `minibatches`
optimizer steps and micro-batches of `micro_batch` rows. So training sees the same thing whatever
the rollout placement was.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rl.models.routes import RouteReplay, replaying, route_dtype
from megatron_rl.progress import Progress
from megatron_rl.rl.grpo import STAT_KEYS, finalize_stats, kl_k3, mis_keep, policy_loss
from megatron_rl.rl.mismatch import MismatchTally
from megatron_rl.rl.rollout_phase import Response
from megatron_rl.rl.train_step import (
    Packed,
    chunks,
    optimizer_step,
    pack,
    sequence_logprobs,
)
from megatron_rl.rl.update_stats import WeightDelta
from megatron_rl.trainer_config import TrainerConfig


@dataclass
class MicroBatch:
    packed: Packed
    advantages: torch.Tensor  # [B]
    rollout_logp: torch.Tensor  # [B, S], the engine's sampling log-probs on response tokens
    routes: tuple | None = None  # (routes [B x S, L, K], has_T [B x S]): the rollout's, `routes_of`
    missing_routes: int = 0  # rows whose response has no recorded routes
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    keep: torch.Tensor | None = None  # [B, S] masked importance sampling (grpo.mis_bounds)

    def replay(self, replay: bool, observe: bool) -> RouteReplay:
        routes_TLK, has_T = self.routes
        mask_T = self.packed.token_mask.reshape(-1)
        return RouteReplay(routes_TLK, has_T & mask_T, mask_T, replay, observe)


def routes_of(responses: list[Response], rows: list[int], S: int, mcfg) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The rows' recorded routes in a packed micro-batch's layout: [B x S, L, K] (position t of
    row b at b x S + t), the positions that have them, and the count of rows without any."""
    L, K = mcfg.num_layers, mcfg.moe_router_topk
    routes = torch.zeros(len(rows), S, L, K, dtype=route_dtype(mcfg.num_moe_experts))
    has = torch.zeros(len(rows), S, dtype=torch.bool)
    missing = 0
    for b, i in enumerate(rows):
        r = responses[i].routes
        if r is None:
            missing += 1
            continue
        n = len(responses[i].prompt) + len(responses[i].tokens) - 1
        assert r.shape == (n, L, K), f"response {i}: routes of shape {tuple(r.shape)}, expected {(n, L, K)}"
        routes[b, :n] = r
        has[b, :n] = True
    return routes.view(-1, L, K), has.view(-1), missing


class PolicyUpdate:
    def __init__(self, cfg: TrainerConfig, model, optimizer, ref_model, pad_id: int, rank: int, world: int):
        self.cfg, self.model, self.optimizer, self.ref_model = cfg, model, optimizer, ref_model
        self.pad_id, self.rank, self.world = pad_id, rank, world

    def minibatches(self, responses: list[Response], advantages: torch.Tensor) -> list[tuple[list[MicroBatch], int]]:
        """This rank's micro-batches per minibatch, with the minibatch's global token count."""
        n, M = self.cfg.rows_per_rank, self.cfg.grpo.minibatches
        k = n // M
        out = []
        for m in range(M):
            tokens = sum(len(r.tokens) for rank in range(self.world)
                         for r in responses[rank * n + m * k : rank * n + (m + 1) * k])
            start = self.rank * n + m * k
            micro = []
            for rows in chunks(list(range(start, start + k)), self.cfg.grpo.micro_batch):
                packed = pack([(responses[i].prompt, responses[i].tokens) for i in rows], self.pad_id)
                rollout = torch.zeros_like(packed.loss_mask, dtype=torch.float64)
                rollout[packed.loss_mask.bool()] = torch.tensor(
                    [lp for i in rows for lp in responses[i].logprobs], dtype=torch.float64)
                dev = self.model.device
                routes_TLK, has_T, missing = routes_of(responses, rows, packed.input_ids.shape[1], self.cfg.model)
                micro.append(MicroBatch(packed.to(dev), advantages[rows].to(dev), rollout.to(dev),
                                        (routes_TLK.to(dev), has_T.to(dev)), missing))
            out.append((micro, tokens))
        return out

    @torch.no_grad()
    def recompute_logprobs(self, batches: list[tuple[list[MicroBatch], int]]) -> None:
        """Old-policy (and reference) log-probs under the training numerics, before any update,
        routed by the rollout's routes with `grpo.routing_replay`; the step's mismatch measures
        (`self.mismatch`, rl/mismatch.py) and masked importance sampling's masks."""
        g, T, chunk = self.cfg.grpo, self.cfg.generation.temperature, self.cfg.logprob_chunk_tokens
        self.mismatch = MismatchTally(self.model.device)
        for micro, _ in batches:
            for mb in micro:
                with replaying(self.model, mb.replay(g.routing_replay, observe=True)) as replay:
                    mb.old_logp = sequence_logprobs(self.model, mb.packed, T, chunk)
                self.mismatch.add_routes(replay, mb.missing_routes)
                if self.ref_model is not None:
                    mb.ref_logp = sequence_logprobs(self.ref_model, mb.packed, T, chunk)
                if g.mis_bounds is not None:
                    mb.keep = mis_keep(mb.old_logp, mb.rollout_logp, mb.packed.loss_mask, g.mis_bounds, g.mis_level)
                self.mismatch.add_logprobs(mb.old_logp, mb.rollout_logp, mb.packed.loss_mask, g.tis_cap, mb.keep)

    def update(self, batches: list[tuple[list[MicroBatch], int]]) -> dict[str, float]:
        g, T = self.cfg.grpo, self.cfg.generation.temperature
        dev = self.model.device
        sums = {k: torch.zeros((), dtype=torch.float64, device=dev) for k in STAT_KEYS}
        loss_total, norms = torch.zeros((), dtype=torch.float64, device=dev), []
        entropy_sum = torch.zeros((), dtype=torch.float64, device=dev)
        # ppo_kl, rollout_gap token sums; rollout_gap_max (rl/update_stats.py)
        diag = torch.zeros(3, dtype=torch.float64, device=dev)
        sizes = []
        progress, done = Progress("update", sum(len(micro) for micro, _ in batches), "micro-batches",
                                  enabled=self.rank == 0), 0
        for micro, tokens in batches:
            self.optimizer.zero_grad(set_to_none=True)
            delta = WeightDelta(self.model)
            for mb in micro:
                done += 1
                progress.update(done)
                # With replay, backward (and the layers it recomputes) routes as the forward did.
                with replaying(self.model, mb.replay(True, observe=False) if g.routing_replay else None):
                    logp, entropy = sequence_logprobs(self.model, mb.packed, T, self.cfg.logprob_chunk_tokens,
                                                      entropy=True)
                    # The policy's entropy on the response tokens, from the forward the update makes anyway.
                    entropy_sum += (entropy * mb.packed.loss_mask).sum().double()
                    loss, stats = policy_loss(
                        logp, mb.old_logp, mb.advantages, mb.packed.loss_mask,
                        clip_low=g.clip_low, clip_high=g.clip_high,
                        ref_logp=mb.ref_logp, kl_coef=g.kl_coef,
                        rollout_logp=mb.rollout_logp.to(logp.dtype) if g.tis_cap is not None else None,
                        tis_cap=g.tis_cap, normalizer=max(tokens, 1), keep=mb.keep)
                    loss.backward()
                loss_total += loss.detach().double()
                mask = mb.packed.loss_mask.double()
                gap = (mb.old_logp.double() - mb.rollout_logp).abs() * mask
                diag += torch.stack([(kl_k3(logp.detach().double(), mb.old_logp.double()) * mask).sum(),
                                     gap.sum(), torch.zeros((), dtype=torch.float64, device=dev)])
                diag[2] = torch.maximum(diag[2], gap.max() if gap.numel() else diag[2])
                for key in STAT_KEYS:
                    sums[key] += stats[key].double()
            norms.append(optimizer_step(self.optimizer, self.model, self.cfg.optim.grad_clip, self.world))
            sizes.append(delta.measure(self.model, self.world))
            del delta
        flat = torch.stack([loss_total, entropy_sum, diag[0], diag[1]] + [sums[k] for k in STAT_KEYS])
        gap_max = diag[2:3].clone()
        if self.world > 1:
            dist.all_reduce(flat)
            dist.all_reduce(gap_max, op=dist.ReduceOp.MAX)
        totals = dict(zip(STAT_KEYS, flat[4:]))
        n = max(float(totals["tokens"]), 1.0)
        return {"loss": float(flat[0]) / len(batches), "grad_norm": sum(norms) / len(norms),
                "entropy": float(flat[1]) / n, **finalize_stats(totals),
                "ppo_kl": float(flat[2]) / n, "rollout_gap": float(flat[3]) / n, "rollout_gap_max": float(gap_max),
                "update_rel": sum(s for s, _ in sizes) / len(sizes),
                "update_changed": sum(c for _, c in sizes) / len(sizes),
                "mismatch": {**self.mismatch.finish(self.world), "logp_abs_diff_mean": float(flat[3]) / n,
                             "logp_abs_diff_max": float(gap_max)}}
