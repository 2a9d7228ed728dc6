"""The rollout batch (rollout/batch.py): trace records turned into requests."""
import math

from elastic.trace import TraceRecord
from megatron_rl.rollout.batch import make_requests
from megatron_rl.rollout.config import BatchConfig


def test_requests_carry_their_reserved_length_in_run_tokens():
    """A reserved length (trace tokens) reaches `Request.predicted_len` scaled like the response
    (rounded up first); an unbounded one, or none at all, leaves the cap to decide."""
    batch = [TraceRecord("a", 0, 0, 4, 40, False), TraceRecord("a", 0, 1, 4, 60, False)]
    cfg = BatchConfig(length_scale=0.5)
    reqs = make_requests(batch, cfg, seed=0, vocab=16, reserved=[10.2, math.inf])
    assert [(r.max_new_tokens, r.predicted_len) for r in reqs] == [(20, 6), (30, None)]
    assert [r.predicted_len for r in make_requests(batch, cfg, seed=0, vocab=16)] == [None, None]
