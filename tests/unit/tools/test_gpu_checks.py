"""The CPU side of tools/gpu_check.sh: its summary table and exit status (correctness 1, speed only 3,
no pass without evidence, a pytest stage whose tests were all skipped is SKIP), the visit's worst
case, and the bodies of checks (a) run small on CPU (the GPU runs them at size on CUDA, tests/gpu/)."""
import json

import pytest
import torch

from tests.gpu.checks import gpu_checks
from tests.helpers import REPO
from tools.gpu_summary import junit_row, main, read, record, summarize
from tools.gpu_timeline import worst_case

TINY = gpu_checks.TINY_QWEN3_MOE


def rows(*specs):
    return [{"check": c, "status": s, "detail": d, "seconds": 1.0, "evidence": {"tests passed": 1}}
            for c, s, d in specs]


def test_all_passed_or_skipped_is_status_0():
    table, status = summarize(rows(("a", "pass", "ok"), ("m", "skip", "no megatron-core")), ["a", "m"])
    assert status == 0 and "SKIP" in table and "no megatron-core" in table
    assert table.splitlines()[0].split() == ["check", "status", "seconds", "detail"]
    assert table.splitlines()[-2] == "gpu_check: correctness: all 2 checks passed or were skipped with a reason"


def test_a_failure_or_a_check_that_never_reported_fails_the_run():
    table, status = summarize(rows(("a", "pass", ""), ("b", "fail", "sha256 differs")), ["a", "b", "c"])
    assert status == 1 and "MISSING" in table and "no result (crashed or timed out)" in table
    assert table.splitlines()[-2] == "gpu_check: correctness: 2 of 3 checks failed: b, c"
    # The last report of a check wins (a stage's wrapper reports after the test's own row).
    assert summarize(rows(("a", "fail", "x"), ("a", "pass", "")), ["a"])[1] == 0


def test_record_and_read_round_trip_and_bad_lines(tmp_path, monkeypatch):
    path = tmp_path / "r.jsonl"
    monkeypatch.delenv("FF_GPU_RESULTS", raising=False)
    record("a", "pass")  # no file named: plain pytest runs write nothing
    monkeypatch.setenv("FF_GPU_RESULTS", str(path))
    record("a", "pass", "fine", 2.25, evidence={"tests passed": 2})
    with pytest.raises(ValueError, match="status: expected one of"):
        record("a", "ok")
    with path.open("a") as fh:
        fh.write("Traceback (most recent call last):\n" + json.dumps({"check": "b", "status": "??"}) + "\n")
    got = read(path)
    assert got[0] == {"check": "a", "status": "pass", "detail": "fine", "seconds": 2.2,
                      "evidence": {"tests passed": 2}}
    assert [r["status"] for r in got[1:]] == ["fail", "fail"]
    assert main([str(path), "--expect", "a"]) == 1


def test_cli_records_and_prints(tmp_path, capsys):
    path = str(tmp_path / "r.jsonl")
    assert main([path, "--record", "m: megatron", "skip", "megatron-core not importable", "0"]) == 0
    assert main([path, "--expect", "m: megatron"]) == 0
    assert "megatron-core not importable" in capsys.readouterr().out


def test_a_pass_without_evidence_fails_and_speed_rows_come_last_with_their_own_exit_status():
    bare = [{"check": "a", "status": "pass", "detail": "ran?", "seconds": 1.0}]
    table, status = summarize(bare, ["a"])
    assert status == 1 and "FAIL" in table and "passed without evidence (no evidence recorded): ran?" in table
    zero = [{**bare[0], "evidence": {"graph replays": 0, "decode steps": 4}}]
    assert "passed without evidence (graph replays 0)" in summarize(zero, ["a"])[0]
    speed = "c: decode tokens/s, batch 1"
    got = rows((speed, "fail", "0.9x HF (target >= 1.5x)"), ("a", "pass", ""))
    table, status = summarize(got, [speed, "a"])
    lines = table.splitlines()
    assert status == 3 and lines[2].startswith("a ") and lines[4].startswith(speed)  # correctness first
    assert lines[-2] == "gpu_check: correctness: all 1 checks passed or were skipped with a reason"
    assert lines[-1] == f"gpu_check: speed: 1 of 1 checks failed: {speed}"
    assert summarize(got + rows(("b", "fail", "")), [speed, "a", "b"])[1] == 1  # correctness wins


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">{}</testsuite></testsuites>"""


