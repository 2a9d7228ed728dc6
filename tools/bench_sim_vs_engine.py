"""Does the simulator replay the real engine? Calibrate the cost model on the CPU engine's measured
step times, then compare its predicted ledger with real 4-rank rollouts of the same plan.

    python tools/bench_sim_vs_engine.py [--ranks 4] [--floor 2] [--policies vanilla,planned]
        [--save DIR | --reuse DIR]

`--save DIR` keeps the probe samples and every real run's ledger and plan; `--reuse DIR` replays
them instead of measuring again (the real runs are the expensive part; the model is not).

1. Probe, in every round: in a world of W gloo ranks, EP groups of every size W..1 run the real
   model and `RolloutEngine` on batches of b requests at context c held by k of the g members (the
   others run dummy steps, as drained members do), with the runtime's status all-reduce after
   every step; the slowest member's mean step time is one `(b, c, g, seconds, k)` sample.
   `elastic.sim.step_fit.calibrate` fits a cost model with the tiny model's shape: overhead, compute
   rates, the effective cores the ranks share and one all-to-all latency per group size. Then
   `ElasticRuntime` carries out plans of the chains W -> ... -> floor, W -> floor and W -> 1 on a
   small batch: the measured shrinks and restores fit the transition costs (`calibrate_transitions`).
2. Real runs, in the same round and world of ranks: the rollout `flexfloor rollout --ranks W
   --policy P --floor F` runs (`megatron_rl.rollout_runner`: plan, engine, `ElasticRuntime`, ledger)
   on the built-in tiny CPU example (a DeepScaleR-like trace replay, lengths scaled for CPU), every
   policy once per round in a rotating order. One world for probes and runs: rollouts started as
   separate `flexfloor rollout` processes measured 6-19% slower per step than probes taken in
   their own world minutes apart, and the fit below carried that bias into the prediction.
3. Fit: the probed model's step is scaled by one factor (`elastic.sim.calibrate.fit_to_ledgers`,
   `WHOLE_STEP`) to the median ledgers of the static policies (vanilla, lengthsort): this shared
   2-core machine's speed drifts with other load, and the probes are not the runs. One factor, not
   one per part: the static runs have a single group size, which cannot tell the per-step overhead
   from the all-to-all (`--fit per-part` shows what that fit extrapolates to smaller groups).
4. Replay: the same plan (DIR/plan.json) and batch through `elastic.sim.simulate`; the ledger is compared
   state by state with the median of the real runs (the simulator's claim: within 15% per state). `planned`,
   which shrinks, is a prediction: nothing of its runs went into the model.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elastic.ledger import STATES  # noqa: E402
from elastic.planning.plan import Plan  # noqa: E402
from elastic.sim.calibrate import PER_PART, WHOLE_STEP, fit_to_ledgers  # noqa: E402
from elastic.sim.costmodel import CostModel  # noqa: E402
from elastic.sim.simulate import SimConfig, simulate_rollout  # noqa: E402
from elastic.sim.step_fit import calibrate, calibrate_transitions, fit_error  # noqa: E402
from elastic.trace import TraceRecord  # noqa: E402
from megatron_rl.models.config import MoEModelConfig  # noqa: E402
from megatron_rl.rollout.config import RolloutConfig  # noqa: E402

TOLERANCE = 0.15
# A state below this share of the real run's rank-time is reported but not judged: a relative error
# on a few hundredths of a second measures timer noise, not the model.
JUDGED_SHARE = 0.02


def tiny_cost(m: MoEModelConfig, dtype_bytes: int, ranks_per_node: int, host_cores: int) -> CostModel:
    """A cost model with the CPU model's shape; its rates are what `calibrate` fits."""
    import torch

    from megatron_rl.rollout.memory import memory_budget

    budget = memory_budget(m, dtype_bytes, torch.device("cpu"), ranks_per_node)
    return CostModel(name="cpu-tiny", shape=m.shape(dtype_bytes, budget, ranks_per_node), host_cores=host_cores)


