"""`FF_GPU_DRYRUN=1 bash tools/gpu_check.sh` as CI runs it: every stage and Python path of every
profile on CPU at tiny shapes, under the import blocker of the bare H200 image (tools/gpu_dryrun/),
with the carried wheels' names standing for them. A change that would break the first GPU run (an
import the image lacks, a row that never reports, results outside $OUT, a profile over its budget,
a captured region that reads the host, a row that passes without evidence of what ran, a
megatron-core row that did not run) breaks this test. Negative controls: the wheels folder without
math-verify fails the run; a budget too small turns stages into SKIP rows, not FAIL."""
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tools.gpu_timeline import PROFILES, STAGES

ROOT = Path(__file__).resolve().parents[2]


def wheels(folder: Path, leave_out: str = "") -> Path:
    """Empty files named as tools/gpu_wheels.sh downloads them (the dry run reads their names only)."""
    folder.mkdir(parents=True)
    for line in (ROOT / "tools" / "gpu_wheels.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            dist, version = line.split()[0].split("==")
            if dist != leave_out:
                (folder / f"{re.sub(r'[-.]', '_', dist)}-{version}-py3-none-any.whl").touch()
    return folder


def dry_run(tmp: Path, timeout: int, leave_out: str = "", **env) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp / "out"
    res = subprocess.run(["bash", "tools/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "FF_GPU_DRYRUN": "1", "OUT": str(out),
                              "FF_GPU_WHEELS": str(wheels(tmp / "wheels", leave_out)), **env})
    return res, out


def rows(out: Path) -> dict:
    lines = (out / "results.jsonl").read_text().splitlines()
    return {r["check"]: r for r in map(json.loads, lines)}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("profile", list(PROFILES))
def test_the_dry_run_records_every_row_of_a_profile_under_out(tmp_path, profile):
    """One profile a test (`FF_GPU_PROFILE`, as a GPU visit runs them), so that no test runs for
    minutes; together they cover every row of every profile."""
    res, out = dry_run(tmp_path, 900, FF_GPU_PROFILE=profile)
    assert res.returncode == 0, res.stdout[-6000:]
    got = rows(out)
    want = {row for stage in PROFILES[profile] for row in STAGES[stage][2]}
    assert want <= set(got), sorted(want - set(got))
    judged = {"c: capture safety": "pass", "s: sglang lease": "skip", "o: offloaded optimizer step": "skip"}
    assert all(got[c]["status"] == status for c, status in judged.items() if c in want), got
    # Every pass carries evidence of what ran; the megatron-core rows ran on CPU through the harness,
    # and the paged row's kernel ran in the interpreter.
    passed = {c: r for c, r in got.items() if r["status"] == "pass"}
    assert passed and all(r.get("evidence") and min(r["evidence"].values()) > 0 for r in passed.values()), passed
    assert {c for c in want if c.startswith("m: ")} <= set(passed), {c: got[c]["status"] for c in got}
    paged = "k: paged vs slot KV, decode batch 64"
    assert paged not in want or got[paged]["evidence"]["paged kernel launches"] > 0
    assert "= 810 s, 90 s to spare" in res.stdout
    written = ["results.jsonl", "gpu_check.log", "gpu_md_section.md"] + ["gpu_step_times.json"] * (profile == "slice")
    for name in written:
        assert (out / name).stat().st_size > 0, name
    # The default profile fits 285 s with 20% margin, and the last lines are the compact table.
    m = re.search(r"default profile, projected on an H200: total (\d+) s of 285 s", res.stdout)
    assert m and int(m.group(1)) <= 0.8 * 285, res.stdout[-3000:]
    tail = res.stdout[res.stdout.index("default profile, projected on an H200"):]
    assert len(tail) < 12_000 and tail.rstrip().endswith("passed or were skipped with a reason")


@pytest.mark.timeout(600)
def test_a_wheels_folder_without_math_verify_fails_and_a_spent_budget_skips(tmp_path):
    res, out = dry_run(tmp_path / "a", 600, leave_out="math-verify", FF_GPU_STAGES="^w: ")
    assert res.returncode == 1 and rows(out)["w: carried wheels"]["status"] == "fail", res.stdout[-3000:]
    assert "No module named 'math_verify'" in res.stdout
    res, out = dry_run(tmp_path / "b", 600, FF_GPU_STAGES="^(w|te): ", FF_GPU_DRYRUN_BUDGET_S="5")
    assert res.returncode == 0, res.stdout[-3000:]
    got = rows(out)
    assert {r["status"] for r in got.values()} == {"skip"} and "budget" in got["w: carried wheels"]["detail"]
