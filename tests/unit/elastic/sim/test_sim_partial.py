"""Partial rollouts in the planner and the simulator (elastic/sim/partial.py): a resumed response is
planned by what is left of it, and over a trace nothing is dropped, carried responses resume, and
adaptive + partial carries exactly what partial alone carries (the end rule counts steps)."""
from elastic.planning.choices import PlanChoices
from elastic.planning.dims import planned_dims
from elastic.planning.lengths.predict import Predictor
from elastic.planning.partial import PartialRule
from elastic.planning.planner import make_plan
from elastic.planning.platform import Platform
from elastic.planning.shape import ModelShape
from elastic.sim.costmodel import CostModel
from elastic.sim.partial import simulate_partial
from elastic.sim.replay import Policy, simulate_trace
from elastic.sim.synth import generate, preset
from elastic.trace import TraceRecord


def test_a_resumed_response_is_planned_by_what_is_left_of_it():
    trace = generate(preset("deepscaler", prompts=64), seed=0)
    batch, history = trace.epoch(3), trace.before(3)
    pred = Predictor(history)
    longest = sorted(batch, key=lambda r: -pred.predict(r.prompt_id).median)[:8]
    # Eight of the longest-predicted responses, resumed 60 tokens short of the cap: nearly done.
    known = {r.key: 16384 - 60 for r in longest}
    resumed = [TraceRecord(r.prompt_id, r.epoch, r.sample, r.prompt_len + known.get(r.key, 0), r.response_len)
               for r in batch]
    kw = dict(platform=Platform(planned_dims(16, ModelShape().num_experts), ModelShape(), cost=CostModel()),
              choices=PlanChoices(4, True, objective="rollout"), layout="planned")
    for prefix, on_residents in ((None, 8), (known, 0)):
        plan = make_plan(resumed, history, known_prefix=prefix, **kw)
        residents = set(plan.stages[-1].members)
        assert len(plan.stages) > 1
        assert sum(plan.rank_of()[r.key] in residents for r in longest) == on_residents


def test_partial_over_a_trace_drops_nothing_and_composes_with_adaptive():
    trace = generate(preset("deepscaler", prompts=16, samples=4, epochs=4), seed=1)
    kw = dict(ranks=4, cost=CostModel(), shape=ModelShape(), epochs=[1, 2])
    rule = PartialRule(0.25)
    sync = simulate_trace(trace, Policy("vanilla", 4), **kw).summary()
    alone = simulate_partial(trace, Policy("vanilla", 4), rule, **kw).summary()
    both = simulate_partial(trace, Policy("adaptive", 1, True, objective="rollout"), rule, **kw).summary()
    for s in (alone, both):
        p = s["partial"]
        assert p["dropped"] == 0 and p["trained_groups"] == 2 * 16
        assert p["carried"] > 0 and p["resumed"] > 0 and 0 < p["off_policy_share"] < 1
        assert p["max_version_lag"] >= 1
    # The end rule counts decode steps: the same responses end each rollout under either placement.
    assert alone["partial"] == both["partial"]
    assert alone["response_tokens"] == both["response_tokens"]
    # Over-sampled and cut at the target, partial ends its rollouts sooner than the synchronous run.
    assert alone["rollout_time_s"] < sync["rollout_time_s"]


def test_simulate_cli_partial(tmp_path, capsys):
    import json

    from elastic.trace import write_trace
    from megatron_rl.cli import main

    trace = tmp_path / "t.jsonl"
    write_trace(generate(preset("deepscaler", prompts=16, samples=4, epochs=3), seed=0).records, trace)
    assert main(["simulate", "--trace", str(trace), "--policy", "vanilla", "--ranks", "4", "--partial",
                 "partial.over_sample=0.5", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)["partial"]
    assert p["dropped"] == 0 and p["trained_groups"] == 2 * 16 and "over-sampling 50%" in p["rule"]
    assert main(["simulate", "--trace", str(trace), "--partial", "partial.end=budget"]) == 2
    assert "end 'budget' needs a budget > 0" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(trace), "--partial", "--compare"]) == 2