def _probe_model(ctx, mcfg: MoEModelConfig, owners: dict[int, int], seed: int):
    import torch

    from megatron_rl.models.qwen3_moe import Qwen3MoeModel

    model = Qwen3MoeModel(mcfg, [e for e, r in owners.items() if r == ctx.rank], torch.float64)
    model.init_weights(seed)
    model.eval()
    return model


def _probe_steps(ctx, mcfg: MoEModelConfig, sizes, points, steps: int, seed: int):
    """The mean step time of decode batches in an EP group of each size g (ranks 0..g-1; the others
    wait, as detached ranks do), with k of the g members holding b requests of context c and the
    rest running dummy steps, as drained members do. Each step is followed by the runtime's status
    all-reduce (every tick, `status_interval` 1). Rank 0 returns `(b, c, g, seconds, k)` samples."""
    import torch
    import torch.distributed as dist

    from elastic.planning.chains.schedule import contiguous_owners
    from megatron_rl.rollout.elastic_engines.torch_engine import ElasticRolloutEngine
    from megatron_rl.rollout.engine import Request, RolloutEngine
    from megatron_rl.rollout.sampling import SamplingParams

    groups = {g: dist.group.WORLD if g == ctx.world else dist.new_group(list(range(g))) for g in sizes}
    out = []
    for g in sizes:
        if ctx.rank < g:
            owners = {e: rs[0] for e, rs in contiguous_owners(mcfg.num_moe_experts, range(g)).items()}
            model = _probe_model(ctx, mcfg, owners, seed)
            for batch, context, busy in points(g):
                engine = RolloutEngine(model, SamplingParams(), batch, context + steps + 4)
                ElasticRolloutEngine(engine, g).use_group(groups[g], owners)
                gen = torch.Generator().manual_seed(seed + batch + context)
                if ctx.rank < busy:
                    engine.add([Request(f"q{i}", 0, torch.randint(0, mcfg.vocab_size, (context,), generator=gen)
                                        .tolist(), steps + 2, fixed_len=steps + 2) for i in range(batch)])
                engine.step()  # prefill (a dummy step on the members without requests)
                status = torch.zeros(g, dtype=torch.long)
                dist.barrier(group=groups[g])
                t0 = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                    dist.all_reduce(status, group=groups[g])
                took = torch.tensor([(time.perf_counter() - t0) / steps], dtype=torch.float64)
                dist.all_reduce(took, op=dist.ReduceOp.MAX, group=groups[g])
                # During the timed steps the KV holds the prompt, the prefill's token and the decoded ones.
                out.append((batch, context + 1 + steps / 2, g, float(took), busy))
        dist.barrier()
    return out


def _probe_shrinks(ctx, mcfg: MoEModelConfig, chains, seed: int):
    """Real shrinks and restores: `ElasticRuntime` carries out a plan of each chain of group sizes
    on a small batch in which the leaving ranks drain first. Rank 0 returns, per shrink, `(moves,
    seconds)` and per restore `(moves, seconds)` (seconds: the slowest rank's)."""
    import torch
    import torch.distributed as dist

    from elastic.planning.chains.schedule import build_stages
    from elastic.planning.plan import Assignment
    from elastic.runtime.runtime import ElasticRuntime
    from megatron_rl.rollout.elastic_engines.torch_engine import ElasticRolloutEngine
    from megatron_rl.rollout.engine import Request, RolloutEngine
    from megatron_rl.rollout.sampling import SamplingParams

    E, W = mcfg.num_moe_experts, ctx.world
    shrinks, restores = [], []
    for sizes in chains:
        stages = build_stages(list(sizes), E)
        # A rank's responses end 6 ticks after the stage it leaves in starts; the last stage's
        # members decode 6 ticks more.
        stop = {r: 6 * (1 + sum(r < g for g in sizes[1:])) for r in range(W)}
        plan = Plan(W, sizes[-1], E, "probe", False, [Assignment(f"p{r}", 0, r) for r in range(W)], stages)
        owners = {e: rs[0] for e, rs in stages[0].owners.items()}
        engine = RolloutEngine(_probe_model(ctx, mcfg, owners, seed), SamplingParams(), 2, 8 + max(stop.values()))
        engine.add([Request(f"p{ctx.rank}-{i}", 0, list(range(1, 9)), stop[ctx.rank], fixed_len=stop[ctx.rank])
                    for i in range(2)])
        outcome = ElasticRuntime(ElasticRolloutEngine(engine, W), plan, ctx.rank, ctx.store).run()
        secs = torch.zeros(len(sizes), dtype=torch.float64)
        for st, v in outcome.shrink_s.items():
            secs[st - 1] = v
        secs[-1] = outcome.restore_s
        dist.all_reduce(secs, op=dist.ReduceOp.MAX)
        shrinks += [(plan.transfers(i, i + 1), float(secs[i])) for i in range(len(sizes) - 1)]
        restores.append((plan.transfers(len(sizes) - 1, 0), float(secs[-1])))
    return shrinks, restores


