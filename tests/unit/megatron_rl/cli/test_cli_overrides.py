"""`key.sub=value` overrides and `--print-config` for rollout, train, plan, simulate (issue 15 item 5),
in-process: each case stops before any rank starts."""
import pytest
import yaml

from megatron_rl.cli import main

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
