"""`flexfloor simulate` as a user runs it."""
import json
from functools import partial

import pytest
from conftest import wandb_history, wandb_records

from tests.helpers.cli import cli
from tests.helpers.traces import small_deepscaler, written

KEYS = {"policy", "floor", "tailguard", "objective", "ranks", "rollouts", "rollout_time_s", "rank_seconds",
        "response_tokens", "tokens_per_occupied_rank_s"}


simulate = partial(cli, "simulate", expect=0)


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    return written(small_deepscaler(), tmp_path_factory.mktemp("sim") / "dsr.jsonl")


@pytest.mark.parametrize("policy", ["vanilla", "lengthsort", "natural", "planned", "oracle"])
def test_json_has_the_issue_keys_and_the_ledger_adds_up(trace, policy):
    out = json.loads(simulate("--trace", str(trace), "--policy", policy, "--floor", "2", "--tailguard",
                         "--ranks", "8", "--json").stdout)
    assert KEYS <= set(out)
    assert out["policy"] == policy and out["ranks"] == 8 and out["rollouts"] == 2
    assert set(out["rank_seconds"]) == {"busy", "dummy", "transition", "leased", "idle"}
    assert sum(out["rank_seconds"].values()) == pytest.approx(8 * out["rollout_time_s"], rel=1e-9)
    assert out["rollout_time_s"] >= out["lower_bound_s"]


def test_objective_flag(trace):
    base = ["--trace", str(trace), "--policy", "planned", "--floor", "2", "--ranks", "8", "--json"]
    default = json.loads(simulate(*base).stdout)
    latency = json.loads(simulate(*base, "--objective", "rollout").stdout)
    assert default["objective"] == "occupied" and default["label"] == "planned floor2"
    assert latency["objective"] == "rollout" and latency["label"] == "planned floor2 [rollout]"
    proc = simulate(*base, "--objective", "fastest", expect=None)
    assert proc.returncode == 2 and "--objective" in proc.stderr


def test_compare_table_and_plots(trace, tmp_path):
    proc = simulate("--trace", str(trace), "--ranks", "8", "--compare", "--plot", str(tmp_path / "plots"),
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
    report = json.loads(simulate("--trace", str(trace), "--policy", "planned", "--floor", "2", "--ranks", "8",
                                 "--wandb", "t", "--json", cwd=tmp_path).stdout)
    run_file = next((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    (row,) = wandb_history(run_file)
    assert row["plots/ledger/_type"] == "image-file"
    # the row logs the report's own ledger (planned floor 2 leaves some dummy rank-time on this trace)
    assert row["elastic/rank_seconds/dummy"] == report["rank_seconds"]["dummy"] > 0
    assert not (tmp_path / "plots").exists()


def test_wandb_names_the_run_from_the_resolved_config(trace, tmp_path):
    # No --ranks and no --policy: the run's name and tags come from the defaults that ran, not None.
    simulate("--trace", str(trace), "--floor", "2", "--wandb", "t", cwd=tmp_path)
    run_file = next((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    run = wandb_records(run_file, "run")[0]
    assert run.display_name == "simulate-16ranks"
    assert not any("None" in t for t in run.tags), list(run.tags)


def test_migration_report_and_lease(trace):
    out = json.loads(simulate("--trace", str(trace), "--policy", "planned", "--floor", "2", "--ranks", "8",
                         "--lease", "--migrate", "2", "--json").stdout)
    assert set(out["migration"]) >= {"migrated_responses", "rollout_time_saved_s", "dummy_rank_s_saved"}
    assert out["rank_seconds"]["idle"] + out["rank_seconds"]["leased"] == pytest.approx(out["detached_rank_s"])


def test_a_plan_that_cannot_fit_is_a_clear_error(tmp_path):
    # One prompt of ten million tokens: its KV cache alone exceeds any rank's memory.
    path = tmp_path / "huge.jsonl"
    path.write_text("".join(json.dumps({"prompt_id": "x", "epoch": e, "sample": 0, "prompt_len": 10_000_000,
                                        "response_len": 1000, "truncated": False}) + "\n" for e in (0, 1)))
    proc = simulate("--trace", str(path), "--policy", "planned", "--ranks", "4", "--floor", "2", expect=None)
    assert proc.returncode == 2 and proc.stderr.startswith("flexfloor simulate: error: planner:"), proc.stderr


def test_backend_megatron_plans_blocks_and_refuses_ranks_that_do_not_divide_the_experts(trace):
    out = json.loads(simulate("--trace", trace, "--policy", "planned", "--floor", "3", "--backend", "megatron",
                              "--json").stdout)
    assert out["ownership"] == "blocks"
    assert all(128 % g == 0 for r in out["per_rollout"] for g in r["stage_sizes"])
    bad = simulate("--trace", trace, "--ranks", "12", "--backend", "megatron", expect=2)
    assert bad.stderr.strip().splitlines() == [
        "flexfloor simulate: error: --ranks 12: 128 experts do not divide over 12 ranks "
        "(megatron-core owns experts in equal contiguous blocks)"]