def probe_points(g: int) -> list[tuple[int, int, int]]:
    """(requests per busy member, context, busy members): every batch shape with all members busy,
    and two with fewer (drained members run dummy steps)."""
    full = [(b, c, g) for b in (1, 4, 16) for c in (8, 160, 320)]
    return full + [(b, c, k) for b, c in ((4, 160), (16, 320)) for k in range(1, g)]


def _round(ctx, mcfg: MoEModelConfig, sizes, steps: int, seed: int, chains, jobs):
    """One round in one world of ranks: the probes, then every job's rollout (what `flexfloor
    rollout` runs). Rank 0 returns `((samples, shrinks, restores), reports)`."""
    from megatron_rl.rollout_runner import rank_jobs

    samples = _probe_steps(ctx, mcfg, sizes, probe_points, steps, seed)
    shrinks, restores = _probe_shrinks(ctx, mcfg, chains, seed)
    done = rank_jobs(ctx, jobs, True)
    return ((samples, shrinks, restores), [d.report for d in done]) if ctx.rank == 0 else None


def measure_round(cfgs: list[RolloutConfig], floor: int, steps: int, out_dirs: list[str | None]):
    """Probe step times of every group size and the shrinks and restores of the chains
    W -> W-1 -> ... -> floor, W -> floor and W -> 1, then run the rollouts of `cfgs`, all in one
    world: the probes and the runs share the processes and the moment they are measured in.
    Returns (probe, reports, plans); with an out dir, each run leaves plan.json and ledger.json."""
    from megatron_rl.parallel.launch import run_ranks
    from megatron_rl.rollout_runner import prepare

    world, mcfg = cfgs[0].ranks, cfgs[0].model
    sizes = list(range(world, 0, -1))
    # One chain that moves more experts per rank than the others, so that the fixed cost of a shrink
    # and the cost per expert moved can be told apart.
    chains = [c for c in dict.fromkeys([tuple(range(world, floor - 1, -1)), (world, floor), (world, 1)]) if len(c) > 1]
    jobs = [prepare(c, d) for c, d in zip(cfgs, out_dirs)]
    probe, reports = run_ranks(_round, world, mcfg, sizes, steps, cfgs[0].seed, chains, jobs,
                               timeout_s=sum(c.timeout_s for c in cfgs) + 600.0)
    for report, d in zip(reports, out_dirs):
        if d is not None:
            (Path(d) / "ledger.json").write_text(json.dumps(report))
    return probe, reports, [j.plan for j in jobs]


def load_run(out: Path) -> tuple[dict, Plan]:
    """A run kept by --save: its report (ledger.json) and plan."""
    report = json.loads((out / "ledger.json").read_text())
    return report, Plan.from_dict(json.loads((out / "plan.json").read_text()))


