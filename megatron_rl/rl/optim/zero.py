"""ZeRO-1 for the torch backend: each rank keeps the optimizer state of its shard of the dense
parameters only, as megatron-core's DistributedOptimizer does; optionally that state lives on the
host and DeepSpeed's CPU Adam steps it (ZeRO-Offload's optimizer, without DeepSpeed's engine).

Layout (`optim.shard_optimizer`, on by default for more than one rank):
- the dense parameters (attention, norms, router, embeddings), in the model's order, are cut into
  `world` contiguous runs of whole parameters of about equal size; rank r *owns* run r;
- the optimizer's parameters ("masters") are the owned dense parameters and this rank's experts:
  fp32 copies under bf16 (rl/optim/mixed_precision.py's rule) or with offload, else the model's own
  parameters. AdamW's moments exist for them only, so dense state is 12 bytes per parameter
  divided by the world instead of 12 on every rank; experts keep living on their EP owner;
- gradients accumulate (fp32 under bf16) in two flat buffers, dense and experts, through
  post-accumulate-grad hooks. The dense buffer is laid out owner by owner, each owner's run padded
  to the same length, so one reduce-scatter hands every rank the summed gradients of its run;
- the global norm is the sum of per-parameter squared norms, summed in the model's order after
  one all-reduce of the per-parameter vector (each entry is non-zero on one rank only, so the sum
  is exact): the same float64 additions in the same order as the unsharded `clip_global_grad_norm`,
  hence bit-equal results (tests/distributed/test_zero.py);
- each rank steps its masters, copies them into its model parameters, and one all-gather of the
  dense runs in the model's dtype gives every rank every dense weight (the rollout's replicas).

`optim.offload: cpu` puts the masters, their gradients and the moments in host memory and steps them
with DeepSpeed's CPU Adam (rl/optim/cpu_adam.py): the summed gradients go to the host once per step, the
stepped masters come back to the device. Composes with sharding (each rank offloads its own shard).

Checkpoints key masters and moments by parameter name exactly as the unsharded optimizer does
(`master.<name>`, `optim.state.<name>.<exp_avg|exp_avg_sq|step>`), each written by its owner, so a
checkpoint saved on W ranks resumes on any rank count (`sharded_state`, `load_sharded_state`).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from megatron_rl.rl.optim.cpu_adam import adopted_form, prime_cpu_adam, saved_form
from megatron_rl.rl.optim.mixed_precision import MasterWeights, needs_masters


def owners(sizes: list[int], world: int) -> list[int]:
    """The owning rank of each of `sizes` (element counts, in order): contiguous runs of whole
    parameters, a parameter going to the rank whose equal share holds its middle element."""
    total, start, out = sum(sizes), 0, []
    for n in sizes:
        out.append(min(world - 1, (2 * start + n) * world // (2 * total)) if total else 0)
        start += n
    return out


class DenseLayout:
    """Where each dense parameter sits in the flat buffer the dense gradients are reduced in: owner
    r's run at [r * run, (r + 1) * run), parameter i at r * run + offset[i].

    The replicated optimizer's all-reduce (`train_step.allreduce_dense_grads`) is this layout's
    reduce-scatter followed by an all-gather (what a ring all-reduce does), so each element is
    summed over the ranks in the same order with and without ZeRO-1: gloo's all-reduce of another
    layout adds four ranks' values in an order that depends on the element's position."""

    def __init__(self, sizes: list[int], world: int):
        self.world, self.sizes = world, sizes
        self.owner = owners(sizes, world)
        per_owner = [0] * world
        self.offset = []
        for n, r in zip(sizes, self.owner):
            self.offset.append(per_owner[r])
            per_owner[r] += n
        self.run = max(per_owner) if per_owner else 0

    def start(self, i: int) -> int:
        return self.owner[i] * self.run + self.offset[i]

    def reduce_scatter(self, flat: torch.Tensor, group=None) -> torch.Tensor:
        """This rank's run of the sum over ranks of `flat` (world x run elements)."""
        if self.world == 1:
            return flat
        shard = torch.empty(self.run, dtype=flat.dtype, device=flat.device)
        _reduce_scatter(shard, flat, group=group)
        return shard

    def all_gather(self, shard: torch.Tensor, group=None) -> torch.Tensor:
        if self.world == 1:
            return shard
        flat = torch.empty(self.world * self.run, dtype=shard.dtype, device=shard.device)
        _all_gather(flat, shard.contiguous(), group=group)
        return flat


