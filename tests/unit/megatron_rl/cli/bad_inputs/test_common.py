"""What every command reads alike: YAML config files, `key.sub=value` overrides and
`--print-config`, traces, the torchrun environment; a bad one is one line naming the file, field or
override, exit 2, before any rank starts. In-process: `main()`."""
import os
import resource
import time
from pathlib import Path

import pytest
import yaml

from megatron_rl.cli import main
from tests.helpers.traces import write_flat_trace as _trace
from tests.process_tree import one_line_exit_2 as _one_line_exit_2


def test_partial_bounds_blame_the_field_the_error_names(cfg, tmp_path, capsys):
    """`over_sample` is capped by a rollout's response limit and by the
    dataset; an error is blamed on the override it names, not on the one that made the check run."""
    on = ["partial.enabled=true", "grpo.tis_cap=2"]
    train = ["train", "--config", cfg, "--out", tmp_path / "out"]
    line = _one_line_exit_2(capsys, [*train, *on, "partial.over_sample=1e9", "--print-config"],
                            "x (1 + partial.over_sample 1e+09) x grpo.group_size 4 = 1.6e+10 responses")
    assert ": error: partial.over_sample=1e9: " in line
    _one_line_exit_2(capsys, [*train, *on, "partial.over_sample=5"],
                     "data.jsonl: 20 usable prompts, fewer than the 24 groups a partial rollout launches")
    line = _one_line_exit_2(capsys, ["simulate", "--trace", _trace(tmp_path / "t.jsonl"), "partial.enabled=true",
                                     "partial.end=budget", "partial.token_budget=0", "--print-config"],
                            "end 'budget' needs a budget > 0, got 0")
    assert ": error: partial.token_budget=0: " in line


