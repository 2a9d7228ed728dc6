"""Decode tokens/s of the `megatron` MoE backend beside the `torch` backend, and its EP shrink latency.

GPUs only; run under torchrun, one rank per GPU (tools/gpu_check.sh does):
    torchrun --nproc-per-node=NGPU tools/bench_megatron_backend.py [--layers 4 ...]

Both backends run the same Qwen3-30B-A3B-shaped model (fewer layers by default, random bf16
weights, expert-parallel over all ranks) through the same rollout engine, one after the other in
this run, on the same requests: greedy decoding of `--batch` requests per rank for `--new-tokens`
steps. Then the megatron backend shrinks its EP group to the first half of the ranks: the leaving
ranks send their experts to the new block owners and the members rebuild their MoE layers over
the smaller, pre-created group. On one GPU there is nothing to move; the figure is the rebuild alone.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from megatron_rl.models import MoEModelConfig, Qwen3MoeModel
from megatron_rl.models.megatron_backend import (
    block_experts,
    install_megatron_moe,
    moe_pg_collection,
    rebuild_ep,
)
from megatron_rl.parallel.ep_dispatch import AllToAllDispatcher
from megatron_rl.rollout.engine import Request, RolloutEngine
from megatron_rl.rollout.sampling import SamplingParams


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4, help="MoE layers (Qwen3-30B-A3B has 48)")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--batch", type=int, default=64, help="requests per rank")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--dispatcher", default="alltoall", choices=["alltoall", "flex", "allgather"])
    p.add_argument("--no-grouped-gemm", action="store_true",
                   help="megatron-core's SequentialMLP experts instead of TransformerEngine's grouped GEMM")
    return p.parse_args()


def model_config(a) -> MoEModelConfig:
    return MoEModelConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=32, num_query_groups=4,
                          kv_channels=128, num_moe_experts=a.experts, moe_router_topk=a.topk,
                          moe_ffn_hidden_size=a.ffn, vocab_size=a.vocab)


def build_model(mcfg: MoEModelConfig, experts: list[int], device: torch.device) -> Qwen3MoeModel:
    with torch.device("cpu"):  # init_weights draws from CPU generators
        model = Qwen3MoeModel(mcfg, experts, torch.bfloat16)
        model.init_weights(0)
    return model.to(device).eval()


def decode_tokens_per_s(model: Qwen3MoeModel, a, rank: int, device: torch.device) -> float:
    """Greedy-decode the same requests on every rank in lockstep; all ranks' tokens / wall time."""
    gen = torch.Generator().manual_seed(1000 + rank)
    requests = [Request(f"r{rank}-{i}", 0, torch.randint(0, a.vocab, (a.prompt_len,), generator=gen).tolist(),
                        a.new_tokens, fixed_len=a.new_tokens) for i in range(a.batch)]
    with torch.device(device):  # the engine allocates its cache and inputs on the default device
        engine = RolloutEngine(model, SamplingParams(greedy=True), a.batch, a.prompt_len + a.new_tokens)
        engine.add(requests)
        engine.step()  # prefill (and kernel warm-up), not counted
        torch.cuda.synchronize()
        dist.barrier()
        t0, tokens = time.perf_counter(), 0
        while engine.has_work():
            tokens += engine.step()
        torch.cuda.synchronize()
        dist.barrier()
        elapsed = time.perf_counter() - t0
    total = torch.tensor([tokens], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return total.item() / elapsed


def flat_expert(model: Qwen3MoeModel, e: int) -> torch.Tensor:
    parts = []
    for moe in model.moe_layers:
        fc1, fc2 = moe.expert_weights()[e]
        parts += [fc1.reshape(-1), fc2.reshape(-1)]
    return torch.cat(parts)


def shrink_latency_s(model: Qwen3MoeModel, mcfg: MoEModelConfig, rank: int, world: int, selves, device) -> float:
    """Seconds from the shrink decision to every member running on the half-size EP group."""
    members = list(range(max(1, world // 2)))
    half = dist.new_group(members)  # created before timing, as the runtime pre-creates its groups
    fc1_n, fc2_n = 2 * mcfg.moe_ffn_hidden_size * mcfg.hidden_size, mcfg.hidden_size * mcfg.moe_ffn_hidden_size
    old_per, new_per = mcfg.num_moe_experts // world, mcfg.num_moe_experts // len(members)
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    ops, incoming = [], {}
    for e in range(mcfg.num_moe_experts):
        src, dst = e // old_per, e // new_per
        if src == dst:
            continue
        if rank == src:
            ops.append(dist.P2POp(dist.isend, flat_expert(model, e).contiguous(), dst))
        elif rank == dst:
            incoming[e] = torch.empty(mcfg.num_layers * (fc1_n + fc2_n), dtype=torch.bfloat16, device=device)
            ops.append(dist.P2POp(dist.irecv, incoming[e], src))
    for req in dist.batch_isend_irecv(ops) if ops else []:
        req.wait()
    if rank in members:
        per_layer = {}
        for e, flat in incoming.items():
            chunks = flat.split([fc1_n, fc2_n] * mcfg.num_layers)
            per_layer[e] = [(chunks[2 * i].view(2 * mcfg.moe_ffn_hidden_size, mcfg.hidden_size),
                             chunks[2 * i + 1].view(mcfg.hidden_size, mcfg.moe_ffn_hidden_size))
                            for i in range(mcfg.num_layers)]
        rebuild_ep(model, moe_pg_collection(half, selves[rank]), per_layer)
        assert model.moe_layers[0].local_experts == block_experts(mcfg.num_moe_experts, len(members), rank)
    torch.cuda.synchronize()
    dist.barrier()
    return time.perf_counter() - t0


def main() -> None:
    a = parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    mcfg = model_config(a)
    if mcfg.num_moe_experts % world:
        raise SystemExit(f"{mcfg.num_moe_experts} experts do not divide over {world} ranks")
    selves = [dist.new_group([r]) for r in range(world)]
    full = dist.new_group(list(range(world)))
    mine = block_experts(mcfg.num_moe_experts, world, rank)
    say = print if rank == 0 else (lambda *_: None)
    say(f"model: {mcfg.num_layers} layers, {mcfg.num_moe_experts} experts top-{mcfg.moe_router_topk}, hidden "
        f"{mcfg.hidden_size}, expert FFN {mcfg.moe_ffn_hidden_size}, bf16; EP over {world} GPU(s); "
        f"{a.batch} requests/rank, {a.new_tokens} new tokens each")

    torch_model = build_model(mcfg, mine, device)
    if world > 1:
        with torch.device(device):
            torch_model.set_dispatcher(AllToAllDispatcher(full, [e // len(mine) for e in range(mcfg.num_moe_experts)]))
    torch_tps = decode_tokens_per_s(torch_model, a, rank, device)
    del torch_model
    torch.cuda.empty_cache()

    megatron_model = build_model(mcfg, mine, device)
    install_megatron_moe(megatron_model, moe_pg_collection(full, selves[rank]), dispatcher=a.dispatcher,
                         dtype=torch.bfloat16, grouped_gemm=not a.no_grouped_gemm, device="cuda")
    megatron_tps = decode_tokens_per_s(megatron_model, a, rank, device)
    experts = "SequentialMLP" if a.no_grouped_gemm else "TE grouped GEMM"
    say(f"decode tokens/s (all ranks): torch backend {torch_tps:,.0f}, megatron backend ({a.dispatcher}, {experts}) "
        f"{megatron_tps:,.0f}; megatron/torch {megatron_tps / torch_tps:.2f}x")

    shrink_s = shrink_latency_s(megatron_model, mcfg, rank, world, selves, device)
    what = (f"shrink {world} -> {max(1, world // 2)} ranks (expert moves + MoE rebuild)" if world > 1
            else "MoE rebuild on a new 1-rank EP group (one GPU: no expert moves)")
    say(f"{what}: {shrink_s * 1e3:.1f} ms for {mcfg.num_layers} layers")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