@pytest.mark.parametrize("cases, status, evidence, detail", [
    ('<testcase name="t1"/><testcase name="t2"><skipped message="no TE"/></testcase>', "pass", 1, "1 passed: t1"),
    ('<testcase name="t1"><skipped message="megatron-core\'s layers need CUDA"/></testcase>', "skip", None,
     "every test skipped: megatron-core's layers need CUDA"),
    ('<testcase name="t1"/><testcase name="t2"><failure message="x"/></testcase>', "fail", 1, "1 failed: t2"),
    ("", "fail", 0, "no test ran"),
])
def test_a_pytest_stage_passes_only_with_tests_that_ran(tmp_path, cases, status, evidence, detail):
    """The megatron rows once passed whenever pytest exited 0, all their tests skipped included."""
    path = tmp_path / "j.xml"
    path.write_text(JUNIT.format(cases))
    got = junit_row(path)
    assert got[0] == status and got[1].startswith(detail) and got[2].get("tests passed") == evidence


def test_the_visit_worst_case_is_a_slow_start_a_capped_profile_and_a_capped_rerun():
    line, fits = worst_case(285)
    assert fits and "240 s + profile 285 s" in line and "= 810 s, 90 s to spare" in line
    assert not worst_case(331)[1]


def test_greedy_check_on_cpu():
    exact = gpu_checks.greedy_vs_reference(TINY, device="cpu", dtype=torch.float64, batch=2, new_tokens=8)
    assert exact["agreement"] == 1.0 and exact["ok"]
    bf16 = dict(device="cpu", dtype=torch.bfloat16, batch=8, new_tokens=32, seed=1)
    out = gpu_checks.greedy_vs_reference(TINY, **bf16)
    assert out["large_margin_agreement"] == 1.0 and out["ok"] and out["agreement"] < 1.0
    assert out["summary"].endswith(f"of the {out['large_margin_steps']} with a large margin")
    # With every step counted as large, bf16's disagreements fail the check.
    assert not gpu_checks.greedy_vs_reference(TINY, **bf16, margin=0.0)["ok"]


@pytest.mark.timeout(240)
def test_grpo_steps_through_the_trainer_lower_the_surrogate_and_a_frozen_model_does_not():
    kw = dict(device="cpu", dtype="float32", prompts_per_step=2, group_size=4, max_response_len=6)
    out = gpu_checks.grpo_steps(TINY, steps=2, **kw)
    assert out["ok"] and len(out["loss_after"]) == 2 and out["summary"].startswith("surrogate before -> after")
    assert not gpu_checks.grpo_steps(TINY, steps=1, lr=1e-30, **kw)["ok"]


@pytest.mark.timeout(240)
def test_elastic_check_on_cpu():
    out = gpu_checks.elastic_on_one_device(device="cpu", prompts=4, samples=2)
    assert out["ok"] and out["device"] == "cpu" and out["freed_bytes"]["1"]["kv_cache"] > 0
    assert "equals vanilla's" in out["summary"], out["summary"]


def test_gpu_check_script_lints_and_refuses_a_machine_without_cuda():
    import shutil
    import subprocess

    script = REPO / "tools" / "gpu_check.sh"
    lint = subprocess.run([shutil.which("shellcheck") or "shellcheck", str(script)], capture_output=True, text=True,
                          timeout=60)
    assert lint.returncode == 0, lint.stdout
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: tools/gpu_check.sh would run the checks")
    res = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stderr.strip() == ("gpu_check: no CUDA device visible; run this on a GPU "
                                                          "machine (or FF_GPU_DRYRUN=1 for the CPU dry run)")


def test_a_pair_whose_decode_time_is_not_positive_is_invalid_not_a_throughput(tmp_path, monkeypatch):
    """bench_gpu once clamped t(N) - t(1) to 1e-9 s and printed HF generate at 3e9 tokens/s."""
    import time

    from tools import bench_gpu

    def engine(delay_1, delay_n):
        return lambda prompts, n: time.sleep(delay_1 if n == 1 else delay_n) or [[0] * n]

    out = bench_gpu.measure({"ok": engine(0.0, 0.02), "bad": engine(0.02, 0.0)}, [[1]], 4, reps=1)
    assert out["decode_s"]["ok"] > 0 and out["decode_s"]["bad"] is None
    monkeypatch.setenv("FF_GPU_RESULTS", str(tmp_path / "r.jsonl"))
    status, detail = bench_gpu._judged(True, {"invalid": ["bad"]}, "figures")
    assert status == "fail" and detail.startswith("INVALID timing of bad")
