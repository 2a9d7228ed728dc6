"""The one summary table of tools/gpu_check.sh, and its exit status.

Every check appends one JSON line `{"check", "status", "detail", "seconds", "evidence"}` to the
results file (`$FF_GPU_RESULTS`): the tests in tests/gpu/ and tools/bench_gpu.py through `record`,
the shell script for the stages that record nothing themselves (a pytest stage's row from its JUnit
XML: `--junit`). `status` is `pass`, `fail` or `skip` (with the reason as detail).

No row passes without having run: a `pass` carries its evidence, counts of what ran (tests passed,
graph replays, kernel launches, tokens compared...), and a pass whose evidence is missing or has a
count of 0 is reported as a failure ("passed without evidence"). A pytest stage whose tests were all
skipped is SKIP with pytest's reasons, never PASS.

The table lists every expected check, correctness rows first with their own verdict, then the speed
rows (`tools.gpu_timeline.SPEED_ROWS`: their figures and targets, recorded whatever the verdict);
one that never reported (its process crashed or timed out) is `missing`. Exit status: 1 if a
correctness row failed or is missing, else 3 if only speed rows did, else 0.

    python tools/gpu_summary.py RESULTS.jsonl --expect "a: greedy bf16 vs fp64" "b: ..."
    python tools/gpu_summary.py RESULTS.jsonl --record CHECK STATUS DETAIL SECONDS [--evidence NAME=N ...]
    python tools/gpu_summary.py RESULTS.jsonl --junit CHECK JUNIT.xml SECONDS          # a pytest stage's row
    python tools/gpu_summary.py RESULTS.jsonl --fill STATUS DETAIL SECONDS CHECK...   # those not reported yet
    python tools/gpu_summary.py RESULTS.jsonl --expect ... --markdown OUT/gpu_md_section.md

The printed table is compact (details cut to `DETAIL_CHARS`), so that it and the verdict fit in the
last 12,000 characters of output a lent machine returns; the Markdown section holds them whole.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.gpu_timeline import SPEED_ROWS  # noqa: E402

STATUSES = ("pass", "fail", "skip")
DETAIL_CHARS = 240
EXIT_CORRECTNESS, EXIT_SPEED = 1, 3


def record(check: str, status: str, detail: str = "", seconds: float = 0.0, path: str | None = None,
           evidence: dict[str, int] | None = None) -> None:
    """Append one result to `path` (default `$FF_GPU_RESULTS`; without either, nothing is written:
    the tests also run under plain pytest). `evidence`: what ran, by count (a pass needs it)."""
    if status not in STATUSES:
        raise ValueError(f"status: expected one of {STATUSES}, got {status!r}")
    path = path or os.environ.get("FF_GPU_RESULTS")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"check": check, "status": status, "detail": detail, "seconds": round(seconds, 1),
                                 "evidence": {k: int(v) for k, v in (evidence or {}).items()}}) + "\n")


def judged(row: dict) -> dict:
    """The row as the table shows it: a pass without evidence (none, or a count of 0) is a failure."""
    ev = row.get("evidence") or {}
    if row["status"] != "pass" or (ev and min(ev.values()) > 0):
        return row
    why = "no evidence recorded" if not ev else ", ".join(f"{k} {v}" for k, v in ev.items() if v <= 0)
    return {**row, "status": "fail", "detail": f"passed without evidence ({why}): {row['detail']}"}


def read(path: str | Path) -> list[dict]:
    """The results in the file, in order; a line that is not a result is reported as a failure."""
    rows = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if row["status"] not in STATUSES:
                raise ValueError(row["status"])
            rows.append(row)
        except (ValueError, KeyError, TypeError):
            rows.append({"check": f"{path}:{n}", "status": "fail", "detail": f"unreadable result {line[:60]!r}",
                         "seconds": 0.0})
    return rows


def fill(path: str, checks: list[str], status: str, detail: str, seconds: float = 0.0) -> None:
    """Record `status` for each of `checks` that has not reported yet (a stage cut or crashed
    before its checks could say anything)."""
    done = {r["check"] for r in read(path)} if Path(path).exists() else set()
    for check in checks:
        if check not in done:
            record(check, status, detail, seconds, path)


def junit_row(junit: str | Path) -> tuple[str, str, dict]:
    """(status, detail, evidence) of a pytest stage from its JUnit XML: pass with the count of
    tests passed; skip with pytest's reasons when every test was skipped; fail on any failure or
    error, or when no test ran at all."""
    cases = ET.parse(junit).getroot().iter("testcase")
    passed, skipped, failed = [], [], []
    for case in cases:
        name = case.get("name", "?")
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(name)
        elif (skip := case.find("skipped")) is not None:
            skipped.append(f"{name}: {skip.get('message', '').removeprefix('Skipped: ')}")
        else:
            passed.append(name)
    if failed:
        return "fail", f"{len(failed)} failed: {', '.join(failed)}", {"tests passed": len(passed)}
    if passed:
        extra = f"; {len(skipped)} skipped: {'; '.join(skipped)}" if skipped else ""
        return "pass", f"{len(passed)} passed: {', '.join(passed)}{extra}", {"tests passed": len(passed)}
    if skipped:
        return "skip", f"every test skipped: {'; '.join(dict.fromkeys(s.split(': ', 1)[1] for s in skipped))}", {}
    return "fail", "no test ran", {"tests passed": 0}


def _order(rows: list[dict], expected: list[str]) -> tuple[dict, list[str], list[str]]:
    """(each check's last report, judged; the correctness checks in order; the speed checks)."""
    last = {r["check"]: judged(r) for r in rows}
    order = list(dict.fromkeys(expected)) + [c for c in last if c not in expected]
    return last, [c for c in order if c not in SPEED_ROWS], [c for c in order if c in SPEED_ROWS]


MISSING = {"status": "missing", "seconds": "", "detail": "no result (crashed or timed out)"}


def markdown(rows: list[dict], expected: list[str], title: str) -> str:
    """The run's table for docs/gpu.md's Measured section, details whole, correctness rows first."""
    last, correctness, speed = _order(rows, expected)
    out = [title, "", "| check | status | seconds | evidence | detail |", "| --- | --- | --- | --- | --- |"]
    for check in correctness + speed:
        r = last.get(check, MISSING)
        ev = ", ".join(f"{k} {v}" for k, v in (r.get("evidence") or {}).items())
        out.append(f"| {check} | {r['status'].upper()} | {r['seconds']} | {ev} | "
                   f"{str(r['detail']).replace('|', '/')} |")
    return "\n".join(out) + "\n"


def _verdict(kind: str, checks: list[str], last: dict) -> tuple[str, bool]:
    bad = [c for c in checks if last.get(c, MISSING)["status"] in ("fail", "missing")]
    if bad:
        return f"gpu_check: {kind}: {len(bad)} of {len(checks)} checks failed: {', '.join(bad)}", True
    return f"gpu_check: {kind}: all {len(checks)} checks passed or were skipped with a reason", False


def summarize(rows: list[dict], expected: list[str]) -> tuple[str, int]:
    """(the table, the exit status). A check reported twice keeps its last report; one expected by
    two profiles is listed once. Correctness rows and their verdict first, then the speed rows."""
    last, correctness, speed = _order(rows, expected)
    table = [("check", "status", "seconds", "detail")]
    for check in correctness + speed:
        r = last.get(check, MISSING)
        detail = str(r["detail"])
        table.append((check, r["status"].upper(), str(r["seconds"]),
                      detail if len(detail) <= DETAIL_CHARS else detail[:DETAIL_CHARS - 3] + "..."))
    widths = [max(len(row[i]) for row in table) for i in range(3)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3] for row in table]
    lines.insert(1, "-" * len(lines[0]))
    lines.insert(2 + len(correctness), "-" * len(lines[0]) + " speed (figures and targets)")
    c_line, c_bad = _verdict("correctness", correctness, last)
    s_line, s_bad = _verdict("speed", speed, last)
    status = EXIT_CORRECTNESS if c_bad else EXIT_SPEED if s_bad else 0
    return "\n".join(lines + [c_line, s_line]), status


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", help="the results file (JSON Lines)")
    p.add_argument("--expect", nargs="*", default=[], help="checks that must report")
    p.add_argument("--record", nargs=4, metavar=("CHECK", "STATUS", "DETAIL", "SECONDS"),
                   help="append one result instead of printing the table")
    p.add_argument("--evidence", nargs="*", default=[], metavar="NAME=N", help="the recorded row's evidence")
    p.add_argument("--junit", nargs=3, metavar=("CHECK", "JUNIT", "SECONDS"),
                   help="append CHECK's result from a pytest stage's JUnit XML")
    p.add_argument("--fill", nargs="+", metavar="STATUS DETAIL SECONDS CHECK",
                   help="record STATUS DETAIL SECONDS for each CHECK not reported yet")
    p.add_argument("--markdown", metavar="PATH", help="also write the table as a docs/gpu.md section here")
    p.add_argument("--title", default="gpu_check", help="the Markdown section's first line")
    args = p.parse_args(argv)
    if args.record:
        check, status, detail, seconds = args.record
        evidence = {k: int(v) for k, v in (e.split("=", 1) for e in args.evidence)}
        record(check, status, detail, float(seconds), args.results, evidence)
        return 0
    if args.junit:
        check, junit, seconds = args.junit
        status, detail, evidence = junit_row(junit)
        record(check, status, detail, float(seconds), args.results, evidence)
        return 0
    if args.fill:
        status, detail, seconds, *checks = args.fill
        fill(args.results, checks, status, detail, float(seconds))
        return 0
    rows = read(args.results) if Path(args.results).exists() else []
    table, status = summarize(rows, args.expect)
    if args.markdown:
        Path(args.markdown).write_text(markdown(rows, args.expect, args.title), encoding="utf-8")
    print(table)
    return status


if __name__ == "__main__":
    sys.exit(main())
