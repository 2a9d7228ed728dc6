"""The MoE block: a replicated top-k router, a bank of the experts this rank holds, and a dispatcher.

Shape suffixes: T tokens, D hidden, K top-k, F expert FFN, E experts.

The layer knows nothing of process groups. Where tokens go to be computed is the dispatcher's job
(`LocalDispatcher` here: every expert is in the local bank; `megatron_rl.parallel.ep_dispatch`
sends tokens to the owners over an EP group). `elastic/` changes the EP group by handing every layer
a new dispatcher; the bank grows or shrinks as experts move.

Experts are keyed by their *global* index (`local_experts.<e>`), which is Megatron's SequentialMLP
naming at EP=1; a rank's bank simply holds a subset of the keys.
"""
from __future__ import annotations

from typing import Iterable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from megatron_rl.models.config import MoEModelConfig


class Expert(nn.Module):
    """SwiGLU expert. `linear_fc1` holds [gate; up] stacked as Megatron's GLU does: [2F, D]."""

    def __init__(self, hidden: int, ffn: int, dtype: torch.dtype):
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden, 2 * ffn, bias=False, dtype=dtype)
        self.linear_fc2 = nn.Linear(ffn, hidden, bias=False, dtype=dtype)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        gate_TF, up_TF = self.linear_fc1(x_TD).chunk(2, dim=-1)
        return self.linear_fc2(F.silu(gate_TF) * up_TF)


class ExpertBank(nn.Module):
    """The experts one rank holds, by global index."""

    def __init__(self, config: MoEModelConfig, experts: Iterable[int], dtype: torch.dtype):
        super().__init__()
        self.hidden, self.ffn, self.dtype = config.hidden_size, config.moe_ffn_hidden_size, dtype
        self.local_experts = nn.ModuleDict(
            {str(e): Expert(self.hidden, self.ffn, dtype) for e in sorted(experts)}
        )

    def held(self) -> list[int]:
        return sorted(int(k) for k in self.local_experts.keys())

    def __contains__(self, e: int) -> bool:
        return str(e) in self.local_experts

    def get(self, e: int) -> Expert:
        return self.local_experts[str(e)]

    def add(self, e: int, fc1_2FD: torch.Tensor, fc2_DF: torch.Tensor) -> None:
        ex = Expert(self.hidden, self.ffn, self.dtype)
        with torch.no_grad():
            ex.linear_fc1.weight.copy_(fc1_2FD)
            ex.linear_fc2.weight.copy_(fc2_DF)
        self.local_experts[str(e)] = ex

    def drop(self, e: int) -> None:
        del self.local_experts[str(e)]

    def compute(self, x_TD: torch.Tensor, expert_T: torch.Tensor) -> torch.Tensor:
        """Run each token through its expert; tokens are grouped per expert in ascending order.

        A token's result depends only on its own row and its expert's weights (row-wise matmuls),
        up to the BLAS kernel's blocking; see `megatron_rl/rollout/README.md` on batch invariance.
        """
        out_TD = torch.empty_like(x_TD)
        if x_TD.shape[0] == 0:
            return out_TD
        for e in torch.unique(expert_T).tolist():
            idx = (expert_T == e).nonzero(as_tuple=True)[0]
            if str(e) not in self.local_experts:
                raise RuntimeError(f"expert {e} routed to a rank that does not hold it (holds {self.held()})")
            out_TD[idx] = self.get(e)(x_TD[idx])
        return out_TD


class Dispatcher(Protocol):
    """Moves routed tokens to the experts' owners and their outputs back, in the caller's order."""

    def __call__(self, x_TD: torch.Tensor, expert_TK: torch.Tensor, bank: ExpertBank) -> torch.Tensor:
        """Return out_TKD: the output of expert `expert_TK[t, k]` on token t."""


class LocalDispatcher:
    """Every expert is in the local bank: no communication."""

    def __call__(self, x_TD: torch.Tensor, expert_TK: torch.Tensor, bank: ExpertBank) -> torch.Tensor:
        T, K = expert_TK.shape
        flat_x = x_TD.repeat_interleave(K, dim=0)
        return bank.compute(flat_x, expert_TK.reshape(-1)).view(T, K, -1)


class Router(nn.Module):
    def __init__(self, config: MoEModelConfig, dtype: torch.dtype):
        super().__init__()
        self.topk = config.moe_router_topk
        self.pre_softmax = config.moe_router_pre_softmax
        self.weight = nn.Parameter(torch.empty(config.num_moe_experts, config.hidden_size, dtype=dtype))

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Scores in at least fp32, as HF Qwen3-MoE and Megatron's router do.
        logits_TE = F.linear(x_TD, self.weight).to(torch.promote_types(x_TD.dtype, torch.float32))
        if self.pre_softmax:
            probs_TK, expert_TK = torch.topk(torch.softmax(logits_TE, dim=-1), self.topk, dim=-1)
        else:
            top_TK, expert_TK = torch.topk(logits_TE, self.topk, dim=-1)
            probs_TK = torch.softmax(top_TK, dim=-1)
        return probs_TK.to(x_TD.dtype), expert_TK


class MoELayer(nn.Module):
    def __init__(self, config: MoEModelConfig, experts: Iterable[int], dtype: torch.dtype):
        super().__init__()
        self.router = Router(config, dtype)
        self.experts = ExpertBank(config, experts, dtype)
        self.dispatcher: Dispatcher = LocalDispatcher()

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        probs_TK, expert_TK = self.router(x_TD)
        out_TKD = self.dispatcher(x_TD, expert_TK, self.experts)
        # Combine in k order: a fixed reduction order, whatever rank computed each expert.
        y_TD = probs_TK[:, 0:1] * out_TKD[:, 0]
        for k in range(1, probs_TK.shape[1]):
            y_TD = y_TD + probs_TK[:, k:k + 1] * out_TKD[:, k]
        return y_TD
