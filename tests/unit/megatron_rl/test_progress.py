"""The progress line within a phase: timestamped, rate-limited, with an ETA."""
from __future__ import annotations

import re

from megatron_rl.progress import Progress


def test_at_most_one_line_every_few_seconds_with_timestamp_and_eta(capsys):
    now = [0.0]
    p = Progress("step 3 rollout (rank 0)", 1000, "tokens", every_s=5.0, clock=lambda: now[0])
    for t, done in ((1.0, 100), (4.9, 400), (5.0, 500), (7.0, 700), (10.5, 900)):
        now[0] = t
        p.update(done)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines  # at 5.0 s and 10.5 s
    assert re.fullmatch(r"\[train\] \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ step 3 rollout \(rank 0\): 500/1000 tokens, "
                        r"100/s, ETA 5 s", lines[0]), lines[0]
    Progress("update", 4, "micro-batches", enabled=False, every_s=0).update(1)
    assert capsys.readouterr().err == ""