def replay_batch(cfg: RolloutConfig) -> list[TraceRecord]:
    """The batch the engine ran, with the lengths it actually generated (scaled for CPU)."""
    from megatron_rl.rollout.batch import load_trace, scaled_len, select_epoch

    batch, _ = select_epoch(load_trace(cfg.batch, cfg.seed), cfg.batch.epoch)
    return [TraceRecord(r.prompt_id, r.epoch, r.sample,
                        min(cfg.batch.max_prompt_len, scaled_len(r.prompt_len, cfg.batch.length_scale)),
                        scaled_len(r.response_len, cfg.batch.length_scale)) for r in batch]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--floor", type=int, default=2)
    ap.add_argument("--policies", default="vanilla,lengthsort,planned")
    ap.add_argument("--fit-on", default="vanilla,lengthsort",
                    help="policies whose measured ledgers fit the model (the rest are predictions; '' for none)")
    ap.add_argument("--fit", choices=("whole-step", "per-part"), default="whole-step",
                    help="one factor for the whole step (default), or one each for overhead, compute and "
                         "all-to-all (ill-conditioned on runs of one group size: see elastic/sim/calibrate.py)")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps per probe point")
    ap.add_argument("--repeats", type=int, default=3, help="probes and real runs per policy (the median is compared)")
    keep = ap.add_mutually_exclusive_group()
    keep.add_argument("--save", type=Path, help="keep the probe samples and the real runs' outputs here")
    keep.add_argument("--reuse", type=Path, help="replay the probes and real runs kept by --save in this folder")
    args = ap.parse_args(argv)
    cfg = RolloutConfig(ranks=args.ranks)
    mcfg = cfg.model
    # All ranks share this host's cores (the launcher gives each rank one thread).
    base = tiny_cost(mcfg, 8 if cfg.dtype == "float64" else 4, ranks_per_node=args.ranks,
                     host_cores=os.cpu_count() or 1)
    batch = replay_batch(cfg)
    sim_cfg = SimConfig(check_every=cfg.status_interval)
    policies = args.policies.split(",")
    runs: dict[str, list[dict]] = {p: [] for p in policies}
    plans: dict[str, Plan] = {}
    samples, shrinks, restores = [], [], []
    # Interleaved repeats of the probe and of every policy: this shared machine's speed drifts, so
    # every policy and the probes see the same drift.
    if args.reuse:
        args.repeats = len(list(args.reuse.glob("probe*.json")))
        if not args.repeats:
            raise SystemExit(f"--reuse {args.reuse}: no probe*.json there (write them with --save)")
    for rep in range(args.repeats):
        t1 = time.perf_counter()
        # Each round in another order, so that no policy always runs right after the probes.
        order = policies[rep % len(policies):] + policies[:rep % len(policies)]
        if args.reuse:
            probe = json.loads((args.reuse / f"probe{rep}.json").read_text())
            done = [load_run(args.reuse / p / str(rep)) for p in order]
        else:
            dirs = [str(args.save / p / str(rep)) if args.save else None for p in order]
            cfgs = [RolloutConfig(ranks=args.ranks, policy=p, floor=args.floor) for p in order]
            probe, reports, round_plans = measure_round(cfgs, args.floor, args.steps, dirs)
            done = list(zip(reports, round_plans))
        if args.save:
            (args.save / f"probe{rep}.json").write_text(json.dumps(probe))
        samples += [tuple(s) for s in probe[0]]
        shrinks += [([tuple(m) for m in moves], secs) for moves, secs in probe[1]]
        restores += [([tuple(m) for m in moves], secs) for moves, secs in probe[2]]
        for policy, (report, plan) in zip(order, done):
            runs[policy].append(report)
            plans[policy] = plan
        walls = ", ".join(f"{p} {report['rollout_time_s']:.2f} s" for p, (report, _plan) in zip(order, done))
        print(f"round {rep + 1}/{args.repeats}{' (reused)' if args.reuse else ''}: {len(probe[0])} step times "
              f"of groups of {args.ranks}..1, {len(probe[1])} shrinks, {len(probe[2])} restores; rollouts "
              f"{walls} ({time.perf_counter() - t1:.0f} s)", flush=True)
    cost = calibrate_transitions(shrinks, restores, calibrate(samples, base))
    print(f"calibrated: overhead {cost.step_overhead_s * 1e3:.2f} ms, all-to-all per layer "
          f"{', '.join(f'{s * 1e3:.2f} ms at {g}' for g, s in cost.a2a_host_latency_s)}, "
          f"{cost.hbm_bytes_per_s / 1e9:.3g} GB/s, {cost.flops_per_s / 1e9:.3g} GFLOP/s, {cost.host_cores:g} "
          f"effective cores; mean step-time error {fit_error(cost, samples):.1%}; "
          f"shrink {cost.shrink_fixed_s * 1e3:.1f} ms + "
          f"{cost.shape.expert_bytes / cost.transfer_intra_bytes_per_s * 1e3:.2f} ms per expert, restore "
          f"+{cost.restore_extra_s * 1e3:.1f} ms")
    real = {p: {s: float(np.median([r["rank_seconds"][s] for r in runs[p]])) for s in STATES} for p in policies}
    wall = {p: float(np.median([r["rollout_time_s"] for r in runs[p]])) for p in policies}
    fit_on = [p for p in args.fit_on.split(",") if p in policies]
    if fit_on:
        groups = WHOLE_STEP if args.fit == "whole-step" else PER_PART
        cost, factors = fit_to_ledgers([(plans[p], batch, real[p]) for p in fit_on], cost, sim_cfg, groups)
        print(f"fitted the probed model's step times by "
              f"{', '.join(f'{k} x{v:.2f}' for k, v in factors.items())} to the median ledgers of "
              f"{', '.join(fit_on)}; {', '.join(p for p in policies if p not in fit_on) or 'nothing'} predicted")
    failures, noisy = 0, False
    for policy in policies:
        plan = plans[policy]
        sim = simulate_rollout(plan, batch, cost, config=sim_cfg)
        got, ref = sim.ledger.rank_seconds(), real[policy]
        total = sum(ref.values())
        walls = [r["rollout_time_s"] for r in runs[policy]]
        spread = max(walls) / min(walls) - 1
        noisy |= spread > TOLERANCE
        print(f"\n{policy} (stages {' -> '.join(str(len(s.members)) for s in plan.stages)}): rollout "
              f"{wall[policy]:.2f} s real (median of {len(walls)}, run-to-run spread {spread:.0%}) vs "
              f"{sim.ledger.wall_s:.2f} s simulated ({sim.ledger.wall_s / wall[policy] - 1:+.1%}); ticks "
              f"{runs[policy][0]['rollout_steps']} vs {sim.ledger.total_steps}")
        print(f"{'state':<11}{'real rank-s':>12}{'sim rank-s':>12}{'error':>9}  verdict")
        for s in STATES:
            err = (got[s] - ref[s]) / ref[s] if ref[s] > 0 else (0.0 if got[s] == 0 else float("inf"))
            judged = ref[s] >= JUDGED_SHARE * total or got[s] >= JUDGED_SHARE * total
            ok = abs(err) <= TOLERANCE
            verdict = ("ok" if ok else "OFF") if judged else "(not judged: < 2% of rank-time)"
            failures += judged and not ok
            print(f"{s:<11}{ref[s]:>12.3f}{got[s]:>12.3f}{err:>+9.1%}  {verdict}")
    print(f"\n{'every judged state within' if not failures else f'{failures} judged state(s) outside'} "
          f"{TOLERANCE:.0%} of the real runs' median")
    if noisy:
        print(f"note: the real runs themselves differ by more than {TOLERANCE:.0%} from run to run on this "
              "machine; the comparison is only as good as that noise floor")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
