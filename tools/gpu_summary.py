"""The one summary table of tools/gpu_check.sh, and its exit status.

Every check appends one JSON line `{"check", "status", "detail", "seconds"}` to the results file
(`$FF_GPU_RESULTS`): the tests in tests/gpu/ and tools/bench_gpu.py through `record`, the shell
script for each stage it runs. `status` is `pass`, `fail` or `skip` (with the reason as detail).
The table lists every expected check; one that never reported (its process crashed or timed out)
is `missing`. Any `fail` or `missing` makes the exit status 1.

    python tools/gpu_summary.py RESULTS.jsonl --expect "a: greedy bf16 vs fp64" "b: ..."
    python tools/gpu_summary.py RESULTS.jsonl --record CHECK STATUS DETAIL SECONDS
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
from pathlib import Path

STATUSES = ("pass", "fail", "skip")
DETAIL_CHARS = 240


def record(check: str, status: str, detail: str = "", seconds: float = 0.0, path: str | None = None) -> None:
    """Append one result to `path` (default `$FF_GPU_RESULTS`; without either, nothing is written:
    the tests also run under plain pytest)."""
    if status not in STATUSES:
        raise ValueError(f"status: expected one of {STATUSES}, got {status!r}")
    path = path or os.environ.get("FF_GPU_RESULTS")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"check": check, "status": status, "detail": detail,
                                 "seconds": round(seconds, 1)}) + "\n")


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


def markdown(rows: list[dict], expected: list[str], title: str) -> str:
    """The run's table for docs/gpu.md's Measured section, details whole."""
    last = {r["check"]: r for r in rows}
    out = [title, "", "| check | status | seconds | detail |", "| --- | --- | --- | --- |"]
    for check in list(dict.fromkeys(expected)) + [c for c in last if c not in expected]:
        r = last.get(check, {"status": "missing", "seconds": "", "detail": "no result (crashed or timed out)"})
        out.append(f"| {check} | {r['status'].upper()} | {r['seconds']} | {str(r['detail']).replace('|', '/')} |")
    return "\n".join(out) + "\n"


def summarize(rows: list[dict], expected: list[str]) -> tuple[str, int]:
    """(the table, the exit status). A check reported twice keeps its last report; one expected by
    two profiles is listed once."""
    last = {r["check"]: r for r in rows}
    order = list(dict.fromkeys(expected)) + [c for c in last if c not in expected]
    table = [("check", "status", "seconds", "detail")]
    for check in order:
        r = last.get(check, {"status": "missing", "seconds": "", "detail": "no result (crashed or timed out)"})
        detail = str(r["detail"])
        table.append((check, r["status"].upper(), str(r["seconds"]),
                      detail if len(detail) <= DETAIL_CHARS else detail[:DETAIL_CHARS - 3] + "..."))
    widths = [max(len(row[i]) for row in table) for i in range(3)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3] for row in table]
    lines.insert(1, "-" * len(lines[0]))
    bad = [c for c in order if last.get(c, {}).get("status", "missing") in ("fail", "missing")]
    verdict = f"gpu_check: {len(bad)} of {len(order)} checks failed: {', '.join(bad)}" if bad else \
        f"gpu_check: all {len(order)} checks passed or were skipped with a reason"
    return "\n".join(lines + [verdict]), 1 if bad else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", help="the results file (JSON Lines)")
    p.add_argument("--expect", nargs="*", default=[], help="checks that must report")
    p.add_argument("--record", nargs=4, metavar=("CHECK", "STATUS", "DETAIL", "SECONDS"),
                   help="append one result instead of printing the table")
    p.add_argument("--fill", nargs="+", metavar="STATUS DETAIL SECONDS CHECK",
                   help="record STATUS DETAIL SECONDS for each CHECK not reported yet")
    p.add_argument("--markdown", metavar="PATH", help="also write the table as a docs/gpu.md section here")
    p.add_argument("--title", default="gpu_check", help="the Markdown section's first line")
    args = p.parse_args(argv)
    if args.record:
        check, status, detail, seconds = args.record
        record(check, status, detail, float(seconds), args.results)
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
