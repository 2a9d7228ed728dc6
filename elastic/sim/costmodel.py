"""Cost model: how long a decode step, an all-to-all, a prefill and a shrink take, in place of GPUs.

The simulator and the planner both price a plan with this model. Its fields are the machine it
prices (`hardware.Hardware`: the model's shape, Qwen3-30B-A3B in bf16 by default, on H100-80GB SXM
nodes of 8 GPUs, each constant with its source); these are the formulas.

One rank's decode step (its own compute and memory traffic, phases added, not overlapped):
    bytes  = [batch > 0] * dense weights + KV bytes of its live context + activated expert weights
    flops  = 2 * batch * dense params + routed tokens * 2 * expert params + attention over KV
    time   = bytes / hbm_bytes_per_s + flops / flops_per_s
A synchronous EP step lasts `step_overhead_s + max over members(time) + all-to-all(group)` (the
first two times a contention factor when ranks share a CPU host, see `host_cores`); the
all-to-all is a per-layer latency plus bytes over a bandwidth, both larger once the group spans
nodes (RDMA) than inside one NVLink domain. Adding rather than overlapping phases and using the mean
expert activation are the two simplifications; both keep step time monotone in batch, context and
group tokens, which the analytical lower bound relies on.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace

import numpy as np

from elastic.planning.busiest import busiest_load
from elastic.sim.hardware import Hardware


@dataclass(frozen=True)
class CostModel(Hardware):
    # `decode_step_s` broadcasts over numpy arrays (`step_cost.step_table` prices whole tables at once).
    takes_arrays = True

    # ---- per-rank compute and memory ----------------------------------------------------------------
    def step_bytes(self, batch, kv_tokens, experts_owned, group_tokens):
        """HBM bytes one rank's step reads (arrays broadcast): the dense weights if it has tokens,
        its live KV, and the experts it owns that the group's tokens hit (uniform routing). Over the
        device's peak bandwidth, the step's roofline (tools/bench_gpu.py)."""
        s = self.shape
        n = np.asarray(batch, dtype=np.float64)
        kv = np.asarray(kv_tokens, dtype=np.float64)
        own = np.asarray(experts_owned, dtype=np.float64)
        big_n = np.asarray(group_tokens, dtype=np.float64)
        # An expert is read if at least one of the group's tokens picks it (uniform routing).
        hit = 1.0 - np.power(1.0 - s.topk / s.num_experts, big_n)
        expert_read = own * hit * s.expert_params_per_layer * s.num_layers * s.bytes_per_param
        return (n > 0) * s.step_dense_bytes + kv * s.kv_bytes_per_token + expert_read

    def rank_compute_s(self, batch, kv_tokens, experts_owned, group_tokens):
        """Seconds one rank spends on its own step (arrays broadcast). `kv_tokens` is the summed
        context of its live requests; `group_tokens` the tokens of the whole EP group this step."""
        n = np.asarray(batch, dtype=np.float64)
        kv = np.asarray(kv_tokens, dtype=np.float64)
        own = np.asarray(experts_owned, dtype=np.float64)
        big_n = np.asarray(group_tokens, dtype=np.float64)
        routed = big_n * self.shape.topk * own / self.shape.num_experts
        mem = self.step_bytes(n, kv, own, big_n)
        flops = (2.0 * n * self.shape.step_dense_params
                 + 2.0 * routed * self.shape.expert_params_per_layer * self.shape.num_layers
                 + kv * self.shape.attn_flops_per_kv_token)
        return mem / self.hbm_bytes_per_s + flops / self.flops_per_s

    def a2a_s(self, ep_size, tokens_per_rank):
        """Dispatch + combine over all layers for one step of an EP group (0 for a group of one)."""
        g = np.asarray(ep_size, dtype=np.float64)
        traffic = np.asarray(tokens_per_rank, dtype=np.float64) * self.shape.topk * self.shape.hidden_size * 3.0
        eps = np.array([p[0] for p in self.a2a_inter_latency_s], dtype=np.float64)
        lats = np.array([p[1] for p in self.a2a_inter_latency_s], dtype=np.float64)
        inter = np.interp(np.log2(np.maximum(g, 1.0)), np.log2(eps), lats) + traffic / self.a2a_inter_bytes_per_s
        intra = self.intra_latency_s(g) + traffic / self.a2a_intra_bytes_per_s
        per_layer = np.where(g > self.shape.ranks_per_node, inter, intra)
        return np.where(g > 1, per_layer * self.shape.num_layers, 0.0)

    def intra_latency_s(self, ep_size):
        """In-node all-to-all latency per MoE layer: the host table where there is one, else
        latency + per-peer growth."""
        g = np.asarray(ep_size, dtype=np.float64)
        if self.a2a_host_latency_s:
            eps, lats = zip(*self.a2a_host_latency_s)
            return np.interp(g, np.array(eps, dtype=np.float64), np.array(lats, dtype=np.float64))
        return self.a2a_intra_latency_s + self.a2a_intra_per_peer_s * np.maximum(g - 2, 0)

    def contention(self, busy_ranks):
        """Slow-down of per-rank work when `busy_ranks` ranks compute at once (1 with accelerators)."""
        if not self.host_cores:
            return np.ones_like(np.asarray(busy_ranks, dtype=np.float64))
        return np.maximum(1.0, np.asarray(busy_ranks, dtype=np.float64) / self.host_cores)

    # ---- the protocol the planner prices plans with ------------------------------------------------
    def decode_step_s(self, batch_per_rank, context, ep_size, busy=None) -> float:
        """One step of a balanced group: every member holds E/ep_size experts, and `busy` members
        (default: all) hold `batch_per_rank` requests of mean context `context`; the others run
        dummy steps."""
        g = np.asarray(ep_size, dtype=np.float64)
        k = g if busy is None else np.asarray(busy, dtype=np.float64)
        n = np.asarray(batch_per_rank, dtype=np.float64)
        t = self.rank_compute_s(n, n * context, self.shape.num_experts / g, n * k)
        out = self.contention(k) * (self.step_overhead_s + t) + self.a2a_s(g, n)
        return float(out) if np.ndim(out) == 0 else out

    def prefill_s(self, prompt_tokens, ep_size) -> float:
        """Prefill of `prompt_tokens` on one rank of a balanced group: every prompt token is one
        token of the batch and writes its KV once (attention's quadratic term is left out: prompts
        are hundreds of tokens, responses thousands)."""
        p = float(prompt_tokens)
        g = float(ep_size)
        t = self.rank_compute_s(p, p, self.shape.num_experts / g, p * g)
        return float(self.contention(g) * (self.step_overhead_s + t) + self.a2a_s(g, p))

    def shrink_s(self, experts_moved: int, ep_size: int) -> float:
        """The planner's estimate of a shrink that moves `experts_moved` experts out of a group of
        `ep_size`: with balanced ownership the survivors are `ep_size * (1 - moved / E)`, each
        receiving an equal share over the slower link the group uses."""
        if experts_moved <= 0:
            return 0.0
        survivors = max(1, round(ep_size * (1 - experts_moved / self.shape.num_experts)))
        per_receiver = -(-experts_moved // survivors)
        intra = ep_size <= self.shape.ranks_per_node
        bw = self.transfer_intra_bytes_per_s if intra else self.transfer_inter_bytes_per_s
        return self.shrink_fixed_s + per_receiver * self.shape.expert_bytes / bw

    def migrate_s(self, kv_bytes: float, ep_size: int) -> float:
        """The planner's estimate of moving KV cache inside a group of `ep_size`, `kv_bytes` being
        what the busiest rank sends or receives (moves between distinct pairs run at once) over the
        group's slower link; it rides on a shrink's barrier."""
        intra = ep_size <= self.shape.ranks_per_node
        bw = self.transfer_intra_bytes_per_s if intra else self.transfer_inter_bytes_per_s
        return float(kv_bytes) / bw

    def transfer_s(self, moves: Iterable[tuple[int, int, int]]) -> float:
        """Wall time of the expert moves `(expert, from_rank, to_rank)` of one shrink or restore:
        every rank sends and receives concurrently; the busiest sender or receiver sets the time."""
        moves = list(moves)
        if not moves:
            return 0.0
        return self.shrink_fixed_s + busiest_load((src, dst, self.shape.expert_bytes / self.link_bytes_per_s(src, dst))
                                                  for _e, src, dst in moves)

    def link_bytes_per_s(self, src: int, dst: int) -> float:
        """The rate of the link between ranks `src` and `dst`: in-node or across nodes."""
        same_node = src // self.shape.ranks_per_node == dst // self.shape.ranks_per_node
        return self.transfer_intra_bytes_per_s if same_node else self.transfer_inter_bytes_per_s

    def min_decode_step_s(self, context, ep_size):
        """A step can cost no less than this when one request of `context` tokens is live in a
        group of `ep_size`: one token's dense and KV work plus the group's smallest all-to-all (the
        rank owning the most experts only adds to the max)."""
        return self.step_overhead_s + self.rank_compute_s(1.0, context, 0.0, 0.0) + self.a2a_s(ep_size, 1.0)

    def scaled(self, factor: float) -> CostModel:
        """Every duration times `factor` (rates divided by it): the same shape of costs on a machine
        that is uniformly `factor` times slower, e.g. to match one measured rollout's wall time."""
        if factor <= 0:
            raise ValueError(f"scale factor: expected > 0, got {factor}")
        rates = {f: getattr(self, f) / factor for f in (
            "hbm_bytes_per_s", "flops_per_s", "a2a_intra_bytes_per_s", "a2a_inter_bytes_per_s",
            "transfer_intra_bytes_per_s", "transfer_inter_bytes_per_s")}
        times = {f: getattr(self, f) * factor for f in (
            "step_overhead_s", "a2a_intra_latency_s", "a2a_intra_per_peer_s", "shrink_fixed_s", "restore_extra_s")}
        return replace(self, a2a_inter_latency_s=tuple((e, s * factor) for e, s in self.a2a_inter_latency_s),
                       a2a_host_latency_s=tuple((e, s * factor) for e, s in self.a2a_host_latency_s),
                       **rates, **times)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["a2a_inter_latency_s"] = [list(p) for p in self.a2a_inter_latency_s]
        d["a2a_host_latency_s"] = [list(p) for p in self.a2a_host_latency_s]
        return d


DEFAULT_COST = CostModel()
