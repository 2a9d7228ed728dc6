"""`flexfloor simulate` as a user runs it."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import wandb_history, wandb_records

from elastic.sim.synth import generate, preset
from elastic.trace import write_trace

ROOT = Path(__file__).resolve().parents[2]
KEYS = {"policy", "floor", "tailguard", "objective", "ranks", "rollouts", "rollout_time_s", "rank_seconds",
        "response_tokens", "tokens_per_occupied_rank_s"}


def cli(*args, check=True, cwd=ROOT):
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "simulate", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=240, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("sim") / "dsr.jsonl"
    write_trace(generate(preset("deepscaler", prompts=16, samples=4, epochs=3, cap=4096), seed=1), path)
    return path


@pytest.mark.parametrize("policy", ["vanilla", "lengthsort", "natural", "planned", "oracle"])
def test_json_has_the_issue_keys_and_the_ledger_adds_up(trace, policy):
    out = json.loads(cli("--trace", str(trace), "--policy", policy, "--floor", "2", "--tailguard",
                         "--ranks", "8", "--json").stdout)
    assert KEYS <= set(out)
    assert out["policy"] == policy and out["ranks"] == 8 and out["rollouts"] == 2
    assert set(out["rank_seconds"]) == {"busy", "dummy", "transition", "leased", "idle"}
    assert sum(out["rank_seconds"].values()) == pytest.approx(8 * out["rollout_time_s"], rel=1e-9)
    assert out["rollout_time_s"] >= out["lower_bound_s"]


def test_objective_flag(trace):
    base = ["--trace", str(trace), "--policy", "planned", "--floor", "2", "--ranks", "8", "--json"]
    default = json.loads(cli(*base).stdout)
    latency = json.loads(cli(*base, "--objective", "rollout").stdout)
    assert default["objective"] == "occupied" and default["label"] == "planned floor2"
    assert latency["objective"] == "rollout" and latency["label"] == "planned floor2 [rollout]"
    proc = cli(*base, "--objective", "fastest", check=False)
    assert proc.returncode == 2 and "--objective" in proc.stderr


def test_compare_table_and_plots(trace, tmp_path):
    proc = cli("--trace", str(trace), "--ranks", "8", "--compare", "--plot", str(tmp_path / "plots"),
               "--wandb", "t", cwd=tmp_path)
    text = proc.stdout
    for label in ("vanilla", "lengthsort +TailGuard", "natural floor2", "planned floor4 +TailGuard",
                  "planned floor8"):
        assert f"| {label} |" in text
    assert "oracle s" in text and "lower bound s" in text and "shortening" in text
    for png in ("active_ranks.png", "ledger.png"):
        assert (tmp_path / "plots" / png).stat().st_size > 1000
    # --wandb: the table as a W&B table and the figures as images, offline under ./wandb
    run_file = next((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    (row,) = wandb_history(run_file)
    assert row["compare/_type"] == "table-file"
    assert row["plots/active_ranks/_type"] == row["plots/ledger/_type"] == "image-file"
    table = json.loads((run_file.parent / "files" / row["compare/path"]).read_text())
    assert table["columns"][0] == "label" and "elastic/rank_seconds/dummy" in table["columns"]
    labels = [r[0] for r in table["data"]]
    assert len(labels) == row["compare/nrows"] and {"vanilla", "planned floor4 +TailGuard"} <= set(labels)
    assert wandb_records(run_file, "run")[0].display_name == "simulate-8ranks"


def test_wandb_without_plot_still_gets_the_figures(trace, tmp_path):
    cli("--trace", str(trace), "--policy", "planned", "--floor", "2", "--ranks", "8", "--wandb", "t", cwd=tmp_path)
    run_file = next((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    (row,) = wandb_history(run_file)
    assert row["plots/ledger/_type"] == "image-file" and row["elastic/rank_seconds/dummy"] >= 0
    assert not (tmp_path / "plots").exists()


def test_wandb_names_the_run_from_the_resolved_config(trace, tmp_path):
    # No --ranks and no --policy: the run's name and tags come from the defaults that ran, not None.
    cli("--trace", str(trace), "--floor", "2", "--wandb", "t", cwd=tmp_path)
    run_file = next((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    run = wandb_records(run_file, "run")[0]
    assert run.display_name == "simulate-16ranks"
    assert not any("None" in t for t in run.tags), list(run.tags)


def test_migration_report_and_lease(trace):
    out = json.loads(cli("--trace", str(trace), "--policy", "planned", "--floor", "2", "--ranks", "8",
                         "--lease", "--migrate", "2", "--json").stdout)
    assert set(out["migration"]) >= {"migrated_responses", "rollout_time_saved_s", "dummy_rank_s_saved"}
    assert out["rank_seconds"]["idle"] + out["rank_seconds"]["leased"] == pytest.approx(out["detached_rank_s"])


@pytest.mark.parametrize("args,message", [
    (["--trace", "missing.jsonl"], "missing.jsonl"),
    (["--floor", "0"], "--floor"),
    (["--epochs", "0"], "--epochs"),
])
def test_user_mistakes_are_one_line_exit_2(trace, args, message):
    full = ["--trace", str(trace)] + args if args[0] != "--trace" else args
    proc = cli(*full, check=False)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_bad_cost_yaml_names_the_file(trace, tmp_path):
    bad = tmp_path / "cost.yaml"
    bad.write_text("step_overhead: 0.01\n")
    proc = cli("--trace", str(trace), "--cost", str(bad), check=False)
    assert proc.returncode == 2 and "cost.yaml" in proc.stderr and "step_overhead" in proc.stderr


def test_a_plan_that_cannot_fit_is_a_clear_error(tmp_path):
    # One prompt of ten million tokens: its KV cache alone exceeds any rank's memory.
    path = tmp_path / "huge.jsonl"
    path.write_text("".join(json.dumps({"prompt_id": "x", "epoch": e, "sample": 0, "prompt_len": 10_000_000,
                                        "response_len": 1000, "truncated": False}) + "\n" for e in (0, 1)))
    proc = cli("--trace", str(path), "--policy", "planned", "--ranks", "4", "--floor", "2", check=False)
    assert proc.returncode == 2 and proc.stderr.startswith("flexfloor simulate: error: planner:"), proc.stderr

