"""The MoE block: a replicated top-k router, a bank of the experts this rank holds, and a dispatcher.

Shape suffixes: T tokens, D hidden, K top-k, F expert FFN, E experts.

The layer knows nothing of process groups. Where tokens go to be computed is the dispatcher's job
(`LocalDispatcher` here: every expert is in the local bank; `megatron_rl.parallel.ep_dispatch`
sends tokens to the owners over an EP group). `elastic/` changes the EP group by handing every layer
a new dispatcher; the bank grows or shrinks as experts move.

Experts are keyed by their *global* index (`local_experts.<e>`), which is Megatron's SequentialMLP
naming at EP=1; a rank's bank simply holds a subset of the keys.

Two ways to compute, one result: with autograd on (training) each expert's two matmuls run on its
own parameters; without it (rollout) the bank runs one grouped GEMM per matmul (`torch._grouped_mm`,
as torchtitan's GroupedExperts) over a stacked copy of the weights. `_grouped_mm` equals the
per-expert `F.linear` bit for bit (tests/unit/test_moe_grouped.py); float64 has no CPU grouped GEMM,
so float64 keeps the per-expert loop, as do accelerators (see GROUPED_MM_DTYPES).
"""
from __future__ import annotations

import itertools
from typing import Iterable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from megatron_rl.models.config import MoEModelConfig

# Dtypes `torch._grouped_mm` takes on CPU (torch 2.13); float64 falls back to one matmul per expert.
# Only the CPU kernel is used and tested here: on CUDA it has other dtype, architecture and
# alignment rules, and GPU runs use megatron-core's grouped GEMM (megatron_backend.py) anyway.
GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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
        ex = Expert(self.hidden, self.ffn, self.dtype, fc1_2FD.device)
        with torch.no_grad():
            ex.linear_fc1.weight.copy_(fc1_2FD)
            ex.linear_fc2.weight.copy_(fc2_DF)
        self.local_experts[str(e)] = ex

    def drop(self, e: int) -> None:
        del self.local_experts[str(e)]
        # The stacked copy refers to the dropped weights: forget it, or their memory stays held.
        self._stacked_of = self._stacked_params = self._stacked = None

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The held experts' weights stacked in `held()` order, laid out for `_grouped_mm`:
        fc1 as [E, D, 2F] and fc2 as [E, F, D] (transposed views of [E, 2F, D] / [E, D, F]).

        A copy of the parameters (they stay the truth for training, checkpoints and expert moves),
        rebuilt when the held modules change or any weight is written: in-place writes (optimizer
        steps, weight sync, `copy_`) bump a tensor's version counter, which only grows, so the sum
        of the versions changes with any write. A parameter *object* swapped for another under the
        same expert module (`load_state_dict(assign=True)`) would go unnoticed; nothing in the
        project does that, expert moves replace whole modules. It costs a second copy of the local
        expert weights while a rollout runs.
        """
        modules = tuple(self.local_experts._modules.values())
        if getattr(self, "_stacked_of", None) != modules:
            self._stacked_of = modules
            held = [self.get(e) for e in self.held()]
            self._stacked_params = [ex.linear_fc1.weight for ex in held] + [ex.linear_fc2.weight for ex in held]
            self._stacked_version = -1
        version = sum(w._version for w in self._stacked_params)
        if self._stacked_version != version:
            n = len(self._stacked_params) // 2
            with torch.no_grad():
                fc1_E2FD = torch.stack(self._stacked_params[:n]) if n else torch.empty(0, 2 * self.ffn, self.hidden)
                fc2_EDF = torch.stack(self._stacked_params[n:]) if n else torch.empty(0, self.hidden, self.ffn)
            self._stacked = (fc1_E2FD.transpose(1, 2), fc2_EDF.transpose(1, 2))
            self._stacked_version = version
        return self._stacked

    def compute(self, x_TD: torch.Tensor, expert_T: torch.Tensor) -> torch.Tensor:
        """Run each token through its expert (SwiGLU): out = fc2(silu(gate) * up), [gate; up] = fc1(x).

        A token's result depends only on its own row and its expert's weights (row-wise matmuls),
        up to the BLAS kernel's blocking; see docs/rollout.md on batch invariance. One stable sort
        groups the tokens by expert (each expert's rows keep their order); the elementwise SwiGLU
        runs once over all rows, only the two matmuls are per expert (or one grouped GEMM each).
        """
        if x_TD.shape[0] == 0:
            return torch.empty_like(x_TD)
        order_T = torch.argsort(expert_T, stable=True)
        count = dict(enumerate(torch.bincount(expert_T).tolist()))
        held = self.held()
        missing = sorted(set(e for e, n in count.items() if n) - set(held))
        if missing:
            raise RuntimeError(f"experts {missing} routed to a rank that does not hold them (holds {held})")
        x_TD = x_TD.index_select(0, order_T)
        if not torch.is_grad_enabled() and x_TD.dtype in GROUPED_MM_DTYPES and x_TD.device.type == "cpu":
            # Group i is the i-th held expert's rows, offs[i-1]:offs[i]; unrouted experts are empty groups.
            offs_E = torch.tensor(list(itertools.accumulate(count.get(e, 0) for e in held)), dtype=torch.int32)
            fc1_ED2F, fc2_EFD = self.stacked()
            h_T2F = torch._grouped_mm(x_TD, fc1_ED2F, offs=offs_E)
            gate_TF, up_TF = h_T2F.chunk(2, dim=-1)
            y_TD = torch._grouped_mm(F.silu(gate_TF) * up_TF, fc2_EFD, offs=offs_E)
        else:
            sizes = [count[e] for e in held if count.get(e, 0)]
            experts = [self.get(e) for e in held if count.get(e, 0)]
            h_T2F = torch.cat([F.linear(x, ex.linear_fc1.weight) for x, ex in zip(torch.split(x_TD, sizes), experts)])
            gate_TF, up_TF = h_T2F.chunk(2, dim=-1)
            a_parts = torch.split(F.silu(gate_TF) * up_TF, sizes)
            y_TD = torch.cat([F.linear(a, ex.linear_fc2.weight) for a, ex in zip(a_parts, experts)])
        out_TD = torch.empty_like(y_TD)
        out_TD[order_T] = y_TD
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
        # The gating product itself in fp32 (inputs and weight upcast), as megatron-core's router
        # computes it with moe_router_dtype='fp32' (the megatron backend's setting). Rounded to
        # bf16 (HF rounds there), the logits flip top-k choices on weight changes of one Adam step
        # at lr 1e-3: the bf16 GRPO check then jumped 0.54 -> 0.99 in reward and raised its own
        # surrogate; with fp32 gating it ran like fp32 (docs/gpu.md).
        if widens(x_TD.dtype):
            logits_TE = F.linear(x_TD.float(), self.weight.float())
        else:
            logits_TE = F.linear(x_TD, self.weight)
        if self.pre_softmax:
            probs_TK, expert_TK = torch.topk(torch.softmax(logits_TE, dim=-1), self.topk, dim=-1)
        else:
            top_TK, expert_TK = torch.topk(logits_TE, self.topk, dim=-1)
            probs_TK = torch.softmax(top_TK, dim=-1)
        return (probs_TK.to(x_TD.dtype) if widens(x_TD.dtype) else probs_TK), expert_TK


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
        w_TKD = probs_TK[:, :, None] * out_TKD
        y_TD = w_TKD[:, 0]
        for k in range(1, w_TKD.shape[1]):
            y_TD = y_TD + w_TKD[:, k]
        return y_TD
