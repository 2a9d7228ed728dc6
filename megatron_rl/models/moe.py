"""The MoE block: a replicated top-k router, a bank of the experts this rank holds, and a dispatcher.

Shape suffixes: T tokens, D hidden, K top-k, F expert FFN, E experts.

The layer knows nothing of process groups. Where tokens go to be computed is the dispatcher's job
(`LocalDispatcher` here: every expert is in the local bank; `megatron_rl.models.ep_dispatch`
sends tokens to the owners over an EP group). `elastic/` changes the EP group by handing every layer
a new dispatcher; the bank grows or shrinks as experts move.

Experts are keyed by their *global* index (`local_experts.<e>`), which is Megatron's SequentialMLP
naming at EP=1; a rank's bank simply holds a subset of the keys.

Two ways to compute, one result: with autograd on (training) each expert's two matmuls run on its
own parameters; without it (rollout) the bank runs one grouped GEMM per matmul (`torch._grouped_mm`,
as torchtitan's GroupedExperts) over a stacked copy of the weights, with the group offsets computed
on the device: the rollout step reads nothing back from the device here. `_grouped_mm` equals the
per-expert `F.linear` bit for bit on CPU (tests/unit/megatron_rl/models/test_moe_grouped.py). Where no grouped kernel
exists (float64 anywhere; CUDA before sm90 or outside bfloat16; see `grouped_mm_ok`) the bank keeps
the per-expert loop, which reads the per-expert counts back once per layer.

Rows that must reach no expert (padding of a CUDA-graph bucket, padded prefill tokens) carry the
expert id `E` = num_moe_experts, the "null expert": they sort after every real group, no GEMM covers
them, and the layer zeroes their output. A row routed to an expert this rank does not hold is
counted on the device (`misrouted`) instead of raising mid-step; the engine reads the count with
the step's tokens and raises then (`check_routing`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Iterable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from megatron_rl.models.config import MoEModelConfig


@functools.lru_cache(maxsize=None)
def grouped_mm_ok(dtype: torch.dtype, device: torch.device) -> bool:
    """Where `torch._grouped_mm` runs with device-side offsets (torch 2.13 CPU, torch 2.11 CUDA):
    on CPU in float32/bfloat16/float16; on CUDA in bfloat16 on compute capability majors 9 and 10
    (Hopper, Blackwell datacenter: its CUTLASS kernels; elsewhere, sm120 included, there is none, or
    a fallback that reads the offsets back). Float64 has none."""
    if device.type == "cpu":
        return dtype in (torch.float32, torch.bfloat16, torch.float16)
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] in (9, 10)
    return False


def expert_report(dtype: torch.dtype, device: torch.device) -> dict:
    """How the torch backend's rollout computes its experts here, for the rollout report: the
    grouped GEMM, or the per-expert loop (one host read of the counts per layer) where none runs."""
    if grouped_mm_ok(dtype, device):
        return {"experts": "grouped GEMM (torch._grouped_mm)"}
    return {"experts": f"per-expert loop (no grouped GEMM for {str(dtype).removeprefix('torch.')} on {device.type})"}


def widens(dtype: torch.dtype) -> bool:
    """Router, norms and softmax run in at least fp32 (as HF and Megatron do); fp32/fp64 need no cast."""
    return dtype not in (torch.float32, torch.float64)


class Expert(nn.Module):
    """A SwiGLU expert's weights: `linear_fc1` holds [gate; up] stacked as Megatron's GLU does:
    [2F, D]; `linear_fc2` is [D, F]. `ExpertBank.compute` applies them to many experts at once."""

    def __init__(self, hidden: int, ffn: int, dtype: torch.dtype, device: torch.device | None = None):
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden, 2 * ffn, bias=False, dtype=dtype, device=device)
        self.linear_fc2 = nn.Linear(ffn, hidden, bias=False, dtype=dtype, device=device)



@dataclass
class StackedExperts:
    """A bank's held expert weights stacked for `_grouped_mm` (`ExpertBank.stacked`), and the
    indices its grouping reads; built for one set of held modules on one device (`of`)."""

    of: tuple  # the device and the held expert modules it was built from
    params: list[torch.Tensor]  # the fc1 weights, then the fc2 weights, in `held()` order
    fc1_E2FD: torch.Tensor  # the copies, written in place by `refresh`
    fc2_EDF: torch.Tensor
    local_E: torch.Tensor  # global expert (and the null expert) -> local group
    group_ids: torch.Tensor  # 0..n: the n held experts' groups and the null rows'
    version: int = -1  # the params' version sum the copies hold
    # fc1 as [E, D, 2F] and fc2 as [E, F, D]: transposed views of the copies, what `_grouped_mm` takes.
    views: tuple[torch.Tensor, torch.Tensor] = field(init=False)

    def __post_init__(self):
        self.views = (self.fc1_E2FD.transpose(1, 2), self.fc2_EDF.transpose(1, 2))

    def refresh(self) -> None:
        """Copy the params in again if any was written since (their version counters only grow)."""
        version = sum(w._version for w in self.params)
        if self.version != version:
            n = len(self.params) // 2
            with torch.no_grad():
                if n:
                    torch.stack(self.params[:n], out=self.fc1_E2FD)
                    torch.stack(self.params[n:], out=self.fc2_EDF)
            self.version = version


class ExpertBank(nn.Module):
    """The experts one rank holds, by global index."""

    def __init__(self, config: MoEModelConfig, experts: Iterable[int], dtype: torch.dtype):
        super().__init__()
        self.hidden, self.ffn, self.dtype = config.hidden_size, config.moe_ffn_hidden_size, dtype
        self.num_experts = config.num_moe_experts
        self.local_experts = nn.ModuleDict(
            {str(e): Expert(self.hidden, self.ffn, dtype) for e in sorted(experts)}
        )
        # Rows that reached this rank for an expert it does not hold (the null expert's are expected).
        self.register_buffer("misrouted", torch.zeros(1, dtype=torch.long), persistent=False)
        self.generation = 0
        self._stacked: StackedExperts | None = None  # built by the first `stacked()` of a rollout

    def held(self) -> list[int]:
        return sorted(int(k) for k in self.local_experts.keys())

    def __contains__(self, e: int) -> bool:
        return str(e) in self.local_experts

    def get(self, e: int) -> Expert:
        return self.local_experts[str(e)]

    def add(self, e: int, fc1_2FD: torch.Tensor, fc2_DF: torch.Tensor) -> None:
        ex = Expert(self.hidden, self.ffn, self.dtype, fc1_2FD.device)
        with torch.no_grad():
            ex.linear_fc1.weight.copy_(fc1_2FD)
            ex.linear_fc2.weight.copy_(fc2_DF)
        self.local_experts[str(e)] = ex

    def drop(self, e: int) -> None:
        del self.local_experts[str(e)]
        # The stacked copy refers to the dropped weights: forget it, or their memory stays held.
        self._stacked = None

    def stacked(self) -> StackedExperts:
        """The held experts' weights stacked in `held()` order, laid out for `_grouped_mm`
        (`StackedExperts.views`: fc1 as [E, D, 2F] and fc2 as [E, F, D], transposed views of
        [E, 2F, D] / [E, D, F]).

        A copy of the parameters (they stay the truth for training, checkpoints and expert moves).
        Rebuilt, as new tensors, when the held modules change (`generation` counts those rebuilds:
        a captured CUDA graph reads the old tensors and must be captured again); refreshed in
        place when any weight is written: in-place writes (optimizer steps, weight sync, `copy_`)
        bump a tensor's version counter, which only grows, so the sum of the versions changes with
        any write. A parameter *object* swapped for another under the same expert module
        (`load_state_dict(assign=True)`) would go unnoticed; nothing in the project does that,
        expert moves replace whole modules. It costs a second copy of the local expert weights
        while a rollout runs.
        """
        modules = (self.device, *self.local_experts._modules.values())
        if self._stacked is None or self._stacked.of != modules:
            held = [self.get(e) for e in self.held()]
            params = [ex.linear_fc1.weight for ex in held] + [ex.linear_fc2.weight for ex in held]
            n, dev = len(held), self.device
            # Normal tensors even when built inside a rollout's inference mode: a later refresh
            # may run under plain no_grad (log-prob recomputation), which may not write inference tensors.
            with torch.inference_mode(False), torch.no_grad():
                fc1_E2FD = torch.empty(n, 2 * self.ffn, self.hidden, dtype=self.dtype, device=dev)
                fc2_EDF = torch.empty(n, self.hidden, self.ffn, dtype=self.dtype, device=dev)
                # Global -> local expert index; the null expert `E` maps to `n`, the group after
                # the last held one, and every expert not held to `n + 1`: no GEMM covers either.
                local_E = torch.full((self.num_experts + 1,), n + 1, dtype=torch.long)
                local_E[self.held()] = torch.arange(n)
                local_E[self.num_experts] = n
            self._stacked = StackedExperts(modules, params, fc1_E2FD, fc2_EDF, local_E.to(dev),
                                           torch.arange(n + 1, device=dev))
            self.generation += 1
        self._stacked.refresh()
        return self._stacked

    @property
    def device(self) -> torch.device:
        return self.misrouted.device  # a buffer: it moves with the module

    def compute(self, x_TD: torch.Tensor, expert_T: torch.Tensor) -> torch.Tensor:
        """Run each token through its expert (SwiGLU): out = fc2(silu(gate) * up), [gate; up] = fc1(x).

        A token's result depends only on its own row and its expert's weights (row-wise matmuls),
        up to the BLAS kernel's blocking; see docs/rollout.md on batch invariance. One stable sort
        groups the tokens by expert (each expert's rows keep their order, rows for no held expert
        last); the elementwise SwiGLU runs once over all rows, only the two matmuls are per expert
        (or one grouped GEMM each). Rows of no held expert get unspecified values: the null
        expert's are zeroed by `MoELayer`, misrouted ones are counted in `misrouted`.
        """
        if x_TD.shape[0] == 0:
            return torch.empty_like(x_TD)
        stacked = self.stacked()
        fc1_ED2F, fc2_EFD = stacked.views
        n = fc1_ED2F.shape[0]
        T = x_TD.shape[0]
        # Sorted by local group: the n held experts', then the null rows (n), then the misrouted
        # rows (n + 1); the groups' ends come from the sorted keys on the device. A bank holding
        # every expert has local = global index and no misrouted rows: no lookup, no count.
        full = n == self.num_experts
        local_T, order_T = torch.sort(expert_T if full else stacked.local_E[expert_T], stable=True)
        end_G = torch.searchsorted(local_T, stacked.group_ids, right=True, out_int32=True)
        if not full:
            self.misrouted.add_(T - end_G[n])
        x_TD = x_TD.index_select(0, order_T)
        out_TD = torch.empty_like(x_TD)
        if n and not torch.is_grad_enabled() and grouped_mm_ok(x_TD.dtype, x_TD.device):
            # Group i is the i-th held expert's rows, offs[i-1]:offs[i]; unrouted experts are empty
            # groups; rows past offs[-1] (null, misrouted) are covered by no group.
            offs_G = end_G[:n]
            h_T2F = torch._grouped_mm(x_TD, fc1_ED2F, offs=offs_G)
            gate_TF, up_TF = h_T2F.chunk(2, dim=-1)
            y_TD = torch._grouped_mm(F.silu(gate_TF) * up_TF, fc2_EFD, offs=offs_G)
        else:
            # The per-expert loop (float64, training, no grouped kernel): its split sizes are the
            # layer's one read of device data, which also tells of misrouted rows at once.
            ends = end_G.tolist() + [T]
            counts = [b - a for a, b in zip([0] + ends, ends)]  # n held, null, misrouted
            if counts[n + 1]:
                self.check_routing()
            held = self.held()
            sizes = [c for c in counts[:n] if c]
            experts = [self.get(e) for e, c in zip(held, counts) if c]
            parts = torch.split(x_TD[: sum(sizes)], sizes)
            h_T2F = torch.cat([F.linear(x, ex.linear_fc1.weight) for x, ex in zip(parts, experts)]
                              + [x_TD.new_zeros(counts[n], 2 * self.ffn)])
            gate_TF, up_TF = h_T2F.chunk(2, dim=-1)
            a_parts = torch.split(F.silu(gate_TF) * up_TF, sizes + [counts[n]])
            y_TD = torch.cat([F.linear(a, ex.linear_fc2.weight) for a, ex in zip(a_parts, experts)]
                             + [x_TD.new_zeros(counts[n], self.hidden)])
        return out_TD.index_copy_(0, order_T, y_TD)  # a plain row copy, cheaper than index_put on CPU

    def check_routing(self) -> None:
        """Raise if rows reached this rank for an expert it does not hold (a host read: call it
        where the step reads back anyway, or after a count said so)."""
        rows = int(self.misrouted.item())
        if rows:
            self.misrouted.zero_()
            raise RuntimeError(f"{rows} rows routed to experts this rank does not hold (it holds {self.held()})")


class Dispatcher(Protocol):
    """Moves routed tokens to the experts' owners and their outputs back, in the caller's order."""

    def __call__(self, x_TD: torch.Tensor, expert_TK: torch.Tensor, bank: ExpertBank) -> torch.Tensor:
        """Return out_TKD: the output of expert `expert_TK[t, k]` on token t."""


class LocalDispatcher:
    """Every expert is in the local bank: no communication."""

    def __call__(self, x_TD: torch.Tensor, expert_TK: torch.Tensor, bank: ExpertBank) -> torch.Tensor:
        T, K = expert_TK.shape
        flat_x = x_TD.repeat_interleave(K, dim=0)
        return bank.compute(flat_x, expert_TK.reshape(-1)).view(T, K, x_TD.shape[1])  # (T may be 0)


class TorchRouter(nn.Module):
    def __init__(self, config: MoEModelConfig, dtype: torch.dtype):
        super().__init__()
        self.topk = config.moe_router_topk
        self.pre_softmax = config.moe_router_pre_softmax
        self.weight = nn.Parameter(torch.empty(config.num_moe_experts, config.hidden_size, dtype=dtype))
        self.tap = None  # a `models.routes.RouteTap` once a rollout records or training replays
        self._fp32: torch.Tensor | None = None  # the kept fp32 copy (`weight_fp32`), made by its first call
        self._fp32_version: int | None = None  # the weight's version the copy holds

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # The gating product itself in fp32 (inputs and weight upcast), as megatron-core's router
        # computes it with moe_router_dtype='fp32' (the megatron backend's setting). Rounded to
        # bf16 (HF rounds there), the logits flip top-k choices on weight changes of one Adam step
        # at lr 1e-3: the bf16 GRPO check then jumped 0.54 -> 0.99 in reward and raised its own
        # surrogate; with fp32 gating it ran like fp32 (docs/gpu.md).
        if widens(x_TD.dtype):
            logits_TE = F.linear(x_TD.float(), self.weight_fp32())
        else:
            logits_TE = F.linear(x_TD, self.weight)
        scores_TE = torch.softmax(logits_TE, dim=-1) if self.pre_softmax else logits_TE
        top_TK, expert_TK = torch.topk(scores_TE, self.topk, dim=-1)
        if self.tap is not None:  # routing replay (models/routes.py): record, compare or replay
            top_TK, expert_TK = self.tap.route(scores_TE, top_TK, expert_TK)
        probs_TK = top_TK if self.pre_softmax else torch.softmax(top_TK, dim=-1)
        return (probs_TK.to(x_TD.dtype) if widens(x_TD.dtype) else probs_TK), expert_TK

    def weight_fp32(self) -> torch.Tensor:
        """The weight upcast to fp32: under autograd a fresh cast (the gradient flows through it);
        without, a kept copy, refreshed in place when the weight's version moves (a CUDA graph
        holds the copy's address), so a rollout step casts nothing."""
        if torch.is_grad_enabled():
            return self.weight.float()
        w = self.weight
        kept = self._fp32
        if kept is None or kept.device != w.device:
            with torch.inference_mode(False), torch.no_grad():
                kept = self._fp32 = torch.empty(w.shape, dtype=torch.float32, device=w.device)
            self._fp32_version = None
        if self._fp32_version != w._version:
            with torch.no_grad():
                kept.copy_(w)
            self._fp32_version = w._version
        return kept


class MoELayer(nn.Module):
    def __init__(self, config: MoEModelConfig, experts: Iterable[int], dtype: torch.dtype):
        super().__init__()
        self.router = TorchRouter(config, dtype)
        self.experts = ExpertBank(config, experts, dtype)
        self.dispatcher: Dispatcher = LocalDispatcher()

    def forward(self, x_TD: torch.Tensor, valid_T: torch.Tensor | None = None) -> torch.Tensor:
        """`valid_T` (bool): rows that are real tokens; the others go to the null expert (no GEMM,
        no remote rank) and come out as zeros, so a padded batch needs no host-side compaction."""
        probs_TK, expert_TK = self.router(x_TD)
        if valid_T is not None:
            expert_TK = expert_TK.masked_fill(~valid_T[:, None], self.experts.num_experts)
        out_TKD = self.dispatcher(x_TD, expert_TK, self.experts)
        # Combine in k order: a fixed reduction order, whatever rank computed each expert.
        w_TKD = probs_TK[:, :, None] * out_TKD
        y_TD = w_TKD[:, 0]
        for k in range(1, w_TKD.shape[1]):
            y_TD = y_TD + w_TKD[:, k]
        return y_TD if valid_T is None else y_TD.masked_fill(~valid_T[:, None], 0)