def test_yaml_duplicate_keys_aliases_long_values_and_yaml12_floats(cfg, tmp_path, capsys):
    text = cfg.read_text()
    dup = tmp_path / "dup.yaml"
    dup.write_text("optim:\n  lr: 0.1\n" + text + "optim:\n  lr: 0.2\n")
    line = _one_line_exit_2(capsys, ["train", "--config", dup, "--print-config"], f"{dup}:")
    assert "duplicate key 'optim' (first at line 1)" in line, line
    deep = tmp_path / "deep.yaml"
    deep.write_text(text + "warmstart:\n  lr: 0.1\n  sft_steps: 0\n  lr: 0.2\n")
    line = _one_line_exit_2(capsys, ["train", "--config", deep, "--print-config"], "duplicate key 'lr'")
    assert f"{deep}:{len(text.splitlines()) + 4}:" in line and "first at line" in line, line

    # 300 bytes of nested anchors: a billion-element value if anything expanded it.
    bomb = tmp_path / "bomb.yaml"
    levels = ['a0: &a0 ["x","x","x","x","x","x","x","x","x","x"]']
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    bomb.write_text("\n".join(levels) + "\nlogging:\n  tags: *a8\n")
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    _one_line_exit_2(capsys, ["train", "--config", bomb, "--print-config"], "aliases")
    assert time.monotonic() - t0 < 5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 100_000  # KiB

    long = tmp_path / "long.yaml"
    long.write_text(text + f"dtype: {'x' * 100_000}\n")
    _one_line_exit_2(capsys, ["train", "--config", long, "--print-config"], "more characters")

    floats = tmp_path / "floats.yaml"
    floats.write_text(text + "optim:\n  lr: 1e-3\n  eps: 5E-9\n")
    assert main(["train", "--config", str(floats), "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "lr: 0.001" in out and "eps: 5.0e-09" in out, out


def test_trace_lengths_beyond_any_model_and_deep_json_are_one_line(tmp_path, capsys):
    huge = _trace(tmp_path / "huge.jsonl", response_len=10**12)
    for argv in (["plan", "--trace", huge], ["predict", "--trace", huge],
                 ["simulate", "--trace", huge, "--ranks", "4", "--floor", "2"]):
        _one_line_exit_2(capsys, argv, f"{huge}:1: field 'response_len' is 1000000000000 tokens")
    deep = _trace(tmp_path / "deep.jsonl", extra="[" * 100_000 + "]" * 100_000)
    _one_line_exit_2(capsys, ["plan", "--trace", deep], f"{deep}:17: JSON nested too deeply")
    # A replayed rollout must not generate past the model's positions (it did, silently).
    _one_line_exit_2(capsys, ["rollout", "--trace", _trace(tmp_path / "long.jsonl", response_len=5000),
                              "--ranks", "2", "--length-scale", "1"], "beyond model.max_position_embeddings")


def test_trace_numbers_and_sizes_are_bounded_before_anything_is_sized_by_them(tmp_path, capsys, monkeypatch):
    """plan, predict and simulate alike: an epoch near 1e17 (np.bincount asked for 711 PiB), a
    sample index past any group, a 5000-digit integer (an uncaught ValueError), /dev/zero (one
    line growing without bound) and a file larger than any trace are one line each, in well under
    a second of work and memory."""
    from elastic import trace as trace_module

    line = '{{"prompt_id": "p0", "epoch": {e}, "sample": {s}, "prompt_len": 8, "response_len": 8}}'
    cases = {
        _trace(tmp_path / "epoch.jsonl", extra=line.format(e=10**17, s=0)):
            "field 'epoch' is 100000000000000000, beyond any run's rollouts (at most 1048575)",
        _trace(tmp_path / "sample.jsonl", extra=line.format(e=1, s=10**6)):
            "field 'sample' is 1000000, beyond any GRPO group's size (at most 4095)",
        _trace(tmp_path / "digits.jsonl", extra=line.format(e="9" * 5000, s=0)):
            "digits.jsonl:17: an integer of 5000 digits (at most 4300)",
        "/dev/zero": "/dev/zero:1: a line longer than 67108864 bytes",
    }
    huge = tmp_path / "huge.jsonl"  # sparse: its size is refused before a byte is read
    with open(huge, "wb") as fh:
        fh.truncate(trace_module.MAX_TRACE_BYTES + 1)
    cases[str(huge)] = f"{huge}: 4294967297 bytes, more than a trace may hold (at most 4294967296)"
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for path, expect in cases.items():
        for argv in (["plan", "--trace", path], ["predict", "--trace", path],
                     ["simulate", "--trace", path, "--ranks", "4", "--floor", "2"]):
            _one_line_exit_2(capsys, argv, expect)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0 < 1_000_000  # KiB
    # A pipe has no size to check first: it is counted as it is read.
    monkeypatch.setattr(trace_module, "MAX_TRACE_BYTES", 1000)
    read, write = os.pipe()
    with os.fdopen(write, "w") as fh:
        fh.write(Path(_trace(tmp_path / "t.jsonl")).read_text())
    _one_line_exit_2(capsys, ["plan", "--trace", f"/dev/fd/{read}"], "more than 1000 bytes, more than a trace")
    os.close(read)


def test_a_half_set_torchrun_environment_is_refused_naming_what_is_missing(capsys, monkeypatch):
    for var, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(var, value)
    _one_line_exit_2(capsys, ["rollout", "--ranks", "2", "--print-config"],
                     "torchrun environment half set", "MASTER_PORT, LOCAL_RANK not",
                     "unset RANK WORLD_SIZE MASTER_ADDR")


def test_overrides_after_flags(tmp_path, capsys):
    trace = _trace(tmp_path / "t.jsonl")
    assert main(["plan", "--trace", str(trace), "alpha=0.1", "--ranks", "4", "seed=3", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "alpha: 0.1" in out and "seed: 3" in out and "ranks: 4" in out, out


# ---- `key.sub=value` overrides and `--print-config` ------------------------------------------------
TRAIN = ["train", "--config", "examples/tiny_cpu_grpo.yaml"]
COMMANDS = {
    "rollout": (["rollout"], "batch.length_scale=0.5", ("batch", "length_scale"), 0.5),
    "train": (TRAIN, "grpo.group_size=16", ("grpo", "group_size"), 16),
    "plan": (["plan", "--trace", "T"], "alpha=0.1", ("alpha",), 0.1),
    "simulate": (["simulate", "--trace", "T"], "cost.shrink_fixed_s=1e-3", ("cost", "shrink_fixed_s"), 0.001),
}


def _run(capsys, argv):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def _get(d, path):
    for k in path:
        d = d[k]
    return d


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_print_config_shows_the_override(capsys, tailed_trace, command):
    argv, override, path, value = COMMANDS[command]
    argv = [str(tailed_trace) if a == "T" else a for a in argv]
    rc, out, err = _run(capsys, [*argv, override, "--print-config"])
    assert rc == 0, err
    assert _get(yaml.safe_load(out), path) == value


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_bad_key_bad_value_and_type_error_are_one_line_naming_the_override(capsys, tailed_trace, command):
    argv, override, _, _ = COMMANDS[command]
    argv = [str(tailed_trace) if a == "T" else a for a in argv]
    key = override.split("=")[0]
    section = key.rsplit(".", 1)[0] + "." if "." in key else ""
    cases = {
        f"{section}no_such_field=1": "unknown field 'no_such_field'",
        f"{key}=[1": "the value is not valid YAML",
        f"{key}=abc": "expected",
        "=3": "expected KEY=VALUE",
    }
    for bad, expect in cases.items():
        rc, out, err = _run(capsys, [*argv, bad, "--print-config"])
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1, (bad, err)
        assert lines[0].startswith(f"flexfloor {command}: error: ") and expect in lines[0], (bad, lines)
        if bad != "=3":
            assert f": error: {bad}: " in lines[0], (bad, lines)  # blamed on the override, not a file
        assert out == ""


def test_a_flag_error_names_the_flag_not_the_config_file(capsys):
    rc, _, err = _run(capsys, ["rollout", "--config", "examples/tiny_cpu.yaml", "--ranks", "0"])
    assert rc == 2 and "error: --ranks 0: ranks: expected > 0, got 0" in err and "tiny_cpu.yaml" not in err, err
    rc, _, err = _run(capsys, [*TRAIN, "--floor", "9"])
    assert rc == 2 and "error: --floor 9: elastic.floor: expected 1..ranks (4), got 9" in err, err


def test_a_file_error_still_names_the_file(capsys, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("ranks: 3\n")
    rc, _, err = _run(capsys, ["rollout", "--config", str(cfg), "seed=1"])
    assert rc == 2 and f"error: {cfg}: " in err, err


def test_resolved_config_reads_back_as_the_same_config(capsys, tmp_path):
    rc, out, _ = _run(capsys, [*TRAIN, "optim.lr=1e-6", "generation.top_p=0.5", "--print-config"])
    saved = tmp_path / "resolved.yaml"
    saved.write_text(out)
    rc, again, _ = _run(capsys, ["train", "--config", str(saved), "--print-config"])
    assert rc == 0 and again == out


@pytest.mark.parametrize("argv,other", [
    (["rollout", "--config", "examples/qwen3_30b_a3b_16xh100.yaml"], "`flexfloor train` config"),
    (["train", "--config", "examples/tiny_cpu.yaml"], "`flexfloor rollout` config"),
])
def test_a_config_given_to_the_wrong_command_is_named(capsys, argv, other):
    rc, _, err = _run(capsys, [*argv, "--print-config"])
    assert rc == 2
    assert "unknown field" in err and other in err
