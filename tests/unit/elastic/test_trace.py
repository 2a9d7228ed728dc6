"""Length traces: the JSON Lines format, its errors, and the synthetic generator."""
import json

import pytest

from elastic.sim.synth import PRESETS, SynthParams, generate, preset
from elastic.trace import Trace, TraceError, TraceRecord, read_trace, write_trace
from tools.make_trace import main as make_trace


def _write(tmp_path, lines):
    p = tmp_path / "t.jsonl"
    p.write_text("".join(line + "\n" for line in lines))
    return p


GOOD = json.dumps({"prompt_id": "a", "epoch": 0, "sample": 0, "prompt_len": 5,
                   "response_len": 7, "truncated": False})


def test_round_trip(tmp_path):
    trace = generate(preset("eurus", prompts=5, samples=2, epochs=2), seed=3)
    write_trace(trace, tmp_path / "x.jsonl")
    back = read_trace(tmp_path / "x.jsonl")
    assert back.records == trace.records
    assert back.epochs == [0, 1]
    assert [r.epoch for r in back.before(1)] == [0] * 10


@pytest.mark.parametrize("line, expect", [
    ("{not json", "not valid JSON"),
    ('{"prompt_id": "a", "epoch": 0, "sample": 0, "prompt_len": 5}', "missing field 'response_len'"),
    ('{"prompt_id": "a", "epoch": 0, "sample": 0, "prompt_len": 5, "response_len": -1}',
     "'response_len': expected >= 0"),
    ('{"prompt_id": "a", "epoch": 0, "sample": 0, "prompt_len": 5, "response_len": 2.5}',
     "'response_len': expected an integer"),
    ('{"prompt_id": "a", "epoch": 0, "sample": 0, "prompt_len": 5, "response_len": 2, "truncated": 1}',
     "'truncated': expected true or false, got 1"),
    ("[1, 2]", "expected a JSON object"),
    ('{"prompt_id": "a", "epoch": 1048576, "sample": 0, "prompt_len": 5, "response_len": 2}',
     "'epoch' is 1048576, beyond any run's rollouts (at most 1048575)"),
    ('{"prompt_id": "a", "epoch": 0, "sample": 4096, "prompt_len": 5, "response_len": 2}',
     "'sample' is 4096, beyond any GRPO group's size (at most 4095)"),
    ('{"prompt_id": "a", "epoch": 0, "sample": 0, "prompt_len": %s, "response_len": 2}' % ("1" * 4301),
     "an integer of 4301 digits (at most 4300)"),
])
def test_malformed_line_names_file_and_line(tmp_path, line, expect):
    p = _write(tmp_path, [GOOD, line])
    with pytest.raises(TraceError) as e:
        read_trace(p)
    assert f"{p}:2" in str(e.value) and expect in str(e.value)


def test_duplicate_and_unknown_fields(tmp_path):
    extra = json.dumps({**json.loads(GOOD), "reward": 1.0, "sample": 1})
    assert len(read_trace(_write(tmp_path, [GOOD, extra]))) == 2
    with pytest.raises(TraceError, match=r":2: duplicate"):
        read_trace(_write(tmp_path, [GOOD, GOOD]))


def test_missing_epoch_is_an_error():
    trace = Trace([TraceRecord("a", 0, 0, 1, 1)])
    with pytest.raises(TraceError, match="no records for epoch 3"):
        trace.epoch(3)


def test_generator_is_reproducible_and_shaped():
    params = preset("deepscaler", prompts=16, samples=4, epochs=3)
    a, b = generate(params, seed=7), generate(params, seed=7)
    assert a.records == b.records
    assert generate(params, seed=8).records != a.records
    assert len(a) == 16 * 4 * 3
    for e in a.epochs:
        batch = a.epoch(e)
        assert {r.prompt_id for r in batch} == {r.prompt_id for r in a.epoch(0)}
        # GRPO groups stay together, samples in order.
        assert [r.sample for r in batch[:4]] == [0, 1, 2, 3]
    assert all(1 <= r.response_len <= params.cap for r in a)
    assert all(r.truncated == (r.response_len == params.cap) for r in a)


def test_generator_validates_parameters():
    with pytest.raises(ValueError, match="prompt_share"):
        SynthParams(prompt_share=1.5)
    with pytest.raises(ValueError, match="trace preset: expected one of"):
        preset("nope")
    assert {"deepscaler", "eurus", "nosignal"} <= set(PRESETS)


def test_make_trace_cli_writes_a_readable_trace(tmp_path, capsys):
    out = tmp_path / "sub" / "t.jsonl"
    assert make_trace(["--preset", "nosignal", "--prompts", "4", "--epochs", "2", "--out", str(out)]) == 0
    assert len(read_trace(out)) == 4 * 8 * 2
    assert "wrote 64 responses" in capsys.readouterr().out
