"""Decode tokens/s of the `megatron` MoE backend beside the `torch` backend, and its EP shrink latency.

The megatron backend runs once per expert module (`--expert-modules`, default: GroupedMM, our
torch._grouped_mm module, and megatron-core's SequentialMLP loop; TEGroupedMLP too where
TransformerEngine imports), so the table shows what the grouped module buys over the loop. With
$FF_GPU_RESULTS set (tools/gpu_check.sh) rank 0 records one row per run (tools/gpu_summary.py).

GPUs; run under torchrun, one rank per GPU (tools/gpu_check.sh does):
    torchrun --nproc-per-node=NGPU tools/bench_megatron_backend.py [--layers 4 ...]
In tools/gpu_check.sh's dry run (FF_GPU_DRYRUN=1) the same path runs on CPU over gloo at tiny shapes,
megatron-core's layers through the test harness (tests/megatron_harness.py); nothing is judged.

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
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic.planning.plan import Plan, Stage
from elastic.runtime.runtime import _move_experts
from megatron_rl.errors import ConfigError
from megatron_rl.models import MoEModelConfig, Qwen3MoeModel
from megatron_rl.models.ep_dispatch import AllToAllDispatcher
from megatron_rl.parallel.dims import parallel_dims
from megatron_rl.rollout.elastic_engines.megatron_engine import MegatronElasticEngine
from megatron_rl.rollout.engine import Request, RolloutEngine
from megatron_rl.rollout.sampling import SamplingParams
from tools.gpu_env import DRYRUN, dryrun_detail, sized
from tools.gpu_summary import record
from tools.tool_args import add_decode_args, add_model_args


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p, layers=4, hidden=2048, experts=128, topk=8, vocab=151936)
    p.add_argument("--ffn", type=int, default=768, help="an expert's hidden size")
    add_decode_args(p, batch=64, prompt_len=32, new_tokens=64)
    p.add_argument("--dispatcher", default="alltoall", choices=["alltoall", "flex", "allgather"])
    p.add_argument("--expert-modules", nargs="+", default=None,
                   help="megatron expert modules to time (default: GroupedMM SequentialMLP, plus "
                        "TEGroupedMLP where TransformerEngine imports)")
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


def requests_for(rank: int, vocab: int, a) -> list[Request]:
    gen = torch.Generator().manual_seed(1000 + rank)
    return [Request(f"r{rank}-{i}", 0, torch.randint(0, vocab, (a.prompt_len,), generator=gen).tolist(),
                    a.new_tokens, fixed_len=a.new_tokens) for i in range(a.batch)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_tokens_per_s(engine: RolloutEngine, device: torch.device) -> tuple[float, int]:
    """Greedy-decode on every rank in lockstep: (all ranks' tokens / wall time, this rank's
    decode steps), prefill excluded."""
    engine.step()  # prefill (and kernel warm-up), not counted
    _sync(device)
    dist.barrier()
    t0, tokens, steps = time.perf_counter(), 0, 0
    while engine.has_work():
        tokens += engine.step()
        steps += 1
    _sync(device)
    dist.barrier()
    elapsed = time.perf_counter() - t0
    total = torch.tensor([tokens], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return total.item() / elapsed, steps


def shrink_latency_s(elastic: MegatronElasticEngine, plan: Plan, rank: int, groups, device: torch.device) -> float:
    """Seconds from the shrink decision to every member running on the stage-1 group, done as the
    elastic runtime does it: expert moves, drops, then the switch (an MoE rebuild here)."""
    _sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    _move_experts(elastic, plan.transfers(0, 1), rank)
    for e in elastic.held_experts():
        if rank not in plan.stages[1].owners[e]:
            elastic.drop_expert(e)
    if rank in plan.stages[1].members:
        elastic.use_group(groups[1], {e: plan.stages[1].owner_of(e) for e in range(plan.num_experts)})
    _sync(device)
    dist.barrier()
    return time.perf_counter() - t0


def main() -> None:
    a = parse_args()
    if DRYRUN:  # the CPU dry run: megatron-core's layers on CPU through the test harness (tests only)
        from tests import megatron_harness

        megatron_harness.install()
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    mcfg = sized(model_config(a))
    E = mcfg.num_moe_experts
    try:
        dims = parallel_dims(world, E, "megatron", "the model's experts")
    except ConfigError as e:
        raise SystemExit(str(e)) from None
    members = list(range(max(1, world // 2)))
    stages = [Stage(tuple(range(world)), (), dims.block_owners(range(world))),
              Stage(tuple(members), tuple(range(len(members), world)), dims.block_owners(members))]
    plan = Plan(ranks=world, floor=len(members), num_experts=E, layout="natural", tailguard=False,
                assignments=[], stages=stages, ownership="blocks")
    if world > 1:  # one rank: stage 1 is stage 0 again (no strict shrink), timed as a rebuild alone
        plan.check()
    # Every group before any timing, as the elastic runtime pre-creates them.
    selves = [dist.new_group([r]) for r in range(world)]
    groups = [dist.new_group(list(range(world))), dist.new_group(members)]
    mine = [e for e in range(E) if stages[0].owner_of(e) == rank]
    say = print if rank == 0 else (lambda *_: None)
    say(f"model: {mcfg.num_layers} layers, {E} experts top-{mcfg.moe_router_topk}, hidden {mcfg.hidden_size}, "
        f"expert FFN {mcfg.moe_ffn_hidden_size}, bf16; EP over {world} GPU(s); {a.batch} requests/rank, "
        f"{a.new_tokens} new tokens each")
    max_len = a.prompt_len + a.new_tokens
    # The engine allocates its cache and inputs on the default device.
    with torch.device(device):
        torch_engine = RolloutEngine(build_model(mcfg, mine, device), SamplingParams(greedy=True), a.batch, max_len)
        if world > 1:
            torch_engine.model.set_dispatcher(AllToAllDispatcher(groups[0], [stages[0].owner_of(e) for e in range(E)]))
        torch_engine.add(requests_for(rank, mcfg.vocab_size, a))
        torch_tps, _steps = decode_tokens_per_s(torch_engine, device)
        del torch_engine
        torch.cuda.empty_cache()

        from megatron_rl.models.megatron_backend import transformer_engine

        modules = a.expert_modules or (["TEGroupedMLP"] if transformer_engine()[0] else []) + ["GroupedMM",
                                                                                            "SequentialMLP"]
        rates = {}
        for module in modules:
            t0 = time.perf_counter()
            engine = RolloutEngine(build_model(mcfg, mine, device), SamplingParams(greedy=True), a.batch, max_len)
            elastic = MegatronElasticEngine(engine, world, selves[rank], dispatcher=a.dispatcher,
                                            dtype=torch.bfloat16, expert_module=module, device=device.type)
            elastic.use_group(groups[0], {e: stages[0].owner_of(e) for e in range(E)})
            engine.add(requests_for(rank, mcfg.vocab_size, a))
            rates[module], steps = decode_tokens_per_s(engine, device)
            detail = (f"torch backend {torch_tps:,.0f}, megatron {module} {rates[module]:,.0f} tokens/s: "
                      f"{rates[module] / torch_tps:.2f}x of torch (measured, no target)")
            say(f"decode ({a.dispatcher}, all ranks): {detail}")
            if rank == 0:
                record(f"m: decode tokens/s, {module}", "pass", dryrun_detail(detail), time.perf_counter() - t0,
                       evidence={"decode steps timed": steps})
            if module != modules[-1]:
                del engine, elastic
                torch.cuda.empty_cache()
        if "GroupedMM" in rates and "SequentialMLP" in rates:
            say(f"GroupedMM / SequentialMLP: {rates['GroupedMM'] / rates['SequentialMLP']:.2f}x")

        shrink_s = shrink_latency_s(elastic, plan, rank, groups, device)
    what = (f"shrink {world} -> {len(members)} ranks (expert moves + MoE rebuild)" if world > 1
            else "MoE rebuild on a new 1-rank EP group (one GPU: no expert moves)")
    say(f"{what}: {shrink_s * 1e3:.1f} ms for {mcfg.num_layers} layers")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
