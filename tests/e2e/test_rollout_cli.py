"""`flexfloor rollout` as a user runs it: a subprocess, its files, its exit status, its stderr."""
import hashlib
import json
import os
import subprocess
import sys

import pytest
from conftest import wandb_history, wandb_records

from tests.helpers import REPO
from tests.helpers.cli import cli

STATES = {"busy", "dummy", "transition", "leased", "idle"}
pytestmark = pytest.mark.timeout(240)


def test_rollout_writes_report_json_and_out_dir(tailed_trace, tmp_path):
    out_json, out_dir = tmp_path / "report.json", tmp_path / "run"
    # Long enough (~1-3 s) that the ranks' clock skew stays well inside the ledger's 1% check.
    r = cli("rollout", "--trace", tailed_trace, "--ranks", 2, "--length-scale", 0.02,
            "--json", out_json, "--out", out_dir, "--wandb", "t")
    assert r.returncode == 0, r.stderr
    assert "[rollout]" in r.stderr and "unfinished 0" in r.stderr  # the progress line
    assert "dummy share" in r.stdout and "responses_sha256" in r.stdout
    report = json.loads(out_json.read_text())
    assert report["ranks"] == 2 and report["rollout_time_s"] > 0
    assert set(report["rank_seconds"]) == STATES and set(report["rank_steps"]) == STATES
    assert sum(report["rank_steps"].values()) == 2 * report["rollout_steps"]
    assert report["tokens_per_occupied_rank_s"] > 0
    assert json.loads((out_dir / "report.json").read_text()) == report
    assert json.loads((out_dir / "plan.json").read_text())["ranks"] == 2
    lines = (out_dir / "responses.jsonl").read_text().splitlines()
    responses = [json.loads(line) for line in lines]
    assert len(responses) == report["responses"] == 32
    assert sum(len(x["tokens"]) for x in responses) == report["response_tokens"]
    # The hash can be recomputed from outside: SHA-256 over sorted (prompt_id, sample, tokens).
    h = hashlib.sha256()
    for x in sorted(responses, key=lambda x: (x["prompt_id"], x["sample"])):
        h.update(json.dumps([x["prompt_id"], x["sample"], x["tokens"]]).encode() + b"\n")
    assert h.hexdigest() == report["responses_sha256"]
    # --wandb: the report as one offline W&B run under --out, with the trainer's grouped keys
    run_file = next((out_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    (row,) = wandb_history(run_file)
    assert row["elastic/rank_seconds/dummy"] == pytest.approx(report["rank_seconds"]["dummy"])
    assert row["elastic/tokens_per_occupied_rank_s"] == pytest.approx(report["tokens_per_occupied_rank_s"])
    run = wandb_records(run_file, "run")[0]
    assert run.project == "t" and run.display_name == "rollout" and "policy:vanilla" in run.tags


def test_torchrun_joins_the_process_group_and_matches_spawned_ranks(tailed_trace, tmp_path):
    common = ["rollout", "--trace", tailed_trace, "--length-scale", 0.01, "--quiet", "--sample"]
    spawned = cli(*common, "--ranks", 2, "--json", tmp_path / "spawned.json")
    assert spawned.returncode == 0, spawned.stderr
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # This interpreter's torchrun: a `torchrun` on PATH may belong to another environment, or be absent.
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "megatron_rl.cli",
                        *map(str, common), "--json", tmp_path / "torchrun.json"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("responses_sha256") == 1  # only rank 0 reports
    a = json.loads((tmp_path / "spawned.json").read_text())
    b = json.loads((tmp_path / "torchrun.json").read_text())
    assert b["ranks"] == 2 and a["responses_sha256"] == b["responses_sha256"]


def test_planned_floor1_detaches_a_rank_at_length_scale_1(tmp_path):
    """The tiny long-tailed trace decoded at its own lengths: plans priced on the CPU engine shrink
    (under the H100 cost model they kept every rank)."""
    trace = tmp_path / "tiny.jsonl"
    made = subprocess.run([sys.executable, "tools/make_trace.py", "--preset", "deepscaler", "--prompts", "16",
                           "--samples", "4", "--epochs", "3", "--median", "12", "--cap", "96", "--out", trace],
                          cwd=REPO, capture_output=True, text=True, check=False)
    assert made.returncode == 0, made.stderr
    out_json = tmp_path / "report.json"
    r = cli("rollout", "--trace", trace, "--length-scale", 1, "--policy", "planned", "--floor", 1,
            "--quiet", "--json", out_json)
    assert r.returncode == 0, r.stderr
    report = json.loads(out_json.read_text())
    assert report["final_stage"] > 0 and len(report["stages"]) > 1
    assert report["rank_seconds"]["idle"] + report["rank_seconds"]["leased"] > 0
