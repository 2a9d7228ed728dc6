"""The predictor, TailGuard and the planner for epoch E never read a length of epoch >= E.

Records of epoch >= E are replaced by poisoned ones whose `response_len` and `truncated` raise on
access; planning epoch E must still work, and give the same plan as with the real trace.
"""
import pytest

from elastic.planning.choices import PlanChoices
from elastic.planning.dims import planned_dims
from elastic.planning.lengths.guard import TailGuard
from elastic.planning.lengths.predict import Predictor
from elastic.planning.planner import plan_epoch
from elastic.planning.platform import Platform
from elastic.planning.shape import ModelShape
from elastic.trace import Trace, TraceRecord
from tests.helpers.traces import deepscaler


class Leak(AssertionError):
    pass


class Poisoned:
    """A record of the future: its keys are known, its length is not."""

    def __init__(self, r: TraceRecord):
        self.prompt_id, self.epoch, self.sample, self.prompt_len = (
            r.prompt_id, r.epoch, r.sample, r.prompt_len)

    @property
    def key(self):
        return (self.prompt_id, self.sample)

    @property
    def response_len(self):
        raise Leak(f"read the length of epoch {self.epoch}")

    @property
    def truncated(self):
        raise Leak(f"read the truncation of epoch {self.epoch}")


def poison(trace: Trace, epoch: int) -> Trace:
    return Trace([r if r.epoch < epoch else Poisoned(r) for r in trace.records])


@pytest.fixture(scope="module")
def trace():
    return deepscaler(11, prompts=48)


def test_poison_is_detected(trace):
    with pytest.raises(Leak):
        Predictor(poison(trace, 3))


@pytest.mark.parametrize("epoch", [1, 3, 5])
def test_predictor_and_guard_read_only_the_past(trace, epoch):
    bad = poison(trace, epoch)
    pred = Predictor.for_epoch(bad, epoch)
    guard = TailGuard.fit(bad.before(epoch))
    good = Predictor.for_epoch(trace, epoch)
    for r in trace.epoch(epoch):
        assert pred.predict(r.prompt_id) == good.predict(r.prompt_id)
    assert guard == TailGuard.fit(trace.before(epoch))


@pytest.mark.parametrize("layout, floor, tailguard", [
    ("natural", 16, False), ("lengthsort", 16, True), ("natural", 2, True),
    ("planned", 4, True), ("planned", 2, False)])
def test_plan_for_epoch_reads_only_the_past(trace, layout, floor, tailguard):
    kw = dict(platform=Platform(planned_dims(16, ModelShape().num_experts), ModelShape()),
              choices=PlanChoices(floor, tailguard), layout=layout)
    epoch = 4
    plan = plan_epoch(poison(trace, epoch), epoch, **kw)
    assert plan.to_dict() == plan_epoch(trace, epoch, **kw).to_dict()
    # Changing the future changes nothing either.
    future = Trace([r if r.epoch < epoch else TraceRecord(r.prompt_id, r.epoch, r.sample,
                                                          r.prompt_len, 1, False)
                    for r in trace.records])
    assert plan_epoch(future, epoch, **kw).to_dict() == plan.to_dict()


def test_oracle_is_the_only_reader_of_the_batch(trace):
    with pytest.raises(Leak):
        plan_epoch(poison(trace, 4), 4, platform=Platform(planned_dims(8, ModelShape().num_experts), ModelShape()),
                   choices=PlanChoices(2, False), layout="planned", oracle=True)
