import json
import random

import pytest
import torch

# The tiny models gain nothing from intra-op threads, and OpenMP threads spinning against the gloo
# ranks that distributed tests spawn on the same 2 cores make everything many times slower.
torch.set_num_threads(1)


def write_tailed_trace(path):
    """A small length-tailed trace: 3 epochs x 8 prompts x 4 samples, lognormal lengths."""
    rng = random.Random(0)
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


@pytest.fixture(scope="module")
def tailed_trace(tmp_path_factory):
    return write_tailed_trace(tmp_path_factory.mktemp("trace") / "trace.jsonl")


@pytest.fixture
def one_rank_group(request):
    """A one-rank torch.distributed world and a group of that rank, torn down after the test.

    The backend is the test module's `DIST_BACKEND` (default gloo; nccl for GPU tests).
    """
    from datetime import timedelta

    import torch.distributed as dist

    backend = getattr(request.module, "DIST_BACKEND", "gloo")
    dist.init_process_group(backend, init_method="tcp://127.0.0.1:0", rank=0, world_size=1,
                            timeout=timedelta(seconds=120))
    try:
        yield dist.new_group([0])
    finally:
        dist.destroy_process_group()
