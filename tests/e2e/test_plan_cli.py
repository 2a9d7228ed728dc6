"""`flexfloor plan` and `flexfloor predict` as a user runs them."""
import json
import signal
import subprocess
import sys

import pytest

from tests.helpers import REPO
from tests.helpers.cli import cli
from tests.helpers.traces import deepscaler, small_deepscaler, written


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    # what `tools/make_trace.py --preset deepscaler --prompts 64 --epochs 4 --seed 3` writes
    return written(deepscaler(3, prompts=64, epochs=4), tmp_path_factory.mktemp("trace") / "dsr.jsonl")


def test_plan_json_has_the_documented_fields(trace):
    res = cli("plan", "--trace", str(trace), "--epoch", "3", "--ranks", "8", "--floor", "2",
              "--tailguard", "--layout", "planned", "--json")
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)
    assert plan["ranks"] == 8 and plan["floor"] == 2 and plan["tailguard"] is True
    keys = [(a["prompt_id"], a["sample"]) for a in plan["assignments"]]
    assert len(keys) == len(set(keys)) == 64 * 8
    assert all(set(a) == {"prompt_id", "sample", "rank"} and 0 <= a["rank"] < 8
               for a in plan["assignments"])
    stages = plan["stages"]
    assert stages[0]["members"] == list(range(8)) and stages[0]["drained"] == []
    for prev, st in zip(stages, stages[1:]):
        assert set(st["members"]) < set(prev["members"])
        assert set(prev["members"]) - set(st["members"]) <= set(st["drained"])
    for st in stages:
        assert sorted(int(e) for e in st["owners"]) == list(range(128))
        assert all(set(rs) <= set(st["members"]) for rs in st["owners"].values())
    assert len(stages[-1]["members"]) >= 2
    assert isinstance(plan["predicted_release_rank_s"], float)


def test_default_epoch_is_the_last_and_summary_reads(trace):
    last = cli("plan", "--trace", str(trace), "--ranks", "8", "--floor", "4", "--json")
    explicit = cli("plan", "--trace", str(trace), "--epoch", "3", "--ranks", "8", "--floor", "4",
                   "--json")
    assert last.returncode == 0 and last.stdout == explicit.stdout
    text = cli("plan", "--trace", str(trace), "--ranks", "8", "--floor", "4", "--layout", "planned")
    assert text.returncode == 0
    assert "stage 0: 8 ranks at start" in text.stdout and "release area" in text.stdout


def test_predict_prints_quality_per_epoch(trace):
    res = cli("predict", "--trace", str(trace))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert "spearman" in lines[0] and "miss" in lines[0]
    assert [int(line.split()[0]) for line in lines[1:4]] == [1, 2, 3]
    js = json.loads(cli("predict", "--trace", str(trace), "--json").stdout)
    assert [e["epoch"] for e in js["epochs"]] == [1, 2, 3]
    assert all(e["spearman"] > 0.5 and 0 <= e["tailguard"]["miss_rate"] <= 0.15
               for e in js["epochs"])


def test_malformed_trace_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_id": "a", "epoch": 0, "sample": 0, "prompt_len": 3, '
                   '"response_len": 4}\n{"prompt_id": "a", "epoch": 1}\n')
    for cmd in ("plan", "predict"):
        res = cli(cmd, "--trace", str(bad))
        assert res.returncode == 2
        assert f"{bad}:2: missing field" in res.stderr and "Traceback" not in res.stderr


def test_help_lists_the_options():
    res = cli("plan", "--help")
    assert res.returncode == 0 and "--tailguard" in res.stdout and "--model" in res.stdout
    assert "qwen3-30b-a3b@h100-80g" in res.stdout


def test_backend_megatron_plans_megatron_cores_blocks(tmp_path):
    from unit.elastic.planning.test_megatron_planning import _assert_blocks

    from elastic.planning.plan import Plan

    path = written(small_deepscaler(), tmp_path / "dsr.jsonl")
    res = cli("plan", "--trace", path, "--floor", "3", "--layout", "planned", "--backend", "megatron", "--json",
              expect=0)
    _assert_blocks(Plan.from_dict(json.loads(res.stdout)))


def test_a_broken_stdout_pipe_ends_quietly(trace):
    proc = subprocess.Popen([sys.executable, "-m", "megatron_rl.cli", "plan", "--trace", str(trace)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # `| head -0`: the reader is gone before the first line
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 128 + signal.SIGPIPE and err == "", err
