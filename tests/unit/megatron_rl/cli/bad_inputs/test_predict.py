"""`flexfloor predict`: bad traces and flags are one line naming the file, field or flag, exit 2."""
from megatron_rl.cli import main


def test_bad_input_is_one_line_exit_2_before_any_rank(files, refuses_each):
    latin1_trace, trace = files.latin1_trace, files.trace
    refuses_each("predict", [
        (["--trace", latin1_trace], [f"{latin1_trace}:2: not UTF-8 text"]),
        (["--trace", trace, "--alpha", "2"], ["--alpha: expected a value in (0, 1)"]),
        (["--trace", trace], ["needs at least two epochs"]),
    ])


def test_cli_prints_a_trace_error_as_one_line(tmp_path, capsys):
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"prompt_id": "p"}\n')
    assert main(["predict", "--trace", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flexfloor predict: error: ") and "t.jsonl:1" in err and "\n" not in err
