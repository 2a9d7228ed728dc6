"""A progress line within a long phase, so a step of minutes is not silent.

    [train] 2026-12-01T21:50:03Z step 3 rollout (rank 0): 1200/4096 tokens, 310/s, ETA 9 s

At most one line every EVERY_S seconds (none for a phase shorter than that), on one rank. The
total is an upper bound where the phase can end early (a rollout's token budget: responses stop at
EOS), so the ETA is one too.
"""
from __future__ import annotations

import sys
import time
from datetime import datetime, timezone

EVERY_S = 10.0


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Progress:
    def __init__(self, what: str, total: int, unit: str, enabled: bool = True, every_s: float = EVERY_S,
                 clock=time.monotonic):
        self.what, self.total, self.unit, self.enabled = what, total, unit, enabled
        self.every_s, self.clock = every_s, clock
        self.t0 = self.last = clock()

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        now = self.clock()
        if now - self.last < self.every_s:
            return
        self.last = now
        rate = done / max(now - self.t0, 1e-9)
        eta = f"ETA {(self.total - done) / rate:.0f} s" if rate > 0 else "ETA unknown"
        print(f"[train] {utc_now()} {self.what}: {done}/{self.total} {self.unit}, {rate:.3g}/s, {eta}",
              file=sys.stderr, flush=True)
