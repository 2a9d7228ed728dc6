"""`flexfloor rollout`: one rollout on W ranks (its flags: megatron_rl/cli/rollout.py), the report
printed and written where the flags ask, its timeline drawn and logged to W&B."""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from elastic.ledger import format_report
from elastic.planning.policies import policy_kind
from elastic.timeline import Timeline
from elastic.timeline_plot import plot_timelines
from megatron_rl.cli.rollout import FLAGS
from megatron_rl.commands.outputs import check_out_dir, check_out_file, check_plot_dir
from megatron_rl.commands.resolve import resolve
from megatron_rl.config import config_yaml, write_config
from megatron_rl.files.out_lock import hold_out_dir
from megatron_rl.metrics.keys import grouped, numeric
from megatron_rl.metrics.wandb_run import LoggingConfig, log_report, policy_tags
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout_runner import run_rollout


def resolve_rollout(args, pinned: dict | None = None):
    """The rollout config: file, flags, `key=value` overrides; `pinned` ({key: (value, label)}) is
    what a command fixes (demo's two policies)."""
    extra = {"sampling.greedy": (False, "--sample")} if getattr(args, "sample", False) else {}
    extra.update(pinned or {})
    return resolve(RolloutConfig, args.config, args, FLAGS, world_size_key="ranks", extra=extra)


def run(args) -> int:
    cfg = resolve_rollout(args)
    if args.print_config:
        print(config_yaml(cfg), end="")
        return 0
    out_dir = args.out
    check_out_dir(out_dir, "--out")
    check_out_file(args.json, "--json")
    check_plot_dir(args.plot)
    with hold_out_dir(out_dir, "rollout"):
        return _rollout(args, cfg, out_dir)


def _rollout(args, cfg, out_dir) -> int:
    if out_dir is not None:
        write_config(cfg, out_dir)
    t0 = time.perf_counter()
    result = run_rollout(cfg, out_dir, quiet=args.quiet)
    if result is None:  # a non-zero rank under torchrun
        return 0
    report, responses = result.report, result.responses
    print(format_report(report))
    for rank, freed in sorted(report["freed_bytes"].items(), key=lambda kv: int(kv[0])):
        print(f"detached rank {rank} freed {sum(freed.values()) / 2**20:.2f} MiB for leases "
              f"(KV cache {freed['kv_cache'] / 2**20:.2f} MiB, experts {freed['experts'] / 2**20:.2f} MiB)")
    if len(report["stages"]) > 1:
        print(f"policy {report['policy']}, floor {report['floor']}: stages "
              f"{' -> '.join(str(len(s)) for s in report['stages'])} ranks, reached stage "
              f"{report['final_stage']}; shrink latency per stage (s): {report['shrink_latency_s']}")
    if report.get("migrated"):
        print(f"{report['migrated']} live requests moved with their KV cache (online rule)")
    if report["kv"]["cache"] == "paged":
        kv = report["kv"]
        print(f"paged KV cache: prefill computed {kv['prefill_tokens_computed']} of {kv['prefill_tokens_requested']} "
              f"tokens (group prefix sharing), {kv['pages_shared']} pages shared, {kv['preemptions']} preemptions")
    if report.get("partial"):
        p = report["partial"]
        print(f"partial rollout ({p['rule']}): ended with {p['groups_complete']} of {p['groups']} groups "
              f"complete (target {p['target_groups']}); {p['carried']} responses would carry over "
              f"({p['carried_tokens']} tokens so far)")
    print(f"responses_sha256 {report['responses_sha256']} ({report['responses']} responses, "
          f"{time.perf_counter() - t0:.1f}s total)")
    if out_dir is not None:
        with open(Path(out_dir) / "responses.jsonl", "w", encoding="utf-8") as fh:
            for r in sorted(responses, key=lambda r: (r["prompt_id"], r["sample"])):
                fh.write(json.dumps(r) + "\n")
        (Path(out_dir) / "report.json").write_text(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    plot = write_timeline(report, Path(args.plot) / "timeline.png", rollout_title(report)) if args.plot else None
    if args.wandb:
        log_rollout_wandb(args, cfg, report, plot)
    sys.stdout.flush()
    return 0


def rollout_title(report: dict) -> str:
    """A timeline's title: the policy, and the floor and TailGuard of a shrinking one."""
    if len(report["stages"]) == 1 and not policy_kind(report["policy"]).uses_planner:
        return report["policy"]
    return f"{report['policy']} floor {report['floor']}" + (" + TailGuard" if report["tailguard"] else "")


def write_timeline(report: dict, path: Path, title: str) -> Path:
    """The rollout's per-rank timeline as a PNG (elastic/timeline_plot.py); says where on stderr."""
    out = plot_timelines([Timeline.of_report(report, title)], path)
    print(f"wrote {out}", file=sys.stderr)
    return out


def log_rollout_wandb(args, cfg, report: dict, plot: Path | None = None) -> None:
    """The report as one offline (unless WANDB_MODE=online) W&B run under --out (or `.`): its
    numbers, the timeline's segments as a table, and the timeline figure when --plot drew one."""
    logging = LoggingConfig(project=args.wandb, experiment=Path(args.config).stem if args.config else "rollout")
    metrics = numeric(grouped({k: v for k, v in report.items() if k != "per_rank"}))
    timeline = Timeline.of_report(report)
    folder = log_report(args.out or ".", logging, job_type="rollout", config=asdict(cfg),
                        tags=policy_tags(report["policy"], report["floor"]), metrics=metrics,
                        tables={"timeline": (timeline.columns(), timeline.rows())},
                        images=[plot] if plot is not None else None)
    if folder is not None:
        print(f"wandb: {folder}", file=sys.stderr)