class ShardedOptimizer:
    """ZeRO-1 (and optional host offload) over `model`'s parameters; see the module docstring.

    Use: `zero_grad()`, backward passes, then `finish_step()` (reduce-scatter, clip, step,
    all-gather), which returns the global gradient norm before clipping."""

    def __init__(self, model: nn.Module, make_inner: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                 rank: int, world: int, grad_clip: float, *, offload: bool = False,
                 is_expert: Callable[[str], bool], group=None):
        self.rank, self.world, self.grad_clip, self.group, self.offload = rank, world, grad_clip, group, offload
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.dense = [(n, p) for n, p in named if not is_expert(n)]
        self.experts = [(n, p) for n, p in named if is_expert(n)]
        self.layout = DenseLayout([p.numel() for _, p in self.dense], world)
        self.owner, self.offset, self.run = self.layout.owner, self.layout.offset, self.layout.run
        self.device = named[0][1].device
        copies = offload or needs_masters(model)
        self.grad_dtype = torch.float32 if copies else named[0][1].dtype
        self.param_dtype = named[0][1].dtype
        self.owned = [(n, p) for (n, p), r in zip(self.dense, self.owner) if r == rank]
        mine = self.owned + self.experts
        if copies:
            master_device = torch.device("cpu") if offload else self.device
            self.masters = MasterWeights((n, p.to(master_device)) for n, p in mine)
            by_name = dict(self.masters.named_parameters())
            self.pairs = [(p, by_name[n]) for n, p in mine]
        else:  # fp32/fp64 without offload: the model's parameters are the masters
            self.masters, self.pairs = None, [(p, p) for _, p in mine]
        self.inner = make_inner([m for _, m in self.pairs])
        self._grad_dense = self._grad_expert = None
        self._touched: set[int] = set()  # parameters that received a gradient since zero_grad
        self._views = {}
        expert_offset = 0
        for i, (_, p) in enumerate(self.dense):
            self._views[p] = ("dense", self.layout.start(i))
        for _, p in self.experts:
            self._views[p] = ("expert", expert_offset)
            expert_offset += p.numel()
        self.expert_numel = expert_offset
        self._hooks = [p.register_post_accumulate_grad_hook(self._accumulate) for _, p in named]

    # ---- gradients ------------------------------------------------------------------------------
    def _buffer(self, kind: str) -> torch.Tensor:
        if kind == "dense":
            if self._grad_dense is None:
                self._grad_dense = torch.zeros(self.world * self.run, dtype=self.grad_dtype, device=self.device)
            return self._grad_dense
        if self._grad_expert is None:
            self._grad_expert = torch.zeros(self.expert_numel, dtype=self.grad_dtype, device=self.device)
        return self._grad_expert

    def _accumulate(self, p: torch.Tensor) -> None:
        kind, start = self._views[p]
        self._buffer(kind)[start : start + p.numel()].view_as(p).add_(p.grad)
        self._touched.add(id(p))
        p.grad = None

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradient buffers (the rollout's KV gets their memory)."""
        self.inner.zero_grad(set_to_none=True)
        self._grad_dense = self._grad_expert = None
        self._touched = set()

    def _shard_grads(self) -> None:
        """Reduce-scatter the dense buffer; every master's `.grad` becomes a view of its summed
        gradient (on the host under offload: one copy per buffer). As in the unsharded step, a
        parameter no backward reached has no gradient (AdamW then skips it), except that with
        more than one rank every dense parameter has one (the reduction zero-fills)."""
        shard = self.layout.reduce_scatter(self._buffer("dense"), self.group)
        expert = self._buffer("expert")
        if self.offload:
            shard, expert = shard.cpu(), expert.cpu()
        i = 0
        for (_, p), r, off in zip(self.dense, self.owner, self.offset):
            if r == self.rank:
                if self.world > 1 or id(p) in self._touched:
                    self.pairs[i][1].grad = shard[off : off + p.numel()].view_as(p)
                i += 1
        for _, p in self.experts:
            start = self._views[p][1]
            if id(p) in self._touched:
                self.pairs[i][1].grad = expert[start : start + p.numel()].view_as(p)
            i += 1
        self._grad_dense = self._grad_expert = None
        self._touched = set()

    def global_grad_norm(self) -> float:
        """sqrt(dense squared norm + every rank's experts'), added in the order the unsharded
        `clip_global_grad_norm` adds them (bit-equal in float64)."""
        masters = dict(zip((n for n, _ in self.owned + self.experts), (m for _, m in self.pairs)))
        device = self.pairs[0][1].device if self.pairs else torch.device("cpu")
        per_param = torch.zeros(len(self.dense), dtype=torch.float64, device=device)
        for i, (n, _) in enumerate(self.dense):
            if n in masters and masters[n].grad is not None:
                per_param[i] = masters[n].grad.double().pow(2).sum()
        expert_sq = torch.zeros((), dtype=torch.float64, device=device)
        for n, _ in self.experts:
            if masters[n].grad is not None:
                expert_sq += masters[n].grad.double().pow(2).sum()
        if self.world > 1:
            both = torch.cat([per_param, expert_sq[None]]).to(self.device)
            dist.all_reduce(both, group=self.group)
            per_param, expert_sq = both[:-1].to(device), both[-1].to(device)
        dense_sq = torch.zeros((), dtype=torch.float64, device=device)
        for sq in per_param:
            dense_sq += sq
        return math.sqrt(float(dense_sq + expert_sq))

    # ---- the step -------------------------------------------------------------------------------
    @torch.no_grad()
    def finish_step(self) -> float:
        """Reduce-scatter, global-norm clip, step this rank's masters, all-gather the dense weights.
        Returns the norm before clipping."""
        self._shard_grads()
        total = self.global_grad_norm()
        grads = [m for _, m in self.pairs if m.grad is not None]
        if self.grad_clip > 0 and grads:
            torch.nn.utils.clip_grads_with_norm_(grads, self.grad_clip, torch.tensor(total))
        self.inner.step()
        self.copy_to_model()
        return total

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Round every master into its model parameter, then all-gather the dense runs (after a
        step or a checkpoint load), so every rank holds every dense weight."""
        for p, m in self.pairs:
            if p is not m:
                p.copy_(m)
        if self.world == 1:
            return
        mine = torch.zeros(self.run, dtype=self.param_dtype, device=self.device)
        for (_, p), r, off in zip(self.dense, self.owner, self.offset):
            if r == self.rank:
                mine[off : off + p.numel()].copy_(p.reshape(-1))
        flat = self.layout.all_gather(mine, self.group)
        for (_, p), r, off in zip(self.dense, self.owner, self.offset):
            if r != self.rank:
                p.copy_(flat[r * self.run + off : r * self.run + off + p.numel()].view_as(p))

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ---- memory and checkpoints -----------------------------------------------------------------
    def device_state_bytes(self) -> int:
        """Optimizer bytes that stay on the device through the rollout: this rank's masters (when
        they are copies) and moments; none under offload."""
        if self.offload:
            return 0
        copies = 0 if self.masters is None else 1
        return sum((2 + copies) * m.numel() * m.element_size() for _, m in self.pairs)

    def sharded_state(self) -> dict:
        """This rank's masters and moments by parameter name (DCP writes each key once, from its
        owner; the keys are the unsharded optimizer's)."""
        names = [n for n, _ in self.owned + self.experts]
        state = {"optim": {"state": {n: saved_form(self.inner.state[m]) for n, (_, m) in zip(names, self.pairs)
                                     if self.inner.state.get(m)}}}
        if self.masters is not None:
            state["master"] = dict(self.masters.named_parameters())
        return state

    def load_request(self, saved_keys: set[str]) -> dict:
        """Tensors for DCP to load into, for the names this rank now owns: state saved on any rank
        count loads here. A parameter the checkpoint holds no moments for gets none."""
        names = [n for n, _ in self.owned + self.experts]
        state = {"optim": {"state": {}}}
        for n, (_, m) in zip(names, self.pairs):
            if f"optim.state.{n}.exp_avg" in saved_keys:
                state["optim"]["state"][n] = {"exp_avg": torch.zeros_like(m), "exp_avg_sq": torch.zeros_like(m),
                                              "step": torch.zeros((), dtype=torch.float32)}
        if self.masters is not None:
            state["master"] = dict(self.masters.named_parameters())
        return state

    def finish_load(self, state: dict) -> None:
        """Install the loaded moments and re-copy the masters into the model."""
        names = [n for n, _ in self.owned + self.experts]
        self.inner.state.clear()
        for n, (_, m) in zip(names, self.pairs):
            if n in state["optim"]["state"]:
                self.inner.state[m] = adopted_form(state["optim"]["state"][n], self.inner, m)
        steps = [int(s["step"]) for s in self.inner.state.values()]
        if steps and type(self.inner).__name__ == "DeepSpeedCPUAdam":
            prime_cpu_adam(self.inner, max(steps))
        self.copy_to_model()


# torch 2.13 renamed the flat-tensor collectives (the old names warn); the GPU image has 2.11.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
