"""The weight-update phases of a GRPO step: log-prob recomputation, then the policy update.

Row ownership for training is fixed by canonical order, not by who generated a response: rank r
trains on rows [r * n, (r + 1) * n) of the batch (n = rows per rank), split into `minibatches`
optimizer steps and micro-batches of `micro_batch` rows. So training sees the same thing whatever
the rollout placement was.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from megatron_rl.models.routes import RouteReplay, replaying, route_dtype
from megatron_rl.progress import Progress
from megatron_rl.rl.rollout_phase.phase import Response
from megatron_rl.rl.update.grpo import STAT_KEYS, LossBatch, finalize_stats, kl_k3, mis_keep, policy_loss
from megatron_rl.rl.update.mismatch import MismatchTally
from megatron_rl.rl.update.stats import WeightDelta, sum_over_ranks
from megatron_rl.rl.update.train_step import (
    Packed,
    chunks,
    optimizer_step,
    pack,
    sequence_logprobs,
)
from megatron_rl.trainer_config import TrainerConfig


@dataclass
class MicroBatch:
    packed: Packed
    advantages: torch.Tensor  # [B]
    rollout_logp: torch.Tensor  # [B, S], the engine's sampling log-probs on response tokens
    routes: tuple | None = None  # (routes [B x S, L, K], has_T [B x S]): the rollout's, `routes_of`
    missing_routes: int = 0  # rows whose response has no recorded routes
    # Filled by `recompute_logprobs` (`Recomputed.batches`), before any update:
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    keep: torch.Tensor | None = None  # [B, S] masked importance sampling (grpo.mis_bounds)

    def loss_batch(self, dtype: torch.dtype, tis_cap: float | None) -> LossBatch:
        """This micro-batch as `policy_loss` reads it; the rollout's log-probs (in the policy's
        `dtype`) only under `grpo.tis_cap`."""
        rollout_logp = self.rollout_logp.to(dtype) if tis_cap is not None else None
        return LossBatch(self.old_logp, self.advantages, self.packed.loss_mask, self.ref_logp, rollout_logp,
                         self.keep)

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


@dataclass
class Minibatch:
    """One optimizer step's share of this rank's rows, and the loss's normalizer: the minibatch's
    response tokens over every rank."""

    micro: list[MicroBatch]
    tokens: int


@dataclass
class Recomputed:
    """What `recompute_logprobs` measured before any update: the minibatches again, each micro-batch
    with its old-policy (and reference) log-probs and masked importance sampling's mask, and the
    step's mismatch tally (summed over the ranks with the update's figures)."""

    batches: list[Minibatch]
    mismatch: MismatchTally


class PolicyUpdate:
    def __init__(self, cfg: TrainerConfig, model, optimizer, ref_model, pad_id: int, rank: int, world: int):
        self.cfg, self.model, self.optimizer, self.ref_model = cfg, model, optimizer, ref_model
        self.pad_id, self.rank, self.world = pad_id, rank, world

    def minibatches(self, responses: list[Response], advantages: torch.Tensor) -> list[Minibatch]:
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
            out.append(Minibatch(micro, tokens))
        return out

    @torch.no_grad()
    def recompute_logprobs(self, batches: list[Minibatch]) -> Recomputed:
        """Old-policy (and reference) log-probs under the training numerics, before any update,
        routed by the rollout's routes with `grpo.routing_replay`; the step's mismatch measures
        (rl/update/mismatch.py) and masked importance sampling's masks."""
        g, T, chunk = self.cfg.grpo, self.cfg.generation.temperature, self.cfg.logprob_chunk_tokens
        mismatch = MismatchTally(self.model.device)
        out = []
        for batch in batches:
            micro = []
            for mb in batch.micro:
                with replaying(self.model, mb.replay(g.routing_replay, observe=True)) as replay:
                    old_logp = sequence_logprobs(self.model, mb.packed, T, chunk)
                mismatch.add_routes(replay, mb.missing_routes)
                ref_logp = None
                if self.ref_model is not None:
                    ref_logp = sequence_logprobs(self.ref_model, mb.packed, T, chunk)
                keep = None
                if g.mis_bounds is not None:
                    keep = mis_keep(old_logp, mb.rollout_logp, mb.packed.loss_mask, g.mis_bounds, g.mis_level)
                mismatch.add_logprobs(old_logp, mb.rollout_logp, mb.packed.loss_mask, g.tis_cap, keep)
                micro.append(replace(mb, old_logp=old_logp, ref_logp=ref_logp, keep=keep))
            out.append(Minibatch(micro, batch.tokens))
        return Recomputed(out, mismatch)

    def update(self, recomputed: Recomputed) -> dict[str, float]:
        g, T = self.cfg.grpo, self.cfg.generation.temperature
        batches = recomputed.batches
        dev = self.model.device

        def zero():
            return torch.zeros((), dtype=torch.float64, device=dev)

        # Token sums over this rank's rows, all-reduced in this order (rl/update/stats.py): the
        # loss, the policy's entropy, ppo_kl, rollout_gap, then policy_loss's STAT_KEYS.
        sums = {"loss": zero(), "entropy": zero(), "ppo_kl": zero(), "rollout_gap": zero(),
                **{k: zero() for k in STAT_KEYS}}
        gap_max, norms, sizes = zero(), [], []
        progress, done = Progress("update", sum(len(batch.micro) for batch in batches), "micro-batches",
                                  enabled=self.rank == 0), 0
        for batch in batches:
            self.optimizer.zero_grad(set_to_none=True)
            delta = WeightDelta(self.model)
            for mb in batch.micro:
                done += 1
                progress.update(done)
                # With replay, backward (and the layers it recomputes) routes as the forward did.
                with replaying(self.model, mb.replay(True, observe=False) if g.routing_replay else None):
                    logp, entropy = sequence_logprobs(self.model, mb.packed, T, self.cfg.logprob_chunk_tokens,
                                                      entropy=True)
                    # The policy's entropy on the response tokens, from the forward the update makes anyway.
                    sums["entropy"] += (entropy * mb.packed.loss_mask).sum().double()
                    loss, stats = policy_loss(logp, mb.loss_batch(logp.dtype, g.tis_cap), g,
                                              normalizer=max(batch.tokens, 1))
                    loss.backward()
                sums["loss"] += loss.detach().double()
                mask = mb.packed.loss_mask.double()
                gap = (mb.old_logp.double() - mb.rollout_logp).abs() * mask
                sums["ppo_kl"] += (kl_k3(logp.detach().double(), mb.old_logp.double()) * mask).sum()
                sums["rollout_gap"] += gap.sum()
                if gap.numel():
                    gap_max = torch.maximum(gap_max, gap.max())
                for key in STAT_KEYS:
                    sums[key] += stats[key].double()
            norms.append(optimizer_step(self.optimizer, self.model, self.cfg.optim.grad_clip, self.world))
            sizes.append(delta.measure(self.model, self.world))
            del delta
        totals = sum_over_ranks(sums, self.world)
        if self.world > 1:
            dist.all_reduce(gap_max, op=dist.ReduceOp.MAX)
        n = max(totals["tokens"], 1.0)
        return {"loss": totals["loss"] / len(batches), "grad_norm": sum(norms) / len(norms),
                "entropy": totals["entropy"] / n, **finalize_stats(totals),
                "ppo_kl": totals["ppo_kl"] / n, "rollout_gap": totals["rollout_gap"] / n,
                "rollout_gap_max": float(gap_max),
                "update_rel": sum(s for s, _ in sizes) / len(sizes),
                "update_changed": sum(c for _, c in sizes) / len(sizes),
                "mismatch": {**recomputed.mismatch.finish(self.world),
                             "logp_abs_diff_mean": totals["rollout_gap"] / n,
                             "logp_abs_diff_max": float(gap_max)}}
