"""The one summary table of tools/gpu_check.sh, and its exit status.

Every check appends one JSON line `{"check", "status", "detail", "seconds"}` to the results file
(`$FF_GPU_RESULTS`): the tests in tests/gpu/ and tools/bench_gpu.py through `record`, the shell
script for each stage it runs. `status` is `pass`, `fail` or `skip` (with the reason as detail).
The table lists every expected check; one that never reported (its process crashed or timed out)
is `missing`. Any `fail` or `missing` makes the exit status 1.

    python tools/gpu_summary.py RESULTS.jsonl --expect "a: greedy bf16 vs fp64" "b: ..."
    python tools/gpu_summary.py RESULTS.jsonl --record CHECK STATUS DETAIL SECONDS
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

STATUSES = ("pass", "fail", "skip")


def record(check: str, status: str, detail: str = "", seconds: float = 0.0, path: str | None = None) -> None:
    """Append one result to `path` (default `$FF_GPU_RESULTS`; without either, nothing is written:
    the tests also run under plain pytest)."""
    if status not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
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


def summarize(rows: list[dict], expected: list[str]) -> tuple[str, int]:
    """(the table, the exit status). A check reported twice keeps its last report."""
    last = {r["check"]: r for r in rows}
    order = list(expected) + [c for c in last if c not in expected]
    table = [("check", "status", "seconds", "detail")]
    for check in order:
        r = last.get(check, {"status": "missing", "seconds": "", "detail": "no result (crashed or timed out)"})
        table.append((check, r["status"].upper(), str(r["seconds"]), r["detail"]))
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
    args = p.parse_args(argv)
    if args.record:
        check, status, detail, seconds = args.record
        record(check, status, detail, float(seconds), args.results)
        return 0
    table, status = summarize(read(args.results) if Path(args.results).exists() else [], args.expect)
    print(table)
    return status


if __name__ == "__main__":
    sys.exit(main())
