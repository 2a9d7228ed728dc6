import json
import random

import pytest


@pytest.fixture
def tailed_trace(tmp_path):
    """A small length-tailed trace: 3 epochs x 8 prompts x 4 samples, lognormal lengths."""
    rng = random.Random(0)
    path = tmp_path / "trace.jsonl"
    with path.open("w") as fh:
        for e in range(3):
            for p in range(8):
                mu = 7.0 + 0.35 * (p % 5)
                for s in range(4):
                    n = min(16384, int(rng.lognormvariate(mu, 0.6)))
                    fh.write(json.dumps({"prompt_id": f"p{p:02d}", "epoch": e, "sample": s,
                                         "prompt_len": 64 + p, "response_len": n,
                                         "truncated": n == 16384}) + "\n")
    return path
